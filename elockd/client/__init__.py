"""Clients for elockd: :class:`Client` (trio) and :class:`BlockingClient` (threads).

Both speak the word family, share one sans-IO core (:mod:`elockd.client.core`) and
offer the same API: ``lock``/``shared``/``mlock`` context managers yielding a
:class:`Hold` (fencing ``token``, ``lost`` flag, ``on_lost`` callback), leases that
renew themselves, ``info``/``stats``/``ping``/``session_id``/``resume``, and a
:class:`RateLimiter` / :class:`BlockingRateLimiter` on shared locks. See
docs/client.md.
"""

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
    Unavailable,
)
from elockd.client.tls import tls_context
from elockd.client.trio_client import Client, RateLimiter

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
    "Unavailable",
    "tls_context",
]
