"""``throttle K COUNT PERIOD [burst=B] [cost=N] [wait=S]`` over TCP, on both backends
(docs/rate-limits.md): the GCRA's answers to the millisecond, the fair line of
``wait=``, peeks, bad requests, counters and ``--max-throttles``.

In memory the test runs on a MockClock, so every time is exact; on a cluster node
it runs in real time, so times are read with a margin (:func:`near`), a fraction of
a second: the cluster variants run with the latency-bound tests (``serial``), alone,
never beside the rest of the suite.
"""

from __future__ import annotations

import re

import pytest
import trio

from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import eventually, stats_showing


@pytest.fixture(
    params=["memory", pytest.param("cluster", marks=[pytest.mark.cluster, pytest.mark.serial])]
)
def backend(request: pytest.FixtureRequest) -> str:
    """The contract's two backends; the cluster's runs alone (sub-second margins)."""
    return str(request.param)


REPLY = re.compile(
    rb"(?P<code>200|409) limit=(?P<limit>\d+) remaining=(?P<remaining>\d+)"
    rb"(?: retry=(?P<retry>\d+))? reset=(?P<reset>\d+)\r\n\Z"
)


def fields(reply: bytes) -> dict[str, int]:
    """The reply's numbers by name (``code`` too); fails on any other shape."""
    match = REPLY.match(reply)
    assert match, reply
    return {name: int(value) for name, value in match.groupdict().items() if value is not None}


def near(actual: float, expected: float, backend: str, margin: float = 0.15) -> bool:
    """Exact on the MockClock (to the nanosecond: a turn is set a hair early, inside
    the rule's float tolerance); within ``margin`` (seconds, or ms) in real time."""
    return abs(actual - expected) <= (1e-6 if backend == "memory" else margin)


async def test_ten_at_once_then_the_eleventh_is_told_when(
    lock_server: RunningServer, backend: str, clock: object
) -> None:
    """The issue's example: ``throttle api 10 60`` admits 10 at once; the 11th
    hears ``retry=6000``: one emission interval (60 s / 10)."""
    client = await lock_server.connect()
    for left in range(9, -1, -1):
        got = fields(await client.reply(b"throttle api 10 60"))
        assert got["code"] == 200 and got["limit"] == 10 and got["remaining"] == left
        assert near(got["reset"], (10 - left) * 6000, backend, 150)
    got = fields(await client.reply(b"throttle api 10 60"))
    assert got["code"] == 409 and got["remaining"] == 0
    assert near(got["retry"], 6000, backend, 150)
    assert near(got["reset"], 60000, backend, 150)
    # Nothing changed: the same answer again, and the counters.
    again = fields(await client.reply(b"throttle api 10 60"))
    assert again["code"] == 409 and near(again["retry"], got["retry"], backend, 150)
    values = await eventually(lambda: stats_showing(client, admitted=10, throttled=2))
    assert values["throttles"] == 1


async def test_a_waiter_is_admitted_when_the_rate_allows(
    lock_server: RunningServer, backend: str, clock: object
) -> None:
    client, waiter = await lock_server.connect(), await lock_server.connect()
    for _ in range(10):
        assert (await client.reply(b"throttle api 10 60")).startswith(b"200 ")
    full = trio.current_time()
    got = fields(await waiter.reply(b"throttle api 10 60 wait=7"))
    took = trio.current_time() - full
    assert got["code"] == 200 and got["remaining"] == 0
    assert near(took, 6.0, backend, 0.1), took
    # One that cannot make it within its wait is told at once, with its retry.
    started = trio.current_time()
    got = fields(await waiter.reply(b"throttle api 10 60 wait=2"))
    assert got["code"] == 409 and near(got["retry"], 6000, backend, 150)
    assert trio.current_time() - started < 0.1


async def test_waiters_are_admitted_in_arrival_order_whatever_their_cost(
    lock_server: RunningServer, backend: str, clock: object
) -> None:
    """Costs 5, 1 and 1 on an empty budget (burst 5, one unit every 0.2 s): the
    cheap ones could pass at 0.2 s, but never overtake the first."""
    first, second, third, watcher = [await lock_server.connect() for _ in range(4)]
    assert (await first.reply(b"throttle k 5 1 cost=5")).startswith(b"200 limit=5 remaining=0 ")
    start = trio.current_time()
    admitted: list[tuple[str, float]] = []

    async def ask(name: str, client: LineClient, cost: int) -> None:
        reply = await client.reply(b"throttle k 5 1 cost=%d wait=5" % cost)
        assert reply.startswith(b"200 "), reply
        admitted.append((name, trio.current_time() - start))

    async with trio.open_nursery() as nursery:
        for waiting, (name, client, cost) in enumerate(
            [("five", first, 5), ("one", second, 1), ("other", third, 1)], start=1
        ):
            nursery.start_soon(ask, name, client, cost)
            await eventually(lambda n=waiting: stats_showing(watcher, waiting=n))  # type: ignore[misc]
    assert [name for name, _ in admitted] == ["five", "one", "other"]
    # five at 1.0 s (the budget back), then one unit every 0.2 s after it.
    for (_, at), expected in zip(admitted, [1.0, 1.2, 1.4], strict=True):
        assert abs(at - expected) <= (1e-6 if backend == "memory" else 0.15), admitted


async def test_a_peek_changes_nothing(
    lock_server: RunningServer, backend: str, clock: object
) -> None:
    client = await lock_server.connect()
    fresh = fields(await client.reply(b"throttle p 4 1 cost=0"))
    assert fresh == {"code": 200, "limit": 4, "remaining": 4, "reset": 0}
    assert (await client.stats())["throttles"] == 0  # a peek adds no state
    for _ in range(4):
        await client.reply(b"throttle p 4 1")
    before = await client.stats()
    peek = fields(await client.reply(b"throttle p 4 1 cost=0"))
    assert (
        peek["code"] == 200 and peek["remaining"] == 0 and near(peek["reset"], 1000, backend, 150)
    )
    after = await client.stats()
    assert after["admitted"] == before["admitted"] and after["throttled"] == before["throttled"]
    assert fields(await client.reply(b"throttle p 4 1"))["code"] == 409


async def test_a_waiters_disconnect_cancels_its_wait_and_changes_nothing(
    lock_server: RunningServer, backend: str, clock: object
) -> None:
    client, leaver, watcher = [await lock_server.connect() for _ in range(3)]
    assert (await client.reply(b"throttle d 1 10")).startswith(b"200 ")
    admitted = trio.current_time()
    await leaver.send(b"throttle d 1 10 wait=20\n")
    await eventually(lambda: stats_showing(watcher, waiting=1))
    await leaver.aclose()
    await eventually(lambda: stats_showing(watcher, waiting=0))
    asked = trio.current_time()
    got = fields(await client.reply(b"throttle d 1 10"))
    # As if the waiter had never come: its turn was not taken.
    expected = 10000 - (asked - admitted) * 1000
    assert got["code"] == 409 and abs(got["retry"] - expected) <= (
        1 if backend == "memory" else 300
    )


async def test_throttle_keys_are_their_own_namespace_and_lapse(
    lock_server: RunningServer, backend: str, clock: object
) -> None:
    client = await lock_server.connect()
    assert (await client.reply(b"throttle shared-name 1 0.5")).startswith(b"200 ")
    assert await client.reply(b"lock shared-name") == b"200 Acquired\r\n"
    assert (await client.reply(b"throttle shared-name 1 0.5")).startswith(b"409 ")
    # Once its TAT has passed the key is as if never asked: no state is kept.
    await eventually(lambda: stats_showing(client, throttles=0), interval=0.1)
    got = fields(await client.reply(b"throttle shared-name 1 0.5"))
    assert got["code"] == 200 and got["remaining"] == 0


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"throttle", b"missing key"),
        (b"throttle k", b"missing COUNT PERIOD"),
        (b"throttle k 10", b"missing PERIOD"),
        (b"throttle k 0 1", b"COUNT must be a whole number above 0"),
        (b"throttle k 1.5 1", b"COUNT must be a whole number above 0"),
        (b"throttle k -1 1", b"COUNT must be a whole number above 0"),
        (b"throttle k 10 0", b"PERIOD must be above 0"),
        (b"throttle k 10 nan", b"PERIOD must be a non-negative number"),
        (b"throttle k 10 86401", b"PERIOD above --max-ttl (86400 s)"),
        (b"throttle k 10 1 burst=0", b"burst must be a whole number above 0"),
        (b"throttle k 10 1 cost=-1", b"cost must be a whole number"),
        (b"throttle k 10 1 burst=5 cost=6", b"cost above burst"),
        (b"throttle k 10 1 cost=11", b"cost above burst"),
        (b"throttle k 10 1 wait=inf", b"wait must be a non-negative number"),
        (b"throttle k 10 1 wait=86401", b"wait above --max-ttl (86400 s)"),
        (b"throttle k 10 1 limit=3", b"unknown option limit"),
        (b"throttle k 10 1 2", b"too many arguments"),
    ],
)
async def test_bad_requests_are_400_and_change_nothing(
    lock_server: RunningServer, clock: object, line: bytes, reason: bytes
) -> None:
    client = await lock_server.connect()
    assert await client.reply(line) == b"400 Bad Request: " + reason + b"\r\n"
    values = await client.stats()
    assert (values["throttles"], values["admitted"], values["throttled"]) == (0, 0, 0)
