"""``throttle`` in the clients: the request line, the reply read strictly, the rate
limiter's settings (sans-IO, no server), then both against a real server."""

from __future__ import annotations

import threading

import pytest

from elockd.client import (
    AuthError,
    BlockingRateLimiter,
    RateLimiter,
    RequestError,
    Throttled,
    ThrottleResult,
    Unavailable,
    calls,
)
from elockd.client.core import ClientCore
from elockd.client.throttles import throttle_line


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
