"""A crowd of client connections in a process of its own, for tests/test_hostile.py.

Run as ``python tests/support/crowd.py PORT CONNECTIONS LINES TEMPLATE [EXPECT]``: it opens
CONNECTIONS connections, sends LINES request lines on each (TEMPLATE with ``{c}`` the
connection's number and ``{n}`` the line's), reads EXPECT reply lines on each (0: none
yet), prints ``ready`` and then obeys commands on stdin, one per line:

* ``close``: close every connection at once (a crowd dropping together), print ``closed``;
* ``read N``: read N more reply lines on each connection, print each distinct reply
  with its count (``200 OK x 10000``), then ``done``.

In its own process so that the test's probe measures the server, not this loop.
"""

from __future__ import annotations

import collections
import resource
import selectors
import socket
import sys


def open_crowd(port: int, count: int) -> list[socket.socket]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    crowd = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        crowd.append(sock)
    return crowd


def read_lines(crowd: list[socket.socket], lines: int) -> collections.Counter[bytes]:
    """Read ``lines`` reply lines from every connection: a count of each reply."""
    replies: collections.Counter[bytes] = collections.Counter()
    if lines == 0:
        return replies
    selector = selectors.DefaultSelector()
    buffers = {}
    for sock in crowd:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        buffers[sock] = [b"", 0]
    left = len(crowd)
    while left:
        for key, _ in selector.select(timeout=60):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise SystemExit("crowd: the server closed a connection")
            state = buffers[sock]
            data = state[0] + chunk
            *complete, state[0] = data.split(b"\n")
            replies.update(line.rstrip(b"\r") for line in complete)
            state[1] += len(complete)
            if state[1] >= lines:
                selector.unregister(sock)
                state[1] -= lines
                left -= 1
    selector.close()
    for sock in crowd:
        sock.setblocking(True)
    return replies


def main() -> None:
    port, count, lines = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    template = sys.argv[4]
    expect = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    crowd = open_crowd(port, count)
    for number, sock in enumerate(crowd):
        sock.sendall("".join(template.format(c=number, n=n) for n in range(lines)).encode())
    read_lines(crowd, expect)
    print("ready", flush=True)
    for command in sys.stdin:
        verb, *arguments = command.split()
        if verb == "close":
            for sock in crowd:
                sock.close()
            print("closed", flush=True)
        elif verb == "read":
            for reply, seen in sorted(read_lines(crowd, int(arguments[0])).items()):
                print(f"{reply.decode()} x {seen}", flush=True)
            print("done", flush=True)


if __name__ == "__main__":
    main()
