"""A raw WebSocket client for tests that misbehave on purpose: it offers what the
server must refuse (permessage-deflate), sends frames a browser never would (a
compressed frame, a million empty messages), and can stop reading.

wsproto (the server's own library, on the client side here) makes the handshake
and reads replies; frames are built by hand where the test needs bytes wsproto
would not send.
"""

from __future__ import annotations

import socket
import struct

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

OPCODE_TEXT = 0x1
OPCODE_BINARY = 0x2


def masked_frame(payload: bytes, opcode: int = OPCODE_TEXT, *, rsv1: bool = False) -> bytes:
    """One final client frame (RFC 6455 5.2). Its mask is four zero bytes (any four
    bytes are allowed), so a big payload need not be XORed byte by byte here.
    ``rsv1`` marks it compressed (permessage-deflate), whether or not it was agreed."""
    first = 0x80 | (0x40 if rsv1 else 0) | opcode
    length = len(payload)
    if length < 126:
        header = struct.pack("!BB", first, 0x80 | length)
    elif length < 1 << 16:
        header = struct.pack("!BBH", first, 0x80 | 126, length)
    else:
        header = struct.pack("!BBQ", first, 0x80 | 127, length)
    return header + b"\x00\x00\x00\x00" + payload


class RawWebSocket:
    """A client WebSocket over a plain trio socket whose receive buffer the test may
    shrink (a client that does not read fills it quickly)."""

    def __init__(self, sock: trio.socket.SocketType, ws: WSConnection) -> None:
        self.sock = sock
        self.stream = trio.SocketStream(sock)
        self.ws = ws
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.closed: CloseConnection | None = None

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        deflate: bool = False,
        receive_buffer: int | None = None,
    ) -> RawWebSocket:
        sock = trio.socket.socket()
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect((host, port))
        ws = WSConnection(ConnectionType.CLIENT)
        client = cls(sock, ws)
        extensions = [PerMessageDeflate()] if deflate else []
        request = Request(host=f"{host}:{port}", target="/", extensions=extensions)
        await client.stream.send_all(ws.send(request))
        while True:
            data = await sock.recv(65536)
            if not data:
                raise ConnectionError("closed during the handshake")
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    client.response_headers = list(event.extra_headers)
                    client.accepted_extensions = list(event.extensions)
                    return client
                if isinstance(event, RejectConnection):
                    raise ConnectionError(f"refused: {event.status_code}")

    accepted_extensions: list[object]

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send(self, message: str | bytes) -> None:
        event = TextMessage(message) if isinstance(message, str) else BytesMessage(message)
        await self.stream.send_all(self.ws.send(event))

    async def message(self) -> str | bytes | None:
        """The next whole message, or None once the server closed (see ``closed``)."""
        parts: list[str | bytes] = []
        while True:
            for event in self.ws.events():
                if isinstance(event, Message):
                    parts.append(event.data)
                    if event.message_finished:
                        if isinstance(event, TextMessage):
                            return "".join(str(p) for p in parts)
                        return b"".join(bytes(p) for p in parts)  # type: ignore[arg-type]
                elif isinstance(event, CloseConnection):
                    self.closed = event
                    return None
            try:
                data = await self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.closed = CloseConnection(code=1006)
                return None
            self.ws.receive_data(data)

    async def ask(self, message: str | bytes) -> str | bytes | None:
        await self.send(message)
        return await self.message()

    def reset(self) -> None:
        """Close with a reset (SO_LINGER 0): no close frame, no FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()
