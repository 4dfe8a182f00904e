"""What the trio and the blocking client share besides the sans-IO core: where and
how to connect, their whole public API, how a lost hold is reported, and the rate
limiter's settings. Only the I/O differs between them, so everything else is written
once: here, in :mod:`elockd.client.calls` (what each call sends and reads) and in
:mod:`elockd.client.core` (requests, replies, holds and leases)."""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from elockd.client import calls
from elockd.client.core import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_REPLY_TIMEOUT,
    ClientCore,
    Hold,
    KeyLike,
    Operation,
    Settable,
    encode_key,
)
from elockd.client.errors import Throttled
from elockd.client.methods import Block, Call
from elockd.client.replies import quoted
from elockd.client.throttles import ThrottleResult, throttle_line
from elockd.client.websocket import parse_url

log = logging.getLogger("elockd.client")


class ClientBase:
    """Connection settings, the core and the public calls; subclasses add their I/O
    (:meth:`_init_io`) and say how they run an operation (:meth:`_method`).

    ``ssl_context`` turns on TLS (add a client certificate to it for mutual TLS);
    ``auth_token`` is sent first when the server demands ``auth``. Every reply must
    come within ``reply_timeout`` seconds (plus the wait the request asked for), or
    the connection is closed with ``ReplyTimeout`` rather than hang.
    """

    #: The event type the core hands to waiting operations (trio's or threading's).
    make_event: ClassVar[Callable[[], Settable]]
    #: Whether calls are awaited (trio) or block the calling thread.
    is_async: ClassVar[bool]

    # The public API, from elockd.client.calls: awaited on the trio client.
    acquire = Call(calls.acquire)
    acquire_shared = Call(calls.acquire_shared)
    acquire_many = Call(calls.acquire_many)
    release = Call(calls.release)
    _leave = Call(calls.leave)
    lock = Block(
        acquire,
        _leave,
        """``with client.lock(key) as hold:`` (``async with`` on the trio client): an
        exclusive lock for the block. With ``ttl`` the hold is a lease, renewed in the
        background.""",
    )
    shared = Block(
        acquire_shared,
        _leave,
        """``with client.shared(key, limit=5) as hold:``: one of at most ``limit``
        holders of ``key`` for the block.""",
    )
    mlock = Block(
        acquire_many,
        _leave,
        """``with client.mlock(["a", "b"]) as hold:``: all keys, never a deadlock;
        ``hold.tokens`` has each key's fencing token.""",
    )
    check = Call(calls.check)
    info = Call(calls.info)
    throttle = Call(calls.throttle)
    stats = Call(calls.stats)
    ping = Call(calls.ping)
    session_id = Call(calls.session_id)
    resume = Call(calls.resume)
    set_grace = Call(calls.set_grace)
    command = Call(calls.command)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9999,
        *,
        url: str | None = None,
        unix: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        auth_token: str | bytes | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
    ) -> None:
        self.host, self.port, self.unix = host, port, unix
        # ws://host:port/ (the server's HTTP port): a WebSocket session instead.
        self.websocket = parse_url(url) if url is not None else None
        if self.websocket is not None:
            self.host, self.port = self.websocket.host, self.websocket.port
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname
        self.auth_token = auth_token
        self.connect_timeout = connect_timeout
        self.core = ClientCore(type(self).make_event, reply_timeout)
        self._init_io()

    def _init_io(self) -> None:
        """The subclass's own connection state (sockets, tasks, locks)."""
        raise NotImplementedError

    @staticmethod
    def _method(build: Callable[..., Operation[Any]]) -> Callable[..., Any]:
        """A method ``(self, *args, **kwargs)`` that builds ``build``'s operation with
        this client's core and clock and returns its result: a coroutine's on the
        trio client, at once on the blocking one (see :mod:`elockd.client.methods`)."""
        raise NotImplementedError

    def _where(self) -> str:
        if self.websocket is not None:
            return self.websocket.url
        return f"unix:{self.unix}" if self.unix else f"{self.host}:{self.port}"

    @staticmethod
    def _report_lost(lost: Iterable[Hold]) -> None:
        """Log each lost hold and call its ``on_lost``; a failing callback is logged,
        never raised into the client's I/O."""
        for hold in lost:
            log.warning("lock %s lost: %s", quoted(hold.key), hold.lost_reason)
            if hold.on_lost is not None:
                try:
                    hold.on_lost(hold)
                except Exception:
                    log.exception("on_lost callback of %s failed", quoted(hold.key))


def describe(error: BaseException) -> str:
    """Why a connection failed, in the words an operator knows (``Connection
    refused``, ``timed out``, the TLS verification message), not a Python repr."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"TLS: the server's certificate was not accepted ({error.verify_message})"
    if isinstance(error, ssl.SSLError):
        return f"TLS: {error.reason or error}"
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, socket.gaierror) and error.strerror:
        return error.strerror
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    cause = error.__cause__
    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[0]  # trio's "all attempts to connect failed"
    if cause is not None:
        return describe(cause)
    return str(error) or type(error).__name__


class RateLimiterBase:
    """The settings of a rate limiter (:class:`elockd.client.RateLimiter`,
    :class:`elockd.client.BlockingRateLimiter`), which caps the work on ``key``
    across every process that uses the same key and settings:

    * a **concurrency**, ``limit=N``: at most N slots held at once (a shared hold
      ``lock_shared KEY limit=N`` per slot, with a lease of ``ttl`` when given);
    * a **rate**, ``rate=(COUNT, PERIOD)``: at most COUNT slots begun per PERIOD
      seconds on average, ``burst`` at once (default COUNT), through ``throttle``;
    * **both**: a slot first waits for its rate turn, then for a free place.

    ``wait`` bounds a slot's whole wait, both steps together (None: try once and
    raise at once). ``client_options`` are those of the clients it opens.
    ``RateLimiter(key, 5)`` is the concurrency cap it always was.
    """

    def __init__(
        self,
        key: KeyLike,
        limit: int | None = None,
        *,
        rate: tuple[int, float] | None = None,
        burst: int | None = None,
        wait: float | None = 60.0,
        ttl: float | None = None,
        **client_options: Any,
    ) -> None:
        encode_key(key)
        if limit is None and rate is None:
            raise ValueError("give limit=N (concurrency), rate=(COUNT, PERIOD), or both")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise ValueError(f"limit must be a whole number >= 1, not {limit!r}")
        if limit is not None and limit < 1:
            raise ValueError("limit must be at least 1")
        if rate is not None:
            count, period = rate
            throttle_line(key, count, period, burst)  # the same checks as a call's
            rate = (count, period)
        elif burst is not None:
            raise ValueError("burst needs rate=(COUNT, PERIOD)")
        if ttl is not None and limit is None:
            raise ValueError("ttl is the lease of a concurrency slot: it needs limit=N")
        self.key, self.limit, self.wait, self.ttl = key, limit, wait, ttl
        self.rate, self.burst = rate, burst
        self.client_options = client_options
        self._init_pool()

    def _init_pool(self) -> None:
        """The subclass's pool of connections, one per slot in use."""
        raise NotImplementedError

    def _turn(self, cost: int) -> dict[str, Any]:
        """The ``throttle`` call of a slot's rate step (``rate`` is set)."""
        assert self.rate is not None
        count, period = self.rate
        return {
            "key": self.key,
            "count": count,
            "period": period,
            "burst": self.burst,
            "cost": cost,
            "wait": self.wait,
        }

    def _admitted(self, result: ThrottleResult) -> None:
        """Raise :class:`Throttled` unless the rate step passed."""
        if not result.admitted:
            raise Throttled(
                f"throttle {quoted(encode_key(self.key))}: limited, "
                f"retry after {result.retry_after:.3f} s",
                result,
            )

    def _left(self, started: float, now: float) -> float | None:
        """What is left of ``wait`` for the slot step after the rate step."""
        if self.wait is None:
            return None
        return max(0.0, self.wait - (now - started))
