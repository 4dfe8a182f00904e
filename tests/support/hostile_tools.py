"""Measuring tools for tests/test_hostile.py: a server's RSS, and a probe's latency.

Each hostile test runs the server as its own process (tests/support/server_process.py), so
its resident memory can be read from /proc without counting the test's own, and a
probe connection measures what every other client would feel while the attack runs.
"""

from __future__ import annotations

import math
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` now (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    """A port the OS has just handed out and taken back (for a second listener whose
    port the server cannot report, such as --metrics-port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Probe:
    """Round trips of ``g``/``r`` on one connection: what a well-behaved client sees."""

    samples: list[float] = field(default_factory=list)

    @property
    def worst(self) -> float:
        """The slowest round trip so far, in seconds."""
        return max(self.samples) if self.samples else math.inf

    @property
    def count(self) -> int:
        return len(self.samples)


async def _round_trip(stream: trio.SocketStream, request: bytes, buffer: bytearray) -> None:
    await stream.send_all(request)
    while b"\n" not in buffer:
        chunk = await stream.receive_some(4096)
        if not chunk:
            raise EOFError("the server closed the probe's connection")
        buffer += chunk
    del buffer[: buffer.index(b"\n") + 1]


@asynccontextmanager
async def latency_probe(
    port: int,
    *,
    key: bytes = b"probe-key",
    interval: float = 0.005,
    host: str = "127.0.0.1",
    token: bytes | None = None,
) -> AsyncIterator[Probe]:
    """Run a probe doing ``g KEY`` then ``r KEY`` every ``interval`` seconds for as
    long as the block runs; each sample is one request's round trip (real time).
    With ``token`` it first authenticates."""
    probe = Probe()
    stream = await trio.open_tcp_stream(host, port)
    buffer = bytearray()
    if token is not None:
        await _round_trip(stream, b"auth " + token + b"\n", buffer)

    async def run() -> None:
        while True:
            for verb in (b"g ", b"r "):
                started = trio.current_time()
                await _round_trip(stream, verb + key + b"\n", buffer)
                probe.samples.append(trio.current_time() - started)
            await trio.sleep(interval)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            yield probe
            nursery.cancel_scope.cancel()
    finally:
        await stream.aclose()
