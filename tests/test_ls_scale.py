"""``ls`` on a real server process holding a million locks (docs/protocol.md: ``ls``):
a prefix costs the keys under it, and a full listing streams to a reader that does
not read without growing the server. Wall-clock and RSS bounds: run alone."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.hostile_tools import rss_bytes
from tests.support.server_process import start_server, stop_server

pytestmark = pytest.mark.serial

LOCKS = 1_000_000
CONNECTIONS = 4
MATCHING = 10
MB = 1 << 20


def keys(index: int) -> Iterator[bytes]:
    """Connection ``index``'s keys; the first one also takes the 10 under ``jobs/``."""
    share = (LOCKS - MATCHING) // CONNECTIONS
    if index == 0:
        yield from (b"jobs/%d" % n for n in range(MATCHING))
        share += (LOCKS - MATCHING) - share * CONNECTIONS
    for n in range(share):
        yield b"bulk/%d/%07d" % (index, n)


def take_locks(port: int, index: int, held: list[socket.socket]) -> None:
    """Pipeline ``g`` for this connection's keys, reading the replies alongside."""
    sock = socket.create_connection(("127.0.0.1", port))
    lines = b"".join(b"g %s\n" % key for key in keys(index))
    expected = lines.count(b"\n")
    sender = threading.Thread(target=sock.sendall, args=(lines,))
    sender.start()
    got = 0
    while got < expected:  # every grant is checked once, by `q` (the fixture)
        got += sock.recv(1 << 20).count(b"\r\n")
    sender.join()
    held.append(sock)


@pytest.fixture(scope="module")
def million() -> Iterator[tuple[int, int]]:
    """(pid, port) of a server holding LOCKS locks over CONNECTIONS connections."""
    process, port = start_server("--max-holds", str(LOCKS))
    held: list[socket.socket] = []
    try:
        threads = [
            threading.Thread(target=take_locks, args=(port, i, held)) for i in range(CONNECTIONS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(held) == CONNECTIONS
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"q\n")
            assert b"\r\nlocks: %d\r\n" % LOCKS in read_until_end(sock)
        yield process.pid, port
    finally:
        for sock in held:
            sock.close()
        stop_server(process)


def read_until_end(sock: socket.socket) -> bytes:
    data = bytearray()
    while not data.endswith(b"END\r\n"):
        chunk = sock.recv(1 << 20)
        assert chunk, "closed before END"
        data += chunk
    return bytes(data)


def test_a_prefix_of_ten_keys_among_a_million_answers_within_10_ms(
    million: tuple[int, int],
) -> None:
    _, port = million
    with socket.create_connection(("127.0.0.1", port)) as sock:
        times = []
        for _ in range(7):
            started = time.perf_counter()
            sock.sendall(b"ls jobs/\n")
            reply = read_until_end(sock)
            times.append(time.perf_counter() - started)
    lines = reply.split(b"\r\n")
    assert [line.split(b" ")[0] for line in lines[:-2]] == [b"jobs/%d" % n for n in range(10)]
    print(f"\nls jobs/ among {LOCKS:,} locks: median {statistics.median(times) * 1000:.2f} ms, "
          f"best {min(times) * 1000:.2f} ms")  # fmt: skip
    assert statistics.median(times) < 0.010, times


def test_a_full_listing_to_a_reader_that_does_not_read_keeps_the_server_flat(
    million: tuple[int, int],
) -> None:
    pid, port = million
    before = rss_bytes(pid)
    with socket.create_connection(("127.0.0.1", port)) as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        reader.sendall(b"ls\n")
        # The server fills the socket buffers, then waits for the reader.
        peak = before
        for _ in range(20):
            time.sleep(0.1)
            peak = max(peak, rss_bytes(pid))
        with socket.create_connection(("127.0.0.1", port)) as probe:
            started = time.perf_counter()
            probe.sendall(b"ping\n")
            assert probe.recv(100) == b"200 PONG\r\n"
            ping = time.perf_counter() - started
        growth = peak - before
        # Then it reads: every lock is listed once, in order.
        started = time.perf_counter()
        data = read_until_end(reader)
        elapsed = time.perf_counter() - started
    lines = data.split(b"\r\n")[:-2]
    print(f"\nunread ls of {LOCKS:,} locks: server RSS +{growth / 1024:.0f} KiB; a ping meanwhile "
          f"{ping * 1000:.1f} ms; then read in {elapsed:.1f} s")  # fmt: skip
    assert len(lines) == LOCKS
    names = [line.split(b" ", 1)[0] for line in lines]
    assert names == sorted(names) and len(set(names)) == LOCKS
    assert growth < 4 * MB, growth
