"""A service that is not elockd, on a free loopback port: what a client meets when
the port is wrong. Tools must say "cannot tell" (exit 3, UNKNOWN), never read its
banner as a "no", and never wait out their timeout for an ``END`` that never comes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

SSH_BANNER = b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n"


@contextlib.contextmanager
def foreign_service(greeting: bytes = SSH_BANNER) -> Iterator[int]:
    """Accept connections, send ``greeting`` at once (as sshd does), then read and
    ignore whatever comes, keeping the connection open until the client leaves: the
    hardest case, where only the content of the reply can tell. Yields the port."""
    server = socket.create_server(("127.0.0.1", 0))
    connections: list[socket.socket] = []

    def serve_one(connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            connection.sendall(greeting)
            while connection.recv(4096):
                pass

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener was closed: done
            while True:
                connection, _ = server.accept()
                connections.append(connection)
                threading.Thread(target=serve_one, args=(connection,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield server.getsockname()[1]
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        server.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        acceptor.join(5)
