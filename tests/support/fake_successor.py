"""A successor that fails on purpose, for the hand-over's failure tests.

Usage: fake_successor.py CONTROL_PATH HOW, HOW being one of
  wrong-version       says hello with a state version nobody writes (999)
  vanish-after-state  reads the whole state, then exits without a word
  never-ready         reads the whole state, then says nothing until closed

It speaks the control socket's framing (elockd.handover.channel) with blocking
sockets, so it shares no code path with the real successor it stands in for.
Exits 0 when it did what it was told.
"""

from __future__ import annotations

import array
import json
import socket
import struct
import sys

from elockd.handover.records import VERSION


def send(sock: socket.socket, message: dict[str, object]) -> None:
    payload = json.dumps({**message, "fds": 0}).encode()
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def receive(sock: socket.socket, buffer: bytearray) -> dict[str, object] | None:
    """The next message (its descriptors are closed at once), or None at EOF."""
    while True:
        if len(buffer) >= 4:
            (length,) = struct.unpack_from(">I", buffer)
            if len(buffer) >= 4 + length:
                message: dict[str, object] = json.loads(bytes(buffer[4 : 4 + length]))
                del buffer[: 4 + length]
                return message
        data, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4))
        for _, _, cdata in ancillary:
            fds = array.array("i")
            fds.frombytes(cdata[: len(cdata) - len(cdata) % 4])
            for fd in fds:
                socket.close(fd)
        if not data:
            return None
        buffer += data


def main() -> int:
    path, how = sys.argv[1], sys.argv[2]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    buffer = bytearray()
    if how == "wrong-version":
        send(sock, {"t": "hello", "format": "elockd-state", "versions": [999]})
        reply = receive(sock, buffer)
        print(reply)
        return 0 if reply is not None and reply.get("t") == "refused" else 1
    send(sock, {"t": "hello", "format": "elockd-state", "versions": [VERSION]})
    while (message := receive(sock, buffer)) is not None and message.get("t") != "end":
        pass
    if message is None:
        print("the state ended early")
        return 1
    if how == "vanish-after-state":
        sock.close()
        return 0
    if how == "never-ready":
        print("state received", flush=True)  # the old process is paused until it gives up
        reply = receive(sock, buffer)  # the old process gives up: "aborted", then EOF
        print(reply)
        return 0 if reply is not None and reply.get("t") == "aborted" else 1
    print(f"unknown HOW {how!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
