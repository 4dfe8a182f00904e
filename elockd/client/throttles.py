"""``throttle``: a rate limit (GCRA) read and written by the client, sans-IO.

The request line is built and its reply read here, once, for both clients
(:func:`elockd.client.calls.throttle` makes it their ``throttle`` method). The
server answers in whole milliseconds; the result gives seconds as ``float``, so a
caller can hand ``retry_after`` to ``trio.sleep`` or an HTTP ``Retry-After``
without a unit mistake (redis-cell's whole seconds are a known trap: its
``retry_after`` of 0 for a 400 ms wait).

A request that was answered at all answers yes (``200``) or no (``409 limit=…``):
both come back as a :class:`ThrottleResult`. Everything else raises, because it is
no answer about the rate: ``400 Bad Request: …`` and ``413 Too Many Throttles`` /
``413 Too Many Waiters`` as :class:`~elockd.client.errors.RequestError`, ``409
Backend Unavailable`` (a cluster node without etcd quorum: nobody knows the key's
state) too, and an auth refusal as :class:`~elockd.client.errors.AuthError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elockd.client import core
from elockd.client.core import KeyLike, Request

# At most 15 digits a number: every value fits a float exactly, and a peer that
# sends a thousand digits gets a RequestError, not an OverflowError.
_ADMITTED = re.compile(
    rb"200 limit=(?P<limit>\d{1,15}) remaining=(?P<remaining>\d{1,15})"
    rb" reset=(?P<reset>\d{1,15})\Z"
)
_LIMITED = re.compile(
    rb"409 limit=(?P<limit>\d{1,15}) remaining=(?P<remaining>\d{1,15})"
    rb" retry=(?P<retry>\d{1,15}) reset=(?P<reset>\d{1,15})\Z"
)


@dataclass(frozen=True)
class ThrottleResult:
    """The answer to one ``throttle``.

    ``admitted``: the request passed (its cost is spent). ``limit``: the burst B it
    was judged by. ``remaining``: how many more requests of cost 1 would pass right
    now. ``retry_after``: seconds until this request would pass if nobody else came
    (0.0 when admitted); sleep that long and ask again. ``reset_after``: seconds
    until the key is back to a full burst. Retry and reset are different things:
    after a refusal, ``retry_after`` is when to come back, not ``reset_after``.
    """

    admitted: bool
    limit: int
    remaining: int
    retry_after: float
    reset_after: float


def _whole(value: object, what: str, low: int) -> int:
    """A whole number ``>= low``; bool is no number here."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be a whole number >= {low}, not {value!r}")
    return value


def throttle_line(
    key: KeyLike,
    count: int,
    period: float,
    burst: int | None = None,
    cost: int = 1,
    wait: float | None = None,
) -> bytes:
    """``throttle K COUNT PERIOD [burst=B] [cost=N] [wait=S]``; a value the server
    could never take raises :class:`ValueError` before anything is sent."""
    raw = core.encode_key(key)
    _whole(count, "count", 1)
    if burst is not None:
        _whole(burst, "burst", 1)
    _whole(cost, "cost", 0)
    if isinstance(period, bool) or not isinstance(period, int | float):
        raise ValueError(f"period must be a number of seconds above 0, not {period!r}")
    seconds = core.number(period, "period")
    if seconds == b"0":  # 0, or too small to write in microseconds
        raise ValueError(f"period must be a number of seconds above 0, not {period!r}")
    line = b"throttle %s %d %s" % (raw, count, seconds)
    if burst is not None:
        line += b" burst=%d" % burst
    if cost != 1:
        line += b" cost=%d" % cost
    if wait:
        line += b" wait=" + core.number(wait, "wait")
    return line


def parse_throttle(request: Request) -> ThrottleResult:
    """``200 limit=B remaining=R reset=MS`` or ``409 limit=B remaining=0 retry=MS
    reset=MS``; any other reply raises (see the module's docstring)."""
    reply = request.reply
    admitted = _ADMITTED.match(reply)
    if admitted is not None:
        return ThrottleResult(
            admitted=True,
            limit=int(admitted["limit"]),
            remaining=int(admitted["remaining"]),
            retry_after=0.0,
            reset_after=seconds(admitted["reset"]),
        )
    limited = _LIMITED.match(reply)
    if limited is not None:
        return ThrottleResult(
            admitted=False,
            limit=int(limited["limit"]),
            remaining=int(limited["remaining"]),
            retry_after=seconds(limited["retry"]),
            reset_after=seconds(limited["reset"]),
        )
    raise core.refusal(request)


def seconds(milliseconds: bytes) -> float:
    """The wire's whole milliseconds as seconds."""
    return int(milliseconds) / 1000
