"""The clients over a WebSocket (``ws://host:9998/``, the server's HTTP port).

On a WebSocket each request line is one message and each reply comes back as one
message; the sans-IO core reads replies from a byte stream, so both shells put a
thin adapter between it and the WebSocket: lines out become messages, messages in
are handed over as bytes. The framing is a library's, never ours: the trio client
runs on trio-websocket (:mod:`~elockd.client.websocket_trio`), the blocking client
on wsproto, the sans-IO engine trio-websocket itself is built on
(:mod:`~elockd.client.websocket_blocking`). This module holds what both share (the
URL, the lines): each shell's library is imported only when a WebSocket is used,
so that elockctl's one-shot commands start without them. Messages are binary both
ways, so keys keep every byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

#: The largest reply message taken (a dump comes whole in one message).
MAX_MESSAGE = 64 << 20


@dataclass(frozen=True)
class WebSocketAddress:
    url: str
    host: str
    port: int
    target: str
    secure: bool


def parse_url(url: str) -> WebSocketAddress:
    """``ws://host[:port][/path]`` or ``wss://…``; a ValueError names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"{url!r} is not a ws:// or wss:// URL")
    secure = parts.scheme == "wss"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return WebSocketAddress(
        url, parts.hostname, parts.port or (443 if secure else 80), target, secure
    )


def request_lines(data: bytes) -> list[bytes]:
    """The request lines of the bytes the core sends (each ends in ``\\n``): one
    message each."""
    return [line for line in data.split(b"\n") if line]
