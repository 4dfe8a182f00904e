"""``ls [PREFIX] [older=S] [limit=N]`` over TCP (docs/protocol.md: Operators).

The contract tests take ``lock_server`` and ``clock``, so they run on both
backends: in memory on a clock that only moves when the test moves it (ages exact
to the millisecond), and on a cluster node in real time, with times a tenth as
long and ages compared within a tolerance (a cluster ages a hold on the wall
clock, from its entry's write). The engine-level tests check the in-memory ordered
index itself: a prefix costs the keys under it, and stale keys go.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from elockd.backend.memory import MemoryBackend
from elockd.engine.keyindex import SWEEP_SLACK
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import until_waiting


async def ls(client: LineClient, request: bytes) -> list[bytes]:
    """The lines of an ``ls`` reply, ``END`` left out (it must be there)."""
    lines = (await client.listing(request)).split(b"\r\n")
    assert lines[-2:] == [b"END", b""]
    return lines[:-2]


def unit(clock: trio.testing.MockClock | None) -> float:
    """The test's unit of time: 1 s on the mock clock, 0.1 s in real time."""
    return 1.0 if clock is not None else 0.1


async def pass_time(clock: trio.testing.MockClock | None, seconds: float) -> None:
    if clock is not None:
        clock.jump(seconds)
    else:
        await trio.sleep(seconds)


def field(line: bytes, name: bytes) -> float:
    return float(line.split(b" " + name + b"=")[1].split(b" ")[0])


def without_times(line: bytes) -> list[bytes]:
    return [f for f in line.split(b" ") if not f.startswith((b"age=", b"ttl="))]


async def test_ls_lists_exactly_the_held_and_waited_keys_under_a_prefix_with_growing_ages(
    lock_server: RunningServer, clock: trio.testing.MockClock | None
) -> None:
    u = unit(clock)
    server = lock_server
    alice, bob, carol = await server.connect(), await server.connect(), await server.connect()
    assert await alice.request(b"iam alice") == b"1 ok"
    assert await bob.request(b"iam bob") == b"1 ok"
    assert await alice.request(b"lock jobs/a") == b"200 Acquired"
    token_a = int((await alice.request(b"token jobs/a")).split()[1])
    await pass_time(clock, 10 * u)
    assert await alice.request(b"lock jobs/b 0 ttl=30") == b"200 Acquired"
    token_b = int((await alice.request(b"token jobs/b")).split()[1])
    assert await bob.request(b"lock_shared jobs/c") == b"200 1"
    await pass_time(clock, 5 * u)
    assert await alice.request(b"lock_shared jobs/c") == b"200 2"
    # Not under jobs/: a sibling prefix, another tree, a key only released.
    assert await bob.request(b"lock jobsx") == b"200 Acquired"
    assert await bob.request(b"lock other/x") == b"200 Acquired"
    assert await bob.request(b"lock jobs/gone") == b"200 Acquired"
    assert await bob.request(b"unlock jobs/gone") == b"200 Unlocked"
    await carol.send(b"lock jobs/a 600\n")
    await until_waiting(bob, b"jobs/a")

    def expected(after: float) -> list[bytes]:
        return [
            b"jobs/a exclusive=alice shared=0 waiting=1 age=%.3f token=%d ttl=-"
            % ((15 + after) * u, token_a),
            b"jobs/b exclusive=alice shared=0 waiting=0 age=%.3f token=%d ttl=%.3f"
            % ((5 + after) * u, token_b, 30 - (5 + after) * u),
            b"jobs/c exclusive=- shared=2 waiting=0 age=%.3f token=- ttl=-" % ((5 + after) * u),
        ]

    first = await ls(bob, b"ls jobs/")
    await pass_time(clock, 2.5 * u)
    again = await ls(bob, b"ls jobs/")
    if clock is not None:
        assert (first, again) == (expected(0), expected(2.5))
    else:
        # Real time: what the requests took counts too, so the ages are compared
        # with each other (the same time went by for each) and with the waits.
        assert [without_times(line) for line in first] == [
            without_times(line) for line in expected(0)
        ]
        a, b, c = (field(line, b"age") for line in first)
        assert 10 * u - 0.05 <= a - b <= 10 * u + 0.3
        assert -0.05 <= b - c <= 0.3 and c >= 5 * u
        assert 29.7 <= b + field(first[1], b"ttl") <= 30.05
        for before, after in zip(first, again, strict=True):
            assert field(after, b"age") - field(before, b"age") >= 2.5 * u - 0.002
    # Without a prefix: every key, in byte order.
    keys = [line.split(b" ")[0] for line in await ls(bob, b"ls")]
    assert keys == [b"jobs/a", b"jobs/b", b"jobs/c", b"jobsx", b"other/x"]
    assert await ls(bob, b"ls nothing/") == []


async def test_older_keeps_old_enough_keys_and_limit_cuts_with_a_more_line(
    lock_server: RunningServer, clock: trio.testing.MockClock | None
) -> None:
    gap = 10.0 if clock is not None else 0.5  # k/0 is 5 gaps old at the end, k/4 one
    client = await lock_server.connect()
    for index in range(5):
        assert await client.request(b"lock k/%d" % index) == b"200 Acquired"
        await pass_time(clock, gap)
    assert await client.request(b"lock_shared other") == b"200 1"

    more = "… more".encode()

    def keys(lines: list[bytes]) -> list[bytes]:
        return [line if line == more else line.split(b" ")[0] for line in lines]

    def older(gaps: float) -> bytes:
        return b"older=%g" % (gaps * gap)

    if clock is not None:  # exact on the mock clock: k/2 is exactly 3 gaps old
        assert keys(await ls(client, b"ls k/ older=30")) == [b"k/0", b"k/1", b"k/2"]
        assert keys(await ls(client, b"ls k/ older=30.001")) == [b"k/0", b"k/1"]
    assert keys(await ls(client, b"ls k/ " + older(2.5))) == [b"k/0", b"k/1", b"k/2"]
    assert keys(await ls(client, b"ls k/ older=0")) == [b"k/%d" % i for i in range(5)]
    # older= with no prefix: the option, not a key named "older=...".
    assert keys(await ls(client, b"ls " + older(3.5))) == [b"k/0", b"k/1"]
    assert keys(await ls(client, b"ls k/ limit=2")) == [b"k/0", b"k/1", more]
    assert keys(await ls(client, b"ls k/ " + older(1.5) + b" limit=3")) == [
        b"k/0",
        b"k/1",
        b"k/2",
        more,
    ]
    # Exactly N match: no "more" line.
    assert keys(await ls(client, b"ls k/ limit=5")) == [b"k/%d" % i for i in range(5)]
    assert keys(await ls(client, b"ls k/ " + older(2.5) + b" limit=3")) == [b"k/0", b"k/1", b"k/2"]
    assert keys(await ls(client, b"ls limit=1")) == [b"k/0", more]


@pytest.mark.parametrize(
    ("request_line", "reply"),
    [
        (b"ls k/ older=soon", b"400 Bad Request: older must be a non-negative number"),
        (b"ls k/ limit=0", b"400 Bad Request: limit must be a whole number above 0"),
        (b"ls a/ b/", b"400 Bad Request: too many arguments"),
        (b"ls k/ ttl=3", b"400 Bad Request: unknown option ttl"),
        (b"ls older=1 older=2", b"400 Bad Request: option older given twice"),
    ],
)
async def test_bad_ls_arguments_get_400(
    lock_server: RunningServer, request_line: bytes, reply: bytes
) -> None:
    client = await lock_server.connect()
    assert await client.request(request_line) == reply
    assert await client.request(b"ping") == b"200 PONG"


def test_a_prefix_reads_only_the_keys_under_it() -> None:
    """O(matching keys): 20,000 other keys are not looked at."""
    engine = MemoryBackend()
    session = engine.open_session("s", b"127.0.0.1:1")
    engine.max_holds = 30_000
    for index in range(20_000):
        assert engine.acquire(session, b"bulk/%05d" % index, 0.0)
    for index in range(10):
        assert engine.acquire(session, b"jobs/%d" % index, 0.0)
    looked: list[bytes] = []
    row_for = engine._row_for

    def counting(key: bytes, now: float) -> object:
        looked.append(key)
        return row_for(key, now)

    engine._row_for = counting  # type: ignore[method-assign]
    rows = [row for row in engine.listing(b"jobs/", 1.0, older=None, limit=None) if row]
    assert [row.key for row in rows] == [b"jobs/%d" % i for i in range(10)]
    assert looked == [b"jobs/%d" % i for i in range(10)]


def test_released_keys_are_skipped_then_swept_away() -> None:
    """The index is lazy: a released key stays in it (stale) until a sweep, which the
    timer runs once the stale keys outnumber the live ones plus the slack."""
    engine = MemoryBackend()
    woken: list[bool] = []
    engine.on_new_deadline = lambda: woken.append(True)
    session = engine.open_session("s", b"127.0.0.1:1")
    assert engine.acquire(session, b"kept", 0.0)
    for index in range(SWEEP_SLACK + 3):
        key = b"churn/%d" % index
        assert engine.acquire(session, key, 0.0)
        assert engine.release(session, key, 0.0)
    assert engine.index.sweeping and woken == [True]
    assert engine.next_deadline() == -float("inf")
    assert [r.key for r in engine.listing(b"", 0.0, older=None, limit=None) if r] == [b"kept"]
    while engine.advance(1.0, budget=100):
        pass
    assert not engine.index.sweeping
    assert list(engine.index.ordered) == [b"kept"] and not engine.index.stale
    # A key granted again after its sweep is indexed again.
    assert engine.acquire(session, b"churn/7", 2.0)
    assert [r.key for r in engine.listing(b"churn/", 2.0, older=None, limit=None) if r] == [
        b"churn/7"
    ]


def test_a_restored_engine_builds_its_index_at_the_first_listing() -> None:
    engine = MemoryBackend()
    session = engine.open_session("s", b"127.0.0.1:1")
    engine.exclusive[b"b"] = engine._grant_exclusive(session, b"b", 0.0, None)
    engine.index.ordered.clear()
    engine.index.rebuild = True  # as MemoryRestore leaves it
    assert engine.acquire(session, b"a", 0.0)
    assert [r.key for r in engine.listing(b"", 1.0, older=None, limit=None) if r] == [b"a", b"b"]
    assert not engine.index.rebuild


def test_a_long_filtered_scan_yields_between_batches() -> None:
    """``older=`` that leaves a batch of keys out yields None there: the reply lets
    other connections run instead of scanning every key in one step."""
    engine = MemoryBackend()
    engine.max_holds = 10_000
    session = engine.open_session("s", b"127.0.0.1:1")
    for index in range(1000):
        assert engine.acquire(session, b"k%04d" % index, 10.0)
    rows = list(engine.listing(b"", 10.0, older=5.0, limit=None))
    assert rows and all(row is None for row in rows)
