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
from elockd.client.methods import Block, Call
from elockd.client.replies import quoted
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
    info = Call(calls.info)
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
    :class:`elockd.client.BlockingRateLimiter`): at most ``limit`` concurrent
    holders of ``key``, each slot waiting up to ``wait`` seconds, a lease of ``ttl``
    when given; ``client_options`` are those of the clients it opens."""

    def __init__(
        self,
        key: KeyLike,
        limit: int,
        *,
        wait: float | None = 60.0,
        ttl: float | None = None,
        **client_options: Any,
    ) -> None:
        encode_key(key)
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.key, self.limit, self.wait, self.ttl = key, limit, wait, ttl
        self.client_options = client_options
        self._init_pool()

    def _init_pool(self) -> None:
        """The subclass's pool of connections, one per slot in use."""
        raise NotImplementedError
