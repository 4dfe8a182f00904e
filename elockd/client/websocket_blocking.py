"""The blocking client's WebSocket: wsproto over the client's own socket.

Imported only when the blocking client connects to a ``ws://`` URL
(see :mod:`elockd.client.websocket`).
"""

from __future__ import annotations

import socket

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

from elockd.client.websocket import WebSocketAddress, request_lines


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
