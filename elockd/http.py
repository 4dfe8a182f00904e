"""The HTTP port's connections: hypercorn's HTTP/1.1 protocol on a listener we own.

hypercorn parses HTTP (h11) and runs the ASGI app; what it does not offer is a cap on
connections at once, and that is what keeps a crowd of scrapers in a tight loop
from taking more than a bounded share of the one event loop the lock clients share.
So this module accepts connections itself, at most ``max_connections`` at a time
(the others wait in the kernel's backlog, costing the server nothing), and hands
each to hypercorn's per-connection ``TCPServer``. A connection that sends nothing
for ``idle_timeout`` seconds is closed, whether between requests or in the middle
of one (a client trickling its headers holds a slot no longer than that).

The accept loop survives every accept() error as the lock port's does
(:mod:`elockd.accepting`): trio's listener skips the ones of a single connection,
and on any other the loop pauses and goes on.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Awaitable, Callable
from typing import Any, cast

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, LifespanState

from elockd.accepting import accept_pause

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

log = logging.getLogger("elockd")


#: An ASGI app that is also told how to mark its connection upgraded (a WebSocket
#: session): (scope, receive, send, upgraded).
App = Callable[[dict[str, Any], Receive, Send, Callable[[], None]], Awaitable[None]]


class IdleTimeoutStream(trio.abc.HalfCloseableStream):
    """A socket stream whose receive gives up after ``idle_timeout`` seconds without
    data, which hypercorn then treats as the peer closing."""

    def __init__(self, stream: trio.SocketStream, idle_timeout: float) -> None:
        self.stream = stream
        self.socket = stream.socket  # hypercorn reads the addresses from here
        self.idle_timeout = idle_timeout

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        with trio.move_on_after(self.idle_timeout):
            return await self.stream.receive_some(max_bytes)
        raise trio.BrokenResourceError("idle timeout")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

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


async def serve_http(
    app: App,
    sock: socket.socket,
    *,
    max_connections: int,
    idle_timeout: float = math.inf,
    max_message: int = 1 << 20,
) -> None:
    """Serve ``app`` on the listening socket ``sock`` until cancelled. A connection
    the app upgrades (calls its ``upgraded``) leaves the cap and the idle timeout
    of HTTP: it is a session now, with limits of its own. ``max_message`` bounds a
    WebSocket message (larger ones close the connection: 1009)."""
    config = hypercorn_config(idle_timeout)
    config.websocket_max_message_size = max_message
    context = WorkerContext(None)
    state = cast(LifespanState, {})
    slots = trio.Semaphore(max_connections)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def serve_one(stream: trio.SocketStream) -> None:
        timed = IdleTimeoutStream(stream, idle_timeout)
        holding = True

        def upgraded() -> None:
            nonlocal holding
            timed.idle_timeout = math.inf
            if holding:
                holding = False
                slots.release()

        async def per_connection(scope: dict[str, Any], receive: Receive, send: Send) -> None:
            await app(scope, receive, send, upgraded)

        wrapped = ASGIWrapper(cast(ASGIFramework, per_connection))
        try:
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


def listen_tcp(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening socket on the first address of ``host`` (port 0: any free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
