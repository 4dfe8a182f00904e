"""What the trio and the blocking client share besides the sans-IO core: where and
how to connect, and how a lost hold is reported. Only the I/O differs between them,
so everything else is written once, here or in :mod:`elockd.client.core`."""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterable
from typing import ClassVar

from elockd.client.core import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_REPLY_TIMEOUT,
    ClientCore,
    Hold,
    Settable,
    quoted,
)

log = logging.getLogger("elockd.client")


class ClientBase:
    """Connection settings and the core; subclasses add their I/O in :meth:`_init_io`.

    ``ssl_context`` turns on TLS (add a client certificate to it for mutual TLS);
    ``auth_token`` is sent first when the server demands ``auth``. Every reply must
    come within ``reply_timeout`` seconds (plus the wait the request asked for), or
    the connection is closed with ``ReplyTimeout`` rather than hang.
    """

    #: The event type the core hands to waiting operations (trio's or threading's).
    make_event: ClassVar[Callable[[], Settable]]

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9999,
        *,
        unix: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        auth_token: str | bytes | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
    ) -> None:
        self.host, self.port, self.unix = host, port, unix
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname
        self.auth_token = auth_token
        self.connect_timeout = connect_timeout
        self.core = ClientCore(type(self).make_event, reply_timeout)
        self._init_io()

    def _init_io(self) -> None:
        """The subclass's own connection state (sockets, tasks, locks)."""
        raise NotImplementedError

    def _where(self) -> str:
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
