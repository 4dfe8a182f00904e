"""A service that is not elockd, on a free loopback port: what a client meets when
the port is wrong. Tools must say "cannot tell" (exit 3, UNKNOWN), never read its
banner as a "no", and never wait out their timeout for an ``END`` that never comes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

SSH_BANNER = b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n"


@contextlib.contextmanager
def foreign_service(
    greeting: bytes = SSH_BANNER, answer: Callable[[bytes], bytes] | None = None
) -> Iterator[int]:
    """Accept connections, send ``greeting`` at once (as sshd does), then read and
    ignore whatever comes, keeping the connection open until the client leaves: the
    hardest case, where only the content of the reply can tell. With ``answer``,
    each request line read is answered with what it returns. Yields the port."""
    server = socket.create_server(("127.0.0.1", 0))
    connections: list[socket.socket] = []

    def serve_one(connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            connection.sendall(greeting)
            pending = b""
            while data := connection.recv(4096):
                if answer is None:
                    continue
                pending += data
                *lines, pending = pending.split(b"\n")
                connection.sendall(b"".join(answer(line.strip()) for line in lines))

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


#: Verbs of the terse family: a node without etcd quorum answers them with the
#: ``0`` form of ``Backend Unavailable``, word verbs with the ``409`` form.
TERSE_VERBS = frozenset(b"g r i sg sr si q d sd dump who iam me".split())


def quorumless_answer(line: bytes) -> bytes:
    """What a cluster node that cannot reach etcd answers every request with."""
    verb = line.split(b" ", 1)[0]
    return b"0 Backend Unavailable\r\n" if verb in TERSE_VERBS else b"409 Backend Unavailable\r\n"
