"""WebSocket sessions on the HTTP port (glockd's interface, for browser dashboards
and scripts).

A WebSocket connection to ``/`` of the HTTP port is a session like a TCP one: the
same per-connection loop (:func:`elockd.serving.serve_connection`) and the same
sans-IO :class:`~elockd.protocol.Connection` serve it, with the same limits,
``auth``, idle timeout, counters and metrics, and its locks are freed when it
closes. Only the framing differs, and hypercorn (through wsproto) does all of it:
each text or binary message is one request line (no ``\\n`` needed), and each reply
is one message of the type of its request, a multi-line reply whole in one message.

It counts against ``--max-connections`` (a connection over the limit is told ``0 Too
Many Connections`` and closed), not against ``--metrics-max-connections``: once
upgraded it leaves the HTTP port's slots to scrapers. When the lock port speaks TLS,
upgrades are refused (403): the plain-HTTP port must not bypass the encryption the
operator asked for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from elockd.pause import NEVER, Interrupted, Parked
from elockd.protocol import Service
from elockd.serving import ConnectionSlots, peer_name, serve_connection
from elockd.transport import READ_AHEAD_LIMIT, rest_forever

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

TOO_MANY_CONNECTIONS = "0 Too Many Connections\r\n"
#: Close codes (RFC 6455): the session ended, and "try again later".
NORMAL_CLOSURE = 1000
TRY_AGAIN_LATER = 1013


class WebSocketTransport:
    """The per-connection loop's :class:`~elockd.transport.Transport` over an ASGI
    WebSocket: a message in is a line (a ``\\n`` is added), a reply out is a message
    of the type of the request it answers."""

    #: Multi-line replies go out whole, in one message (see serving.send_streamed).
    whole_replies = True

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self._ahead: deque[tuple[bool, bytes]] = deque()  # (text?, data) read ahead
        self._ahead_bytes = 0
        self._text = True  # the type of the message being answered
        self._closed = False
        self.pause = NEVER
        self.rest: Parked | None = None
        self._held: dict[str, Any] | None = None  # a message received during a pause

    async def _next(self) -> tuple[bool, bytes] | None:
        """The next message as (text?, bytes), or None once the peer has gone."""
        if self._closed:
            return None
        message, self._held = self._held, None
        if message is None:
            pause, rest = self.pause, self.rest
            if rest is not None:
                pause.idle.add(rest)
            try:
                message = await self._receive()
            finally:
                pause.idle.discard(rest)
            if pause.requested:  # a hand-over's pause: keep it for after
                self._held = message
                raise Interrupted
        if message["type"] != "websocket.receive":
            self._closed = True  # websocket.disconnect
            return None
        data = message.get("bytes")
        if data is not None:
            return False, bytes(data)
        return True, str(message.get("text") or "").encode()

    async def receive(self) -> bytes:
        if self._ahead:
            text, data = self._ahead.popleft()
            self._ahead_bytes -= len(data)
        else:
            got = await self._next()
            if got is None:
                return b""
            text, data = got
        self._text = text
        return data if data.endswith(b"\n") else data + b"\n"

    async def watch_for_close(self) -> None:
        """While a request waits: keep the messages that come, up to
        :data:`~elockd.transport.READ_AHEAD_LIMIT`, until the peer leaves."""
        while self._ahead_bytes < READ_AHEAD_LIMIT:
            got = await self._next()
            if got is None:
                return
            self._ahead.append(got)
            self._ahead_bytes += len(got[1])
        await rest_forever(self.pause, self.rest)

    async def send(self, data: bytes) -> None:
        if self._closed:
            raise trio.BrokenResourceError("the WebSocket was closed")
        if self._text:
            # A text message must be UTF-8; a key that is not shows replaced
            # (binary messages carry any bytes).
            await self._send({"type": "websocket.send", "text": data.decode(errors="replace")})
        else:
            await self._send({"type": "websocket.send", "bytes": data})

    def replying_late(self) -> None:
        """The HTTP port's sockets are its own business (the ASGI server's), not ours."""

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._send({"type": "websocket.close", "code": NORMAL_CLOSURE})


async def serve_websocket(
    service: Service,
    slots: ConnectionSlots,
    scope: dict[str, Any],
    receive: Receive,
    send: Send,
    upgraded: Callable[[], None],
) -> None:
    """One WebSocket session, from the upgrade to its end. ``upgraded`` tells the
    HTTP server the connection is a session now (its HTTP slot and idle timeout no
    longer apply)."""
    if (await receive())["type"] != "websocket.connect":
        return
    if service.config.tls_cert:
        await send({"type": "websocket.close", "code": 1008})  # before accept: 403
        return
    await send({"type": "websocket.accept"})
    upgraded()
    if slots.used >= slots.limit:
        await send({"type": "websocket.send", "text": TOO_MANY_CONNECTIONS})
        await send({"type": "websocket.close", "code": TRY_AGAIN_LATER})
        return
    slots.used += 1
    client = scope.get("client")
    peer = peer_name(tuple(client) if client else None)
    await slots.run(serve_connection, service, WebSocketTransport(receive, send), peer)
