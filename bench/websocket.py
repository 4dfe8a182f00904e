"""The WebSocket row of ``make bench`` (``--only websocket``): lock/unlock cycles
over WebSocket sessions beside the same cycles over TCP, in one run.

The C load generator speaks only TCP, so both columns are driven by the same small
trio driver (this file) in a process of its own: ``--clients`` connections, each
looping ``g KEY`` / ``r KEY`` on its own key with one request in flight, for
``--seconds``. Over TCP a request is a line; over WebSocket a message (trio-websocket,
as the elockd client uses). The ratio is what to read: the driver's own cost is in
both columns.
"""

from __future__ import annotations

import sys
import time

import trio
from trio_websocket import open_websocket_url


async def tcp_client(port: int, key: bytes, until: float, counts: list[int]) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    buffer = b""
    done = 0
    async with stream:
        while time.monotonic() < until:
            for verb in (b"g ", b"r "):
                await stream.send_all(verb + key + b"\n")
                while b"\n" not in buffer:
                    buffer += await stream.receive_some(4096)
                buffer = buffer[buffer.index(b"\n") + 1 :]
            done += 1
    counts.append(done)


async def websocket_client(url: str, key: bytes, until: float, counts: list[int]) -> None:
    done = 0
    async with open_websocket_url(url) as ws:
        while time.monotonic() < until:
            for verb in (b"g ", b"r "):
                await ws.send_message(verb + key)
                await ws.get_message()
            done += 1
    counts.append(done)


async def drive(kind: str, port: int, clients: int, seconds: float) -> float:
    """Cycles per second over ``kind`` (tcp or websocket) to ``port``."""
    counts: list[int] = []
    until = time.monotonic() + seconds
    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        for index in range(clients):
            key = b"bench-%d" % index
            if kind == "tcp":
                nursery.start_soon(tcp_client, port, key, until, counts)
            else:
                nursery.start_soon(websocket_client, f"ws://127.0.0.1:{port}/", key, until, counts)
    return sum(counts) / (time.monotonic() - started)


def main() -> None:
    kind, port, clients, seconds = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
    )
    print(f"{trio.run(drive, kind, port, clients, seconds):.1f}")


if __name__ == "__main__":
    main()
