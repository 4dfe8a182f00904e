"""What the client raises. Everything derives from :class:`ElockError`, so one
``except ElockError`` catches every failure that came from the lock service."""

from __future__ import annotations

from typing import Protocol


class LostHold(Protocol):
    """What a :class:`LockLost` tells of the hold it is about (a
    :class:`~elockd.client.core.Hold`, described here rather than imported: the
    hold raises this error, so the two modules would otherwise name each other)."""

    keys: tuple[bytes, ...]
    shared: bool
    tokens: dict[bytes, int]
    lost_reason: str | None
    lost_at: float | None


class RateAnswer(Protocol):
    """What a :class:`Throttled` tells of the server's answer (a
    :class:`~elockd.client.throttles.ThrottleResult`, described here rather than
    imported: throttles imports core, which imports this module)."""

    @property
    def admitted(self) -> bool: ...
    @property
    def retry_after(self) -> float: ...
    @property
    def reset_after(self) -> float: ...


class ElockError(Exception):
    """Base class of every client error."""


class ConnectionLost(ElockError):
    """The connection is gone (or was never made): nothing sent on it can be trusted
    any more, and every hold it carried is reported lost."""


class ConnectFailed(ConnectionLost):
    """Connecting (TCP, TLS handshake, ``auth``) failed or took longer than the
    connect timeout."""


class ReplyTimeout(ConnectionLost):
    """A reply did not come within its deadline. Replies come in request order, so
    the connection cannot skip a late one: it is closed instead of hanging."""


class ProtocolError(ConnectionLost):
    """The peer sent something that is no reply of this protocol (an SSH banner, an
    HTTP error page, a line without ``\\r\\n``): it is not elockd, or not speaking
    to this client. Replies can no longer be matched to requests, so the connection
    is closed like a lost one. ``data`` is the start of what came."""

    def __init__(self, message: str, data: bytes = b"") -> None:
        super().__init__(message)
        self.data = data


class RequestError(ElockError):
    """The server refused a request (``400``, ``413``, ``0 …``) or said something the
    client did not expect. ``reply`` is the reply line."""

    def __init__(self, message: str, reply: bytes = b"") -> None:
        super().__init__(message)
        self.reply = reply


class AuthError(RequestError):
    """``auth`` was refused, or the server demands it and no token was given."""


class KeyBusy(ElockError):
    """This client already holds (or is acquiring) the key. A session holds a key at
    most once, so a second hold on the same connection would silently be the same
    hold; use a second client for a second holder."""


class Unavailable(ElockError):
    """The lock was not granted within ``wait`` (``409``). For a shared lock
    ``holders`` is the number of holders; for ``mlock`` ``keys`` lists the keys held
    by others."""

    def __init__(
        self, message: str, *, holders: int | None = None, keys: tuple[bytes, ...] = ()
    ) -> None:
        super().__init__(message)
        self.holders = holders
        self.keys = keys


class Throttled(Unavailable):
    """A rate limiter's turn was not given within ``wait``: the key's rate is used
    up. ``retry_after`` is the seconds until a call of the same cost would pass if
    nobody else came; ``result`` the server's whole answer (a
    :class:`~elockd.client.throttles.ThrottleResult`)."""

    def __init__(self, message: str, result: RateAnswer) -> None:
        super().__init__(message)
        self.result = result
        self.retry_after = result.retry_after


class LockLost(ElockError):
    """The hold ended while it was believed held: a renewal failed, the lease ran out,
    or the connection dropped. Whatever the hold protected may have run concurrently
    with another holder since ``hold.lost_at``."""

    def __init__(self, message: str, hold: LostHold | None = None) -> None:
        super().__init__(message)
        self.hold = hold
