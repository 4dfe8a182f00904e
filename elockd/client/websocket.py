"""The clients over a WebSocket (``ws://host:9998/``, the server's HTTP port).

On a WebSocket each request line is one message and each reply comes back as one
message; the sans-IO core reads replies from a byte stream, so both shells put a
thin adapter between it and the WebSocket: lines out become messages, messages in
are handed over as bytes. The framing is a library's, never ours: the trio client
runs on trio-websocket (:class:`TrioWebSocketStream`), the blocking client on
wsproto, the sans-IO engine trio-websocket itself is built on
(:class:`BlockingWebSocket`). Messages are binary both ways, so keys keep every byte.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, connect_websocket_url
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

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


class TrioWebSocketStream(trio.abc.Stream):
    """A trio-websocket connection as the byte stream the trio client drives."""

    def __init__(self, connection: WebSocketConnection) -> None:
        self.connection = connection

    @classmethod
    async def connect(
        cls, nursery: trio.Nursery, url: str, ssl_context: ssl.SSLContext | None
    ) -> TrioWebSocketStream:
        connection = await connect_websocket_url(
            nursery, url, ssl_context, max_message_size=MAX_MESSAGE
        )
        return cls(connection)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            for line in request_lines(bytes(data)):
                await self.connection.send_message(line)
        except ConnectionClosed as closed:
            raise trio.BrokenResourceError("the WebSocket was closed") from closed

    async def wait_send_all_might_not_block(self) -> None:
        return

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            message = await self.connection.get_message()
        except ConnectionClosed:
            return b""
        return message.encode() if isinstance(message, str) else message

    async def aclose(self) -> None:
        await self.connection.aclose()


class BlockingWebSocket:
    """wsproto over the blocking client's socket: the handshake at connect, then
    lines out as binary messages and messages in as bytes."""

    def __init__(self, address: WebSocketAddress) -> None:
        self.address = address
        self.protocol = WSConnection(ConnectionType.CLIENT)
        self._pending_out = b""  # control frames (pong, close) the protocol owes

    def handshake(self, sock: socket.socket) -> bytes:
        """Upgrade a connected (blocking) socket; what the server sent beyond the
        handshake, already decoded. Raises ConnectionError when refused."""
        host = f"{self.address.host}:{self.address.port}"
        sock.sendall(self.protocol.send(Request(host=host, target=self.address.target)))
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection during the upgrade")
            self.protocol.receive_data(data)
            for event in self.protocol.events():
                if isinstance(event, RejectConnection):
                    raise ConnectionError(f"WebSocket upgrade refused ({event.status_code})")
                if isinstance(event, AcceptConnection):
                    return self._decode_events()

    def encode(self, data: bytes) -> bytes:
        """The frames for the request lines in ``data``, and any owed control frame."""
        frames = b"".join(
            self.protocol.send(BytesMessage(data=line)) for line in request_lines(data)
        )
        owed, self._pending_out = self._pending_out, b""
        return owed + frames

    def decode(self, data: bytes) -> bytes:
        """The reply bytes in the frames received; ConnectionError when the server
        closed the WebSocket."""
        self.protocol.receive_data(data)
        return self._decode_events()

    def _decode_events(self) -> bytes:
        replies = []
        for event in self.protocol.events():
            if isinstance(event, BytesMessage):
                replies.append(bytes(event.data))
            elif isinstance(event, TextMessage):
                replies.append(event.data.encode())
            elif isinstance(event, Ping):
                self._pending_out += self.protocol.send(event.response())
            elif isinstance(event, CloseConnection):
                raise ConnectionError(f"the server closed the WebSocket ({event.code})")
        return b"".join(replies)
