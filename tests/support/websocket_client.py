"""A WebSocket client in a process of its own (tests/test_hostile_websocket.py), so that
the test's probe measures the server and not the test's own event loop.

``python tests/support/websocket_client.py hold HOST PORT KEY``: takes KEY with ``g``, prints
the reply and stays forever, never closing (a host about to vanish).

``python tests/support/websocket_client.py dump HOST PORT``: sends ``d``, reads the whole
reply message, prints its size in bytes, and exits.
"""

from __future__ import annotations

import socket
import sys
import time

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Message, Request, TextMessage


def connect(host: str, port: int) -> tuple[socket.socket, WSConnection]:
    sock = socket.create_connection((host, port))
    ws = WSConnection(ConnectionType.CLIENT)
    sock.sendall(ws.send(Request(host=f"{host}:{port}", target="/")))
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed during the handshake")
        ws.receive_data(data)
        if any(isinstance(event, AcceptConnection) for event in ws.events()):
            return sock, ws


def one_message(sock: socket.socket, ws: WSConnection) -> bytes:
    parts: list[bytes] = []
    while True:
        for event in ws.events():
            if isinstance(event, Message):
                data = event.data
                parts.append(data.encode() if isinstance(data, str) else bytes(data))
                if event.message_finished:
                    return b"".join(parts)
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("closed before the reply ended")
        ws.receive_data(data)


def main() -> None:
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sock, ws = connect(host, port)
    if mode == "hold":
        sock.sendall(ws.send(TextMessage("g " + sys.argv[4])))
        print(one_message(sock, ws).decode().strip(), flush=True)
        while True:
            time.sleep(3600)
    elif mode == "dump":
        sock.sendall(ws.send(TextMessage("d")))
        print(len(one_message(sock, ws)), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
