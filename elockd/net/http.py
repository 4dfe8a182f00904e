"""The HTTP port's connections: hypercorn's HTTP/1.1 protocol on a listener we own,
and WebSocket upgrades handed to :mod:`elockd.net.websocket`.

hypercorn parses HTTP (h11) and runs the ASGI app; what it does not offer is a cap on
connections at once, and that is what keeps a crowd of scrapers in a tight loop
from taking more than a bounded share of the one event loop the lock clients share.
So this module accepts connections itself, at most ``max_connections`` at a time
(the others wait in the kernel's backlog, costing the server nothing), tunes each
socket as the lock port does (keepalive, TCP_USER_TIMEOUT), and reads its first
request head (h11): a WebSocket upgrade goes to ``upgrade`` with the socket, and
leaves the cap; anything else goes to hypercorn's per-connection ``TCPServer``,
the bytes already read first. A connection that sends nothing for ``idle_timeout``
seconds is closed, whether between requests or in the middle of one (a client
trickling its headers holds a slot no longer than that), and one whose replies make
no progress for ``send_timeout`` seconds too.

An upgrade asked on a connection that already served a request (HTTP keep-alive) is
refused (403) by the app: browsers and WebSocket libraries open a fresh connection.

The accept loop survives every accept() error as the lock port's does
(:mod:`elockd.net.accepting`): trio's listener skips the ones of a single connection,
and on any other the loop pauses and goes on.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Awaitable, Callable
from typing import Any, cast

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, LifespanState

from elockd.net.accepting import accept_pause

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

log = logging.getLogger("elockd")


#: An ASGI app.
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]
#: Serves a WebSocket session: (socket, the bytes read so far: the upgrade request).
Upgrade = Callable[[socket.socket, bytes], Awaitable[None]]
#: Sets socket options on an accepted connection (keepalive and the like).
Tune = Callable[[socket.socket], None]

#: The longest request head read before it is handed on (h11's own default limit).
MAX_HEAD = 16384
#: A Stream's send_all gives no sign of progress until it returns, so replies go out
#: in pieces of this size, each with its own send timeout.
SEND_PIECE = 16384


class IdleTimeoutStream(trio.abc.HalfCloseableStream):
    """A socket stream whose receive gives up after ``idle_timeout`` seconds without
    data, which hypercorn then treats as the peer closing; whose send gives up after
    ``send_timeout`` seconds without progress; and whose first bytes are ``prefix``
    (what was read to tell an upgrade from a plain request)."""

    def __init__(
        self,
        stream: trio.SocketStream,
        idle_timeout: float,
        send_timeout: float = math.inf,
        prefix: bytes = b"",
    ) -> None:
        self.stream = stream
        self.socket = stream.socket  # hypercorn reads the addresses from here
        self.idle_timeout = idle_timeout
        self.send_timeout = send_timeout
        self.prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self.prefix:
            data, self.prefix = self.prefix, b""
            return data
        with trio.move_on_after(self.idle_timeout):
            return await self.stream.receive_some(max_bytes)
        raise trio.BrokenResourceError("idle timeout")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        for start in range(0, len(view), SEND_PIECE):
            with trio.move_on_after(self.send_timeout):
                await self.stream.send_all(view[start : start + SEND_PIECE])
                continue
            raise trio.BrokenResourceError("send timed out: peer not reading")

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


def hypercorn_config(idle_timeout: float) -> HypercornConfig:
    config = HypercornConfig()
    config.accesslog = None
    config.errorlog = logging.getLogger("elockd.http")
    config.include_server_header = False
    config.keep_alive_timeout = idle_timeout
    return config


async def read_head(sock: socket.socket, idle_timeout: float) -> tuple[bytes, h11.Request | None]:
    """The bytes of the connection's first request head (and any after it in the same
    reads) and the request parsed, or None when they are not one whole valid head:
    the peer left or went idle (then the bytes are empty), or sent what hypercorn
    will answer with a 4xx."""
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    received = bytearray()
    with trio.move_on_after(idle_timeout):
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                data = sock.recv(MAX_HEAD)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            received += data
            parser.receive_data(data)
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError:
                return bytes(received), None
            if event is not h11.NEED_DATA:
                return bytes(received), event if isinstance(event, h11.Request) else None
    return b"", None


def is_upgrade(request: h11.Request | None) -> bool:
    """Whether ``request`` asks for a WebSocket (RFC 6455 4.1: a GET with Upgrade)."""
    if request is None or request.method != b"GET":
        return False
    return any(
        name == b"upgrade" and b"websocket" in value.lower() for name, value in request.headers
    )


async def serve_http(
    app: App,
    sock: socket.socket,
    *,
    max_connections: int,
    idle_timeout: float = math.inf,
    send_timeout: float = math.inf,
    upgrade: Upgrade | None = None,
    tune: Tune | None = None,
) -> None:
    """Serve ``app`` on the listening socket ``sock`` until cancelled. A WebSocket
    upgrade (the first request of a connection) goes to ``upgrade`` with the socket,
    when given, and leaves the cap and the idle timeout of HTTP: it is a session now,
    with limits of its own. ``tune`` is applied to every accepted socket."""
    config = hypercorn_config(idle_timeout)
    context = WorkerContext(None)
    state = cast(LifespanState, {})
    slots = trio.Semaphore(max_connections)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    wrapped = ASGIWrapper(cast(ASGIFramework, app))

    async def serve_one(accepted: trio.SocketStream) -> None:
        holding = True
        try:
            # Ours to own: a stdlib socket (the WebSocket session drives it raw).
            raw = socket.socket(fileno=accepted.socket.detach())
            raw.setblocking(False)
            if tune is not None:
                try:
                    tune(raw)
                except OSError:  # reset before it was tuned: this connection only
                    raw.close()
                    return
            head, request = await read_head(raw, idle_timeout)
            if not head:
                raw.close()
                return
            if upgrade is not None and is_upgrade(request):
                holding = False
                slots.release()
                await upgrade(raw, head)
                return
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(raw))
            timed = IdleTimeoutStream(stream, idle_timeout, send_timeout, head)
            server = TCPServer(wrapped, config, context, state, timed)  # type: ignore[arg-type]
            await server.run()
        finally:
            if holding:
                slots.release()

    async with trio.open_nursery() as nursery:
        while True:
            await slots.acquire()
            try:
                stream = await listener.accept()
            except OSError as error:
                slots.release()
                await trio.sleep(accept_pause(error, "HTTP accept"))
                continue
            nursery.start_soon(serve_one, stream)
