"""The terse family end to end: real TCP sockets, several clients, a real process.

Tests that take ``lock_server`` and ``clock`` run on both backends: the in-memory
server on a MockClock, and a cluster node on a real etcd in real time. The few that
are about the in-memory server process itself (signals, a Unix socket, the garbage
collector) run on it alone and say so.
"""

from __future__ import annotations

import gc
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import trio

from elockd.daemon.server import GC_THRESHOLDS, tune_garbage_collector
from elockd.protocol.config import Config
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import counted_stats, eventually, stats_showing
from tests.support.server_process import SpawnServer, drained


async def test_contention_between_clients(lock_server: RunningServer, clock: object) -> None:
    clients = [await lock_server.connect() for _ in range(5)]
    replies = [await c.request(b"g job") for c in clients]
    assert replies == [b"1 Got Lock"] + [b"0 Cannot Get Lock"] * 4
    assert await clients[3].request(b"r job") == b"0 Cannot Release Lock"
    assert await clients[0].request(b"r job") == b"1 Released Lock"
    assert await clients[4].request(b"g job") == b"1 Got Lock"
    assert await clients[1].request(b"i job") == b"1 Locked"


async def test_disconnect_releases_everything_and_counts_orphans(
    lock_server: RunningServer, clock: object
) -> None:
    holder, other = await lock_server.connect(), await lock_server.connect()
    before = await other.stats()
    for key in (b"a", b"b", b"c"):
        assert await holder.request(b"g " + key) == b"1 Got Lock"
    assert await holder.request(b"sg s") == b"1 Got Lock"
    assert await other.request(b"sg s") == b"2 Got Lock"
    await eventually(
        lambda: stats_showing(other, locks=3, shared_locks=1), what="the holds counted"
    )
    await holder.aclose()
    after = await eventually(lambda: stats_showing(other, locks=0), what="the holds freed")
    assert after["orphans"] - before["orphans"] == 3
    assert after["shared_orphans"] - before["shared_orphans"] == 1
    assert after["locks"] == 0
    assert await other.request(b"si s") == b"1 Locked"
    assert await other.request(b"g b") == b"1 Got Lock"


async def test_thousand_pipelined_requests_in_one_write(
    lock_server: RunningServer, clock: object, backend: str
) -> None:
    """A thousand requests in memory; on a cluster node, where each is an etcd
    round trip, two hundred."""
    pairs = 500 if backend == "memory" else 100
    client = await lock_server.connect()
    await client.send(b"".join(b"g k%d\nr k%d\n" % (i, i) for i in range(pairs)))
    replies = [await client.line() for _ in range(2 * pairs)]
    assert replies == [b"1 Got Lock\r\n", b"1 Released Lock\r\n"] * pairs
    stats = await client.stats()
    assert stats["command_g"] == pairs
    assert stats["command_r"] == pairs


async def test_ten_megabyte_line_without_newline(lock_server: RunningServer, clock: object) -> None:
    client = await lock_server.connect()
    assert await client.request(b"g kept") == b"1 Got Lock"
    chunk = b"x" * 65536
    sent = 0
    while sent < 10 * 1024 * 1024:
        await client.send(chunk)
        sent += len(chunk)
    # The reply comes as soon as the line is known to be too long, not at its end.
    assert await client.line() == b"0 Line Too Long\r\n"
    await client.send(b"still the long line\ni kept\n")
    assert await client.line() == b"1 Locked\r\n"
    # Nothing it held was lost (a cluster node's count may trail by a few ms).
    stats = await eventually(lambda: stats_showing(client, locks=1), what="the hold counted")
    assert stats["invalid_commands"] == 1


@pytest.mark.parametrize("server_config", [Config(max_line=8)])
async def test_max_line_flag_counts_neither_newline_nor_cr(
    lock_server: RunningServer, clock: object
) -> None:
    client = await lock_server.connect()
    assert await client.request(b"g 123456") == b"1 Got Lock"  # 8 bytes
    await client.send(b"g 123456\r\n")
    assert await client.line() == b"1 Got Lock\r\n"
    assert await client.request(b"g 1234567") == b"0 Line Too Long"
    assert await client.request(b"i 123456") == b"1 Locked"


async def test_binary_keys_over_tcp(lock_server: RunningServer, clock: object) -> None:
    a, b = await lock_server.connect(), await lock_server.connect()
    key = b"\xff\xfe\x00caf\xc3\xa9\x01"
    assert await a.request(b"g " + key) == b"1 Got Lock"
    assert await b.request(b"g " + key) == b"0 Cannot Get Lock"
    await b.send(b"d " + key + b"\n")
    lines = await b.lines_until_end()
    assert lines[0].startswith(key + b": 127.0.0.1:")


async def test_stats_deltas(lock_server: RunningServer, clock: object) -> None:
    a, b = await lock_server.connect(), await lock_server.connect()
    before = await a.stats()
    await a.request(b"g x")
    await b.request(b"g x")
    await a.request(b"sg y")
    await b.request(b"sg y")
    await b.request(b"si y")
    await b.request(b"bogus")
    after, reads = await counted_stats(a, locks=1, shared_locks=1)
    assert after["command_g"] - before["command_g"] == 2
    assert after["command_sg"] - before["command_sg"] == 2
    assert after["command_si"] - before["command_si"] == 1
    assert after["command_q"] - before["command_q"] == reads  # each q counts itself
    assert after["invalid_commands"] - before["invalid_commands"] == 1
    assert after["connections"] == 2


@pytest.mark.parametrize("server_config", [Config(replies="glockd")])
async def test_glockd_replies_over_tcp(lock_server: RunningServer, clock: object) -> None:
    a, b = await lock_server.connect(), await lock_server.connect()
    assert await a.request(b"g k") == b"1 Lock Get Success: k"
    assert await b.request(b"g k") == b"0 Lock Get Failure: k"
    assert await b.request(b"sg k") == b"1 Shared Lock Get Success: k"


@pytest.mark.parametrize("server_config", [Config(max_connections=2)])
async def test_connection_over_the_limit_is_told_and_closed(
    lock_server: RunningServer, clock: object
) -> None:
    first, second = await lock_server.connect(), await lock_server.connect()
    assert await first.request(b"g k") == b"1 Got Lock"
    assert await second.request(b"ping") == b"200 PONG"
    third = await lock_server.connect()
    assert await third.line() == b"0 Too Many Connections\r\n"
    assert await third.at_eof()
    await second.aclose()

    async def served() -> bool:  # once the server has seen the close
        reply = await (await lock_server.connect()).request(b"i k")
        assert reply in (b"1 Locked", b"0 Too Many Connections"), reply
        return reply == b"1 Locked"

    await eventually(served, what="a slot for a new connection")


async def test_unix_socket(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The listener of the server process, the same whatever the backend: in memory."""
    from elockd.daemon.server import make_service, serve

    path = str(tmp_path / "elockd.sock")
    config = Config(port=0, metrics_port=0, unix=path)
    await nursery.start(serve, config, make_service(config))
    client = LineClient(await trio.open_unix_socket(path))
    assert await client.request(b"g k") == b"1 Got Lock"
    assert await client.request(b"me") == b"1 unix:1 unix:1"
    await client.aclose()


def test_sigterm_frees_holds_and_exits_zero(spawn_server: SpawnServer) -> None:
    """A real in-memory server process (signals need one); a cluster node's SIGTERM
    is in test_cluster.py."""
    log: list[str] = []
    process, port = spawn_server(log=log)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"g a\nsg b\n")
        received = b""
        while received.count(b"\r\n") < 2:
            received += sock.recv(100)
        assert received == b"1 Got Lock\r\n1 Got Lock\r\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert sock.recv(100) == b""  # the server closed our connection
    drained(process)
    assert "SIGTERM received" in "".join(log)
    assert "Traceback" not in "".join(log)


def test_sigint_also_stops_cleanly(spawn_server: SpawnServer) -> None:
    """A real in-memory server process: signals need one."""
    log: list[str] = []
    process, port = spawn_server(log=log)
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    drained(process)
    assert "SIGINT received" in "".join(log)  # the log is read at all
    assert "Traceback" not in "".join(log)


def test_nc_shell_probe(spawn_server: SpawnServer) -> None:
    """What the README promises: a shell user drives the server with nc (a real
    in-memory server process, as the README starts it)."""
    _, port = spawn_server()
    result = subprocess.run(
        ["nc", "-q", "1", "127.0.0.1", str(port)],
        input=b"g job\ni job\n",
        capture_output=True,
        timeout=10,
        check=True,
    )
    assert result.stdout == b"1 Got Lock\r\n1 Locked\r\n"


def test_the_server_process_tunes_the_garbage_collector() -> None:
    before = gc.get_threshold()
    try:
        tune_garbage_collector()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert GC_THRESHOLDS[0] >= 10_000  # young collections rare enough to spare holds
    finally:
        gc.set_threshold(*before)
