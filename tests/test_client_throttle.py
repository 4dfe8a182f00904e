"""``throttle`` in the clients: the request line, the reply read strictly, the rate
limiter's settings (sans-IO, no server), then both against a real server."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from elockd.client import (
    AuthError,
    BlockingClient,
    BlockingRateLimiter,
    Client,
    RateLimiter,
    RequestError,
    Throttled,
    ThrottleResult,
    Unavailable,
    calls,
)
from elockd.client.core import ClientCore
from elockd.client.throttles import throttle_line
from elockd.protocol.config import Config
from tests.support.line_client import RunningServer
from tests.support.server_process import start_server, stop_server


def asked(reply: bytes, **call: object) -> ThrottleResult:
    """The result of one ``throttle`` call answered with ``reply`` (no server)."""
    core = ClientCore(threading.Event)
    arguments: dict[str, object] = {"key": "api", "count": 10, "period": 60, **call}
    op = calls.throttle(core, 0.0, **arguments)  # type: ignore[arg-type]
    core.data_to_send()
    core.receive(reply + b"\r\n", 0.5)
    assert core.error is None
    return op.finish()


# ---------------------------------------------------------------- the request line


@pytest.mark.parametrize(
    ("call", "line"),
    [
        ({}, b"throttle api 10 60"),
        ({"period": 1.5}, b"throttle api 10 1.5"),
        ({"period": 0.25, "count": 5}, b"throttle api 5 0.25"),
        ({"burst": 3}, b"throttle api 10 60 burst=3"),
        ({"cost": 0}, b"throttle api 10 60 cost=0"),
        ({"cost": 4, "wait": 7}, b"throttle api 10 60 cost=4 wait=7"),
        ({"wait": 0.5, "burst": 1}, b"throttle api 10 60 burst=1 wait=0.5"),
        ({"wait": 0}, b"throttle api 10 60"),  # 0: ask once, as no wait
        ({"wait": None}, b"throttle api 10 60"),
        ({"key": b"bytes-key"}, b"throttle bytes-key 10 60"),
    ],
)
def test_the_request_line(call: dict[str, object], line: bytes) -> None:
    arguments: dict[str, object] = {"key": "api", "count": 10, "period": 60, **call}
    assert throttle_line(**arguments) == line  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "words"),
    [
        ({"count": 0}, "count must be a whole number >= 1"),
        ({"count": 2.5}, "count must be a whole number"),
        ({"count": True}, "count must be a whole number"),
        ({"period": 0}, "period must be a number of seconds above 0"),
        ({"period": 1e-9}, "period must be a number of seconds above 0"),
        ({"period": -1}, "period must be a finite number >= 0"),
        ({"period": float("inf")}, "period must be a finite number"),
        ({"period": "60"}, "period must be a number of seconds"),
        ({"burst": 0}, "burst must be a whole number >= 1"),
        ({"cost": -1}, "cost must be a whole number >= 0"),
        ({"wait": -1}, "wait must be a finite number >= 0"),
        ({"key": "two words"}, "a key must be non-empty"),
        ({"key": ""}, "a key must be non-empty"),
    ],
)
def test_values_the_server_could_never_take_raise_before_sending(
    call: dict[str, object], words: str
) -> None:
    core = ClientCore(threading.Event)
    arguments: dict[str, object] = {"key": "api", "count": 10, "period": 60, **call}
    with pytest.raises(ValueError, match=words):
        calls.throttle(core, 0.0, **arguments)  # type: ignore[arg-type]
    assert not core.pending and core.data_to_send() == b""


def test_a_wait_is_added_to_the_reply_deadline() -> None:
    """The server may keep a ``wait=7`` request 7 s before it answers: its reply is
    due 7 s + the reply timeout after it is sent, not the reply timeout alone."""
    core = ClientCore(threading.Event, reply_timeout=10)
    calls.throttle(core, 100.0, "api", 10, 60, wait=7)
    calls.throttle(core, 100.0, "other", 10, 60)
    assert [request.deadline for request in core.pending] == [117.0, 117.0]
    core.tick(116.9)
    assert core.error is None


# ---------------------------------------------------------------- the replies


def test_an_admitted_reply_in_seconds() -> None:
    assert asked(b"200 limit=10 remaining=9 reset=6000") == ThrottleResult(
        admitted=True, limit=10, remaining=9, retry_after=0.0, reset_after=6.0
    )
    peek = asked(b"200 limit=5 remaining=5 reset=0", cost=0)
    assert peek.admitted and peek.remaining == 5 and peek.reset_after == 0.0


def test_a_limited_reply_in_seconds() -> None:
    """The durations are float seconds from the wire's milliseconds: a 6 s retry is
    6.0, a 199 ms one 0.199, never rounded to whole seconds."""
    result = asked(b"409 limit=10 remaining=0 retry=6000 reset=60000")
    assert result == ThrottleResult(
        admitted=False, limit=10, remaining=0, retry_after=6.0, reset_after=60.0
    )
    assert asked(b"409 limit=5 remaining=0 retry=199 reset=1000").retry_after == 0.199


def test_the_result_is_frozen() -> None:
    result = asked(b"200 limit=10 remaining=9 reset=6000")
    with pytest.raises(AttributeError):
        result.admitted = False  # type: ignore[misc]


@pytest.mark.parametrize(
    "reply",
    [
        b"400 Bad Request: cost above burst",
        b"413 Too Many Throttles",
        b"413 Too Many Waiters",
        b"409 Backend Unavailable",  # no quorum: nobody knows the rate, it is no "no"
        b"0 Backend Unavailable",
        b"200 Acquired",  # another verb's yes is no answer here
        b"200 limit=10 remaining=9",  # a field missing
        b"200 limit=10 remaining=9 reset=6000 extra",
        b"200 limit=10 remaining=-1 reset=6000",
        b"409 limit=10 remaining=0 reset=6000",  # a refusal without its retry
        b"409 limit=10 remaining=0 retry=6000 reset=" + b"9" * 400,  # no OverflowError
    ],
)
def test_a_reply_that_is_no_answer_about_the_rate_raises(reply: bytes) -> None:
    with pytest.raises(RequestError) as raised:
        asked(reply)
    assert raised.value.reply == reply
    assert not isinstance(raised.value, AuthError)
    assert str(raised.value).startswith("throttle: ")


@pytest.mark.parametrize("reply", [b"403 Auth Required", b"0 Auth Required"])
def test_an_auth_refusal_is_an_auth_error(reply: bytes) -> None:
    with pytest.raises(AuthError):
        asked(reply)


# ---------------------------------------------------------------- the rate limiter's settings


@pytest.mark.parametrize("limiter", [RateLimiter, BlockingRateLimiter])
def test_a_rate_limiter_takes_a_concurrency_a_rate_or_both(
    limiter: type[RateLimiter] | type[BlockingRateLimiter],
) -> None:
    concurrency = limiter("api", 5)
    assert (concurrency.limit, concurrency.rate, concurrency.burst) == (5, None, None)
    rate = limiter("api", rate=(100, 60), burst=10)
    assert (rate.limit, rate.rate, rate.burst) == (None, (100, 60), 10)
    both = limiter("api", limit=3, rate=(5, 1.0), wait=2)
    assert (both.limit, both.rate, both.wait) == (3, (5, 1.0), 2)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({}, "give limit=N"),
        ({"limit": 0}, "limit must be at least 1"),
        ({"limit": 2.5}, "limit must be a whole number"),
        ({"rate": (0, 60)}, "count must be"),
        ({"rate": (10, 0)}, "period must be"),
        ({"limit": 3, "burst": 2}, "burst needs rate"),
        ({"rate": (10, 60), "ttl": 30}, "ttl is the lease of a concurrency slot"),
        ({"rate": (10, 60), "burst": 0}, "burst must be"),
    ],
)
def test_a_rate_limiter_refuses_settings_that_cannot_work(
    settings: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        RateLimiter("api", **settings)  # type: ignore[arg-type]


def test_throttled_is_an_unavailable_with_the_retry() -> None:
    result = ThrottleResult(False, 5, 0, 0.2, 1.0)
    error = Throttled("limited", result)
    assert isinstance(error, Unavailable)
    assert (error.retry_after, error.result) == (0.2, result)


# ------------------------------------------------ against a server (trio, mock clock)


async def test_ten_per_minute_admits_ten_then_says_when_to_retry(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with Client(port=server.port) as client:
        results = [await client.throttle("api", 10, 60) for _ in range(11)]
    assert all(result.admitted for result in results[:10])
    assert [result.remaining for result in results[:10]] == list(range(9, -1, -1))
    assert results[0] == ThrottleResult(True, 10, 9, 0.0, 6.0)
    assert results[10] == ThrottleResult(
        admitted=False, limit=10, remaining=0, retry_after=6.0, reset_after=60.0
    )


async def test_a_wait_is_admitted_when_the_rate_allows(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with Client(port=server.port) as client:
        for _ in range(10):
            assert (await client.throttle("api", 10, 60)).admitted
        start = trio.current_time()
        short = await client.throttle("api", 10, 60, wait=5)  # 5 s is not enough
        waited = trio.current_time() - start  # (the server may say so at once)
        assert (short.admitted, short.retry_after) == (False, pytest.approx(6 - waited))
        result = await client.throttle("api", 10, 60, wait=7)
        assert trio.current_time() - start == pytest.approx(6)
        assert result.admitted and result.remaining == 0


async def test_a_peek_changes_nothing(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with Client(port=server.port) as client:
        for _ in range(3):
            await client.throttle("api", 10, 60)
        peeks = [await client.throttle("api", 10, 60, cost=0) for _ in range(3)]
        assert {(peek.admitted, peek.remaining) for peek in peeks} == {(True, 7)}
        after = await client.throttle("api", 10, 60, cost=2)
        assert (after.admitted, after.remaining) == (True, 5)


@pytest.mark.parametrize("server_config", [Config(port=0, metrics_port=0, max_throttles=1)])
async def test_refusals_raise_and_change_nothing(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with Client(port=server.port) as client:
        with pytest.raises(RequestError, match="400 Bad Request: cost above burst") as raised:
            await client.throttle("api", 10, 60, cost=11)
        assert raised.value.reply.startswith(b"400 ")
        assert (await client.throttle("api", 10, 60)).remaining == 9
        with pytest.raises(RequestError, match="413 Too Many Throttles"):
            await client.throttle("another", 10, 60)
        assert (await client.throttle("api", 10, 60)).remaining == 8  # still usable


# ---------------------------------------------------------------- RateLimiter


def assert_within_rate(starts: list[float], since: float, burst: int, per_second: float) -> None:
    """The k-th call (from 1) began no sooner than ``(k - burst) / per_second`` after
    ``since``, a time before any admission: the calls never outran the rate."""
    for k, start in enumerate(sorted(starts), start=1):
        assert start - since >= (k - burst) / per_second - 1e-6, (k, start - since)


async def test_rate_limiter_caps_rate_and_concurrency_at_once(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    """Both caps bind in one run: short calls meet the rate (10 per second, burst
    2), long ones the concurrency (3 in flight)."""
    active = peak = 0
    starts: list[float] = []
    jobs = list(range(30))

    async def worker(limiter: RateLimiter) -> None:
        nonlocal active, peak
        while jobs:
            job = jobs.pop()
            async with limiter.slot() as hold:
                assert hold is not None and hold.shared
                starts.append(trio.current_time())
                active += 1
                peak = max(peak, active)
                await trio.sleep(1.0 if job % 3 == 0 else 0.01)
                active -= 1

    since = trio.current_time()
    async with (
        RateLimiter("both", 3, rate=(10, 1.0), burst=2, port=server.port, wait=100) as limiter,
        trio.open_nursery() as nursery,
    ):
        for _ in range(8):
            nursery.start_soon(worker, limiter)
    assert len(starts) == 30 and peak == 3
    assert_within_rate(starts, since, burst=2, per_second=10)
    # The rate is used, not starved: 30 calls at 10 per second, burst 2, plus the
    # waits for a place behind the long calls.
    assert max(starts) - since <= 4.5
    observer = await server.connect()
    stats = await observer.stats()
    assert (stats["admitted"], stats["throttled"], stats["waiting"]) == (30, 0, 0)


async def test_rate_limiter_on_a_rate_alone_spaces_the_calls(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    starts: list[float] = []

    async def worker(limiter: RateLimiter) -> None:
        async with limiter.slot() as hold:
            assert hold is None  # no concurrency cap, no hold
            starts.append(trio.current_time())

    since = trio.current_time()
    async with (
        RateLimiter("spaced", rate=(5, 1.0), burst=1, port=server.port) as limiter,
        trio.open_nursery() as nursery,
    ):
        for _ in range(6):
            nursery.start_soon(worker, limiter)
    assert sorted(start - since for start in starts) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])


async def test_rate_limiter_raises_throttled_when_no_turn_comes(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with RateLimiter("once", rate=(1, 60), port=server.port, wait=None) as limiter:
        async with limiter.slot():
            pass
        with pytest.raises(Throttled, match="'once': limited, retry after 60.000 s") as raised:
            async with limiter.slot():
                raise AssertionError("a limited slot ran its block")
        assert raised.value.retry_after == 60.0 and not raised.value.result.admitted
    async with RateLimiter("short", 1, rate=(1, 60), port=server.port, wait=10) as limiter:
        async with limiter.slot():
            pass
        start = trio.current_time()
        with pytest.raises(Throttled) as raised:
            async with limiter.slot():
                raise AssertionError("a limited slot ran its block")
        waited = trio.current_time() - start
        assert waited <= 10  # wait bounds the turn (the server may say no at once)
        assert raised.value.retry_after == pytest.approx(60 - waited)


async def test_a_rate_wait_given_up_leaves_the_line(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    """A cancelled slot still in the rate's line drops its connection: the server
    takes the waiter out of line, and it spends nothing."""
    observer = await server.connect()
    async with RateLimiter("line", 1, rate=(1, 60), port=server.port, wait=100) as limiter:
        async with limiter.slot():
            pass
        with trio.move_on_after(5):
            async with limiter.slot():
                raise AssertionError("admitted within 5 s of a 60 s turn")
        await trio.sleep(1)
        assert (await observer.stats())["waiting"] == 0
        assert await observer.request(b"throttle line 1 60 cost=0") == (
            b"200 limit=1 remaining=0 reset=54000"
        )
        with trio.move_on_after(60):  # the limiter still works: the turn at 60 s
            async with limiter.slot():
                assert trio.current_time() == pytest.approx(60, abs=0.01)


# ------------------------------------------------ the blocking client, a real process


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    process, port = start_server()
    yield port
    stop_server(process)


def test_blocking_ten_per_minute(port: int) -> None:
    with BlockingClient(port=port) as client:
        results = [client.throttle("sync-api", 10, 60) for _ in range(11)]
    assert [result.admitted for result in results] == [True] * 10 + [False]
    assert 5.9 < results[10].retry_after <= 6.0  # real time passed between the calls
    assert results[10].reset_after == pytest.approx(60, abs=0.1)


def test_blocking_rate_limiter_caps_rate_and_concurrency(port: int) -> None:
    active = peak = 0
    starts: list[float] = []
    meter = threading.Lock()

    def worker(limiter: BlockingRateLimiter) -> None:
        nonlocal active, peak
        for _ in range(3):
            with limiter.slot():
                with meter:
                    starts.append(time.monotonic())
                    active += 1
                    peak = max(peak, active)
                time.sleep(0.05)
                with meter:
                    active -= 1

    since = time.monotonic()  # the server's clock is the same monotonic clock
    with BlockingRateLimiter("sync-both", 2, rate=(20, 1.0), burst=1, port=port) as limiter:
        threads = [threading.Thread(target=worker, args=(limiter,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(starts) == 12 and 1 <= peak <= 2
    assert_within_rate(starts, since, burst=1, per_second=20)


def test_blocking_limiter_interrupted_in_the_rate_line_leaves_it(port: int) -> None:
    """A signal handler raising (Ctrl-C) while a slot waits in the rate's line: the
    slot's connection is closed, which takes the waiter out of the server's line."""

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with (
            BlockingRateLimiter("sync-line", rate=(1, 60), port=port, wait=100) as limiter,
            BlockingClient(port=port) as observer,
        ):
            with limiter.slot():
                pass
            timer = threading.Timer(
                0.3, signal.pthread_kill, [threading.get_ident(), signal.SIGUSR1]
            )
            timer.start()
            started = time.monotonic()
            with pytest.raises(Interrupted), limiter.slot():
                raise AssertionError("admitted within 0.3 s of a 60 s turn")
            timer.join()
            assert time.monotonic() - started < 5  # not held up by the wait behind
            waiting = observer.stats()["waiting"]
            for _ in range(100):  # the server sees the connection's end at once
                if waiting == 0:
                    break
                time.sleep(0.02)
                waiting = observer.stats()["waiting"]
            assert waiting == 0
    finally:
        signal.signal(signal.SIGUSR1, previous)
