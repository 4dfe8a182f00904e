"""Every public call of the clients, once, as the sans-IO operation it runs.

Each function here takes the :class:`~elockd.client.core.ClientCore`, the caller's
clock reading and the call's own arguments, queues its requests and returns the
:class:`~elockd.client.core.Operation` that turns their replies into the result.
:class:`~elockd.client.base.ClientBase` makes each one a method of both clients
(``Client.info`` awaits the operation, ``BlockingClient.info`` blocks on it), so
what a call sends, how it reads the reply and what it raises exist once; the
docstrings here are those methods' docstrings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from elockd.client import core
from elockd.client.core import ClientCore, Hold, KeyLike, LockInfo, Operation, Request
from elockd.client.errors import ElockError
from elockd.client.throttles import ThrottleResult, parse_throttle, throttle_line

OnLost = Callable[[Hold], object] | None


def acquire(
    client: ClientCore,
    now: float,
    key: KeyLike,
    wait: float | None = None,
    ttl: float | None = None,
    on_lost: OnLost = None,
) -> Operation[Hold]:
    """Take an exclusive lock (``wait`` seconds at most; None: try once) and return
    its hold; :class:`Unavailable` if not granted. Prefer :meth:`lock`."""
    return client.lock(key, now, wait, ttl, on_lost)


def acquire_shared(
    client: ClientCore,
    now: float,
    key: KeyLike,
    limit: int | None = None,
    wait: float | None = None,
    ttl: float | None = None,
    on_lost: OnLost = None,
) -> Operation[Hold]:
    """Take a shared hold, at most ``limit`` holders at once. Prefer :meth:`shared`."""
    return client.shared(key, now, limit, wait, ttl, on_lost)


def acquire_many(
    client: ClientCore,
    now: float,
    keys: Sequence[KeyLike],
    wait: float | None = None,
    ttl: float | None = None,
    on_lost: OnLost = None,
) -> Operation[Hold]:
    """Take every key or none (``mlock``). Prefer :meth:`mlock`."""
    return client.mlock(keys, now, wait, ttl, on_lost)


def release(client: ClientCore, now: float, hold: Hold) -> Operation[None]:
    """Free a hold; :class:`LockLost` if it had been lost. The release is queued
    before the call first waits, so even a cancelled (interrupted) release happens."""
    return client.release(hold, now)


def leave(client: ClientCore, now: float, hold: Hold, failed: bool) -> Operation[None]:
    """The release at the end of a ``with`` block. When the block raised
    (``failed``), its exception wins over :class:`LockLost` and any other
    :class:`ElockError` of the release; the hold's flag and callback still tell."""
    operation = client.release(hold, now)
    if not failed:
        return operation
    finish = operation.finish

    def quietly() -> None:
        with contextlib.suppress(ElockError):
            finish()

    return Operation(operation.requests, quietly)


def check(client: ClientCore, now: float, hold: Hold) -> Operation[bool]:
    """Whether the server still has ``hold``, asked with ``token K`` for each key of
    an exclusive hold. One it no longer has (an operator's ``kill``) is marked lost
    and its ``on_lost`` fires, as at a refused renewal. A shared hold has no such
    question on the wire: it is found lost at its next renewal or release, so this
    answers what the client knows."""
    if not hold.held or hold.shared:
        return Operation([], lambda: hold.held)
    requests = [client.submit(b"token " + key, now) for key in hold.keys]

    def finish() -> bool:
        gone = [r for r in requests if r.error is None and r.reply == b"403 Not Locked"]
        failed = next((r.error for r in requests if r.error is not None), None)
        if failed is not None:
            raise failed
        for request in requests:
            if request.code != 200 and request not in gone:
                raise core.refusal(request)
        if gone and hold.held:
            client.lose(hold, f"the server no longer has it ({gone[0].line.decode()}: 403)", now)
        return hold.held

    return Operation(requests, finish)


def info(client: ClientCore, now: float, key: KeyLike) -> Operation[LockInfo]:
    """Who holds ``key`` and how (``info K``)."""
    return client.simple(b"info " + core.encode_key(key), now, core.parse_info)


def throttle(
    client: ClientCore,
    now: float,
    key: KeyLike,
    count: int,
    period: float,
    burst: int | None = None,
    cost: int = 1,
    wait: float | None = None,
) -> Operation[ThrottleResult]:
    """A rate limit: at most ``count`` per ``period`` seconds on ``key``, ``burst``
    at once (default ``count``), this call weighing ``cost`` (0: a peek that
    changes nothing). With ``wait`` the server keeps the call in line up to that
    many seconds, first come first served, until the rate lets it pass.

    Returns a :class:`~elockd.client.throttles.ThrottleResult` either way (look at
    ``admitted``); raises :class:`RequestError` for a bad value (``400``), a full
    server (``413 Too Many Throttles``, ``413 Too Many Waiters``) and ``409 Backend
    Unavailable``. A cancelled wait stays in line on the server until this
    connection closes (the protocol has no verb to leave a line), and requests
    sent after it on this client wait behind it.
    """
    line = throttle_line(key, count, period, burst, cost, wait)
    return client.simple(line, now, parse_throttle, wait=wait or 0.0)


def stats(client: ClientCore, now: float) -> Operation[dict[str, int]]:
    """Every server counter, by name."""
    return client.simple(b"stats", now, core.parse_stats)


def ping(client: ClientCore, now: float) -> Operation[float]:
    """Round trip time in seconds, on the client's clock."""
    expect_pong = core.parse_ok(b"200 PONG")

    def round_trip(request: Request) -> float:
        expect_pong(request)
        return request.arrived - now

    return client.simple(b"ping", now, round_trip)


def session_id(client: ClientCore, now: float) -> Operation[str]:
    """This session's id (a secret): another connection can :meth:`resume` it."""
    return client.simple(b"conn_id", now, lambda request: core.parse_word(request).decode())


def resume(client: ClientCore, now: float, session_id: str) -> Operation[bool]:
    """Take over a session whose connection dropped (its leases, or holds kept by a
    grace time). False if it is gone or this client holds something already. Call
    :meth:`lock` again for a key the session holds to get a :class:`Hold` for it: it
    is granted at once with the same token."""
    line = b"conn_id " + core.encode_key(session_id)
    return client.simple(line, now, core.parse_resume)


def set_grace(client: ClientCore, now: float, seconds: float) -> Operation[None]:
    """Keep this session's plain holds ``seconds`` after a disconnect, for a
    :meth:`resume` (``set_timeout``)."""
    line = b"set_timeout " + core.number(seconds * 1000, "grace")
    return client.simple(line, now, core.parse_ok(b"200 timeout set"))


def command(
    client: ClientCore, now: float, line: str | bytes, *, check: bool = False
) -> Operation[list[bytes]]:
    """Send any one request line and return its reply lines (``END`` dropped): the
    escape hatch for terse verbs (``g``, ``si``, ``q``, ``d``…).

    With ``check``, a reply that answers neither yes nor no raises instead of being
    returned: :class:`AuthError` when the server wants a token, and
    :class:`RequestError` for a one-line refusal of a multi-line verb or a terse
    probe's reply that is not one of its own (``0 Backend Unavailable`` is no "no").
    Without it every reply comes back as it is.
    """
    parse = core.parse_checked if check else core.parse_lines
    return client.simple(core.raw_line(line), now, parse)
