"""A waiter on a host that is about to vanish (tests/test_hostile.py): it connects,
asks ``lock job 600`` (which waits: the test holds ``job``) and prints ``waiting``.

When a line comes on its stdin it sends one more request (``info job``, which the
server reads but answers only after the grant) and prints ``heard`` once the server
has acknowledged it, so the test knows when the server last heard from this host.
Then it stays, as a process on a machine that loses power would: it never reads its
grant and never closes its connection.

Run as ``python tests/support/vanishing_waiter.py HOST PORT``.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

#: Offset of ``tcpi_unacked`` in Linux's ``struct tcp_info``.
UNACKED_OFFSET = 24


def unacked(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return int(struct.unpack_from("=I", info, UNACKED_OFFSET)[0])


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    sock = socket.create_connection((host, port))
    sock.sendall(b"lock job 600\n")
    print("waiting", flush=True)
    sys.stdin.readline()
    sock.sendall(b"info job\n")
    deadline = time.monotonic() + 5
    while unacked(sock) and time.monotonic() < deadline:
        time.sleep(0.001)
    print("heard" if not unacked(sock) else "not acknowledged", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
