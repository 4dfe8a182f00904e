"""The trio client's WebSocket: trio-websocket as the byte stream the client drives.

Apart from :mod:`elockd.client.websocket` (URLs, the blocking client's wsproto) so
that only the trio client imports trio: elockctl's one-shot commands start in a
fraction of the time without it (docs/elockctl.md).
"""

from __future__ import annotations

import ssl

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, connect_websocket_url

from elockd.client.websocket import MAX_MESSAGE, request_lines


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
