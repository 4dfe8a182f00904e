"""Listening TCP sockets, for the lock port and the HTTP port alike."""

from __future__ import annotations

import socket

#: Connections the kernel queues for a listener before accept() takes them: deep, so
#: a burst of newcomers (a fleet restarting) waits in the queue rather than being
#: refused.
LISTEN_BACKLOG = 4096


def open_tcp_sockets(
    host: str, port: int, *, every_address: bool = True, backlog: int = LISTEN_BACKLOG
) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for every address of ``host`` (the
    lock port), or for its first one only (``every_address=False``: the HTTP
    port). Port 0 takes one free port, the same for every address family."""
    sockets: list[socket.socket] = []
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    try:
        for family, kind, proto, _, address in infos if every_address else infos[:1]:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and every_address:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            if port == 0:  # one ephemeral port for every address family
                port = sock.getsockname()[1]
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
