"""Clients for elockd: :class:`Client` (trio) and :class:`BlockingClient` (threads).

Both speak the word family and offer the same API: ``lock``/``shared``/``mlock``
context managers yielding a :class:`Hold` (fencing ``token``, ``lost`` flag,
``on_lost`` callback), leases that renew themselves,
``info``/``stats``/``ping``/``session_id``/``resume``, ``throttle`` (a rate limit,
:class:`ThrottleResult`), and a :class:`RateLimiter` / :class:`BlockingRateLimiter`
that caps a rate, a concurrency or both. See docs/client.md and docs/rate-limits.md.

The layers, from the wire up, each written once for both clients:

* :mod:`~elockd.client.receivebuffer`: received bytes, searched in linear time;
* :mod:`~elockd.client.replies`: those bytes cut into replies, read strictly;
* :mod:`~elockd.client.core`: requests, deadlines, holds and leases (sans-IO);
* :mod:`~elockd.client.calls`: each public call as an operation on the core;
* :mod:`~elockd.client.base` and :mod:`~elockd.client.methods`: those calls as the
  methods of both clients, and their shared settings.

Only the I/O is written twice: :mod:`~elockd.client.trio_client` awaits an
operation's replies on trio streams, :mod:`~elockd.client.blocking` waits for them
while a thread of its own owns the socket.
"""

from typing import TYPE_CHECKING, Any

from elockd.client.blocking import BlockingClient, BlockingRateLimiter
from elockd.client.core import Hold, LockInfo
from elockd.client.errors import (
    AuthError,
    ConnectFailed,
    ConnectionLost,
    ElockError,
    KeyBusy,
    LockLost,
    ProtocolError,
    ReplyTimeout,
    RequestError,
    Throttled,
    Unavailable,
)
from elockd.client.throttles import ThrottleResult
from elockd.client.tls import tls_context

if TYPE_CHECKING:
    from elockd.client.trio_client import Client, RateLimiter


def __getattr__(name: str) -> Any:
    """The trio client, imported on first use: the blocking client and elockctl's
    one-shot commands never import trio, and start that much sooner."""
    if name in ("Client", "RateLimiter"):
        from elockd.client import trio_client

        return getattr(trio_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AuthError",
    "BlockingClient",
    "BlockingRateLimiter",
    "Client",
    "ConnectFailed",
    "ConnectionLost",
    "ElockError",
    "Hold",
    "KeyBusy",
    "LockInfo",
    "LockLost",
    "ProtocolError",
    "RateLimiter",
    "ReplyTimeout",
    "RequestError",
    "ThrottleResult",
    "Throttled",
    "Unavailable",
    "tls_context",
]
