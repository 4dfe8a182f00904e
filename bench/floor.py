"""The floor of this design: a trio server that does nothing but elockd's I/O.

One trio task per connection, a raw non-blocking socket, and elockd's read path
(yield with one checkpoint, then try ``recv``, and arm epoll only when nothing came),
every complete line of a chunk answered with the constant ``1 Got Lock`` and the
replies sent in one write. No protocol, no engine, no bookkeeping: what elockd's
serving loop would cost if everything it does per request were free. ``bench/run.py
--floor`` runs it beside elockd, so that a gap to another server can be split into
what elockd's own code costs and what CPython and trio cost before any of it runs.
"""

from __future__ import annotations

import argparse
import socket

import trio

REPLY = b"1 Got Lock\r\n"


async def serve(sock: socket.socket) -> None:
    """Answer every line with :data:`REPLY` until the peer closes."""
    pending = b""
    with sock:
        while True:
            await trio.lowlevel.checkpoint()
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError:
                return
            if not data:
                return
            pending += data
            lines = pending.count(b"\n")
            if lines:
                pending = pending[pending.rfind(b"\n") + 1 :]
                try:
                    sock.send(REPLY * lines)  # small replies: one send takes them all
                except OSError:
                    return


async def main(port: int) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(4096)
    listener.setblocking(False)
    async with trio.open_nursery() as nursery:
        while True:
            await trio.lowlevel.wait_readable(listener)
            while True:
                try:
                    sock, _ = listener.accept()
                except BlockingIOError:
                    break
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nursery.start_soon(serve, sock)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    trio.run(main, parser.parse_args().port)
