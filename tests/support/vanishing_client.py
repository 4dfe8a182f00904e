"""A client on a host that is about to vanish (tests/test_hostile.py): it connects,
takes ``job`` with ``g``, prints the reply, and then just stays, as a process on a
machine that loses power would: it never closes its connection.

Run as ``python tests/support/vanishing_client.py HOST PORT``.
"""

from __future__ import annotations

import socket
import sys
import time


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    sock = socket.create_connection((host, port))
    sock.sendall(b"g job\n")
    reply = b""
    while not reply.endswith(b"\n"):
        reply += sock.recv(1024)
    print(reply.decode().strip(), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
