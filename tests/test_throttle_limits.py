"""``--max-throttles`` and ``--max-waiters`` on ``throttle``, on both backends: the
request that would pass a limit gets its 413 and nothing changes; and a server
flooded with distinct keys stops at the limit, its memory with it."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from elockd.protocol.config import Config
from tests.support.hostile_tools import rss_bytes
from tests.support.line_client import RunningServer
from tests.support.polling import eventually, stats_showing


@pytest.fixture
def server_config() -> Config:
    return replace(Config(port=0, metrics_port=0), max_throttles=3, max_waiters=2)


async def test_max_throttles_and_max_waiters_are_413(
    lock_server: RunningServer, clock: object
) -> None:
    client, *waiters = [await lock_server.connect() for _ in range(4)]
    for key in (b"a", b"b", b"c"):
        assert (await client.reply(b"throttle %s 1 60" % key)).startswith(b"200 ")
    assert await client.reply(b"throttle d 1 60") == b"413 Too Many Throttles\r\n"
    assert (await client.reply(b"throttle d 1 60 cost=0")).startswith(b"200 ")  # a peek adds none
    assert (await client.reply(b"throttle a 1 60")).startswith(b"409 ")  # known keys go on
    for count, waiter in enumerate(waiters[:2], start=1):
        await waiter.send(b"throttle a 1 60 wait=1000\n")
        await eventually(lambda n=count: stats_showing(client, waiting=n))  # type: ignore[misc]
    assert await waiters[2].reply(b"throttle a 1 60 wait=1000") == b"413 Too Many Waiters\r\n"


def flood(port: int, names: range, connections: int = 4) -> Counter[bytes]:
    """Ask ``throttle f<N> 1 3600`` once for every N of ``names``, pipelined over a few
    connections (a thread sends while this one reads, so neither side's buffers
    fill up); the count of each reply's first word."""
    replies: Counter[bytes] = Counter()
    chunks = [names[i::connections] for i in range(connections)]

    def one(chunk: range) -> Counter[bytes]:
        seen: Counter[bytes] = Counter()
        with socket.create_connection(("127.0.0.1", port)) as sock:

            def send() -> None:
                for start in range(0, len(chunk), 20_000):
                    part = chunk[start : start + 20_000]
                    sock.sendall(b"".join(b"throttle f%d 1 3600\n" % n for n in part))

            sender = threading.Thread(target=send)
            sender.start()
            buffer = b""
            lines = 0
            while lines < len(chunk):
                data = sock.recv(1 << 20)
                assert data, "the server closed the connection"
                buffer += data
                *complete, buffer = buffer.split(b"\r\n")
                lines += len(complete)
                seen.update(line.split(b" ", 1)[0] for line in complete)
            sender.join()
        return seen

    with ThreadPoolExecutor(connections) as pool:
        for seen in pool.map(one, chunks):
            replies += seen
    return replies


@pytest.mark.serial
def test_a_million_and_one_keys_meet_413_and_memory_stays_bounded(
    spawn_server: Callable[..., tuple[subprocess.Popen[str], int]],
) -> None:
    """The default --max-throttles (1,000,000): the key after the millionth is
    refused, and once the table is full more new keys cost the server nothing."""
    process, port = spawn_server()
    before = rss_bytes(process.pid)
    assert flood(port, range(1_000_000)) == Counter({b"200": 1_000_000})
    full = rss_bytes(process.pid)
    assert flood(port, range(1_000_000, 1_000_001), connections=1) == Counter({b"413": 1})
    assert flood(port, range(1_000_001, 1_200_001)) == Counter({b"413": 200_000})
    after = rss_bytes(process.pid)
    per_key = (full - before) / 1_000_000
    print(f"{per_key:.0f} bytes a throttle key; +{(after - full) / 2**20:.1f} MiB for 200,000 more")
    assert per_key < 400, per_key
    assert after - full < 16 * 2**20, (after - full) / 2**20
