"""The terse family end to end: real TCP sockets, several clients, a real process."""

from __future__ import annotations

import gc
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from elockd.config import Config
from elockd.server import GC_THRESHOLDS, tune_garbage_collector
from tests.conftest import LineClient, RunningServer

SpawnServer = Callable[..., tuple[subprocess.Popen[str], int]]


async def test_contention_between_clients(server: RunningServer) -> None:
    clients = [await server.connect() for _ in range(5)]
    replies = [await c.request(b"g job") for c in clients]
    assert replies == [b"1 Got Lock"] + [b"0 Cannot Get Lock"] * 4
    assert await clients[3].request(b"r job") == b"0 Cannot Release Lock"
    assert await clients[0].request(b"r job") == b"1 Released Lock"
    assert await clients[4].request(b"g job") == b"1 Got Lock"
    assert await clients[1].request(b"i job") == b"1 Locked"


async def test_disconnect_releases_everything_and_counts_orphans(server: RunningServer) -> None:
    holder, other = await server.connect(), await server.connect()
    before = await other.stats()
    for key in (b"a", b"b", b"c"):
        assert await holder.request(b"g " + key) == b"1 Got Lock"
    assert await holder.request(b"sg s") == b"1 Got Lock"
    assert await other.request(b"sg s") == b"2 Got Lock"
    await holder.aclose()
    with trio.fail_after(5):
        while await other.request(b"i a") != b"0 Not Locked":
            await trio.sleep(0.01)
    after = await other.stats()
    assert after["orphans"] - before["orphans"] == 3
    assert after["shared_orphans"] - before["shared_orphans"] == 1
    assert after["locks"] == 0
    assert await other.request(b"si s") == b"1 Locked"
    assert await other.request(b"g b") == b"1 Got Lock"


async def test_thousand_pipelined_requests_in_one_write(server: RunningServer) -> None:
    client = await server.connect()
    requests = b"".join(b"g k%d\nr k%d\n" % (i // 2, i // 2) for i in range(0, 1000, 2))
    await client.send(requests)
    replies = [await client.line() for _ in range(1000)]
    assert replies == [b"1 Got Lock\r\n", b"1 Released Lock\r\n"] * 500
    stats = await client.stats()
    assert stats["command_g"] == 500
    assert stats["command_r"] == 500


async def test_ten_megabyte_line_without_newline(server: RunningServer) -> None:
    client = await server.connect()
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
    stats = await client.stats()
    assert stats["invalid_commands"] == 1
    assert stats["locks"] == 1  # nothing it held was lost


@pytest.mark.parametrize("server_config", [Config(max_line=8)])
async def test_max_line_flag_counts_neither_newline_nor_cr(server: RunningServer) -> None:
    client = await server.connect()
    assert await client.request(b"g 123456") == b"1 Got Lock"  # 8 bytes
    await client.send(b"g 123456\r\n")
    assert await client.line() == b"1 Got Lock\r\n"
    assert await client.request(b"g 1234567") == b"0 Line Too Long"
    assert await client.request(b"i 123456") == b"1 Locked"


async def test_binary_keys_over_tcp(server: RunningServer) -> None:
    a, b = await server.connect(), await server.connect()
    key = b"\xff\xfe\x00caf\xc3\xa9\x01"
    assert await a.request(b"g " + key) == b"1 Got Lock"
    assert await b.request(b"g " + key) == b"0 Cannot Get Lock"
    await b.send(b"d " + key + b"\n")
    lines = await b.lines_until_end()
    assert lines[0].startswith(key + b": 127.0.0.1:")


async def test_stats_deltas(server: RunningServer) -> None:
    a, b = await server.connect(), await server.connect()
    before = await a.stats()
    await a.request(b"g x")
    await b.request(b"g x")
    await a.request(b"sg y")
    await b.request(b"sg y")
    await b.request(b"si y")
    await b.request(b"bogus")
    after = await a.stats()
    assert after["command_g"] - before["command_g"] == 2
    assert after["command_sg"] - before["command_sg"] == 2
    assert after["command_si"] - before["command_si"] == 1
    assert after["command_q"] - before["command_q"] == 1
    assert after["invalid_commands"] - before["invalid_commands"] == 1
    assert after["locks"] == 1
    assert after["shared_locks"] == 1
    assert after["connections"] == 2


@pytest.mark.parametrize("server_config", [Config(replies="glockd")])
async def test_glockd_replies_over_tcp(server: RunningServer) -> None:
    a, b = await server.connect(), await server.connect()
    assert await a.request(b"g k") == b"1 Lock Get Success: k"
    assert await b.request(b"g k") == b"0 Lock Get Failure: k"
    assert await b.request(b"sg k") == b"1 Shared Lock Get Success: k"


@pytest.mark.parametrize("server_config", [Config(max_connections=2)])
async def test_connection_over_the_limit_is_told_and_closed(server: RunningServer) -> None:
    first, second = await server.connect(), await server.connect()
    assert await first.request(b"g k") == b"1 Got Lock"
    assert await second.request(b"ping") == b"200 PONG"
    third = await server.connect()
    assert await third.line() == b"0 Too Many Connections\r\n"
    assert await third.at_eof()
    await second.aclose()
    with trio.fail_after(5):
        while True:
            fourth = await server.connect()
            reply = await fourth.request(b"i k")
            if reply == b"1 Locked":
                break
            await trio.sleep(0.01)  # the server has not seen the close yet


async def test_unix_socket(nursery: trio.Nursery, tmp_path: Path) -> None:
    from elockd.server import make_service, serve

    path = str(tmp_path / "elockd.sock")
    config = Config(port=0, metrics_port=0, unix=path)
    await nursery.start(serve, config, make_service(config))
    client = LineClient(await trio.open_unix_socket(path))
    assert await client.request(b"g k") == b"1 Got Lock"
    assert await client.request(b"me") == b"1 unix unix"
    await client.aclose()


def test_sigterm_frees_holds_and_exits_zero(spawn_server: SpawnServer) -> None:
    process, port = spawn_server()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"g a\nsg b\n")
        received = b""
        while received.count(b"\r\n") < 2:
            received += sock.recv(100)
        assert received == b"1 Got Lock\r\n1 Got Lock\r\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert sock.recv(100) == b""  # the server closed our connection
    assert process.stderr is not None
    log = process.stderr.read()
    assert "SIGTERM received" in log
    assert "Traceback" not in log


def test_sigint_also_stops_cleanly(spawn_server: SpawnServer) -> None:
    process, port = spawn_server()
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    assert process.stderr is not None
    assert "Traceback" not in process.stderr.read()


def test_nc_shell_probe(spawn_server: SpawnServer) -> None:
    """What the README promises: a shell user drives the server with nc."""
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
