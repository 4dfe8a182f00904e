"""The Unix socket (issue 24, U1): its mode whatever the umask, a name per peer, a
live socket never taken over, and a path unlinked only by the server that owns it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from elockd.daemon.server import make_service, serve
from elockd.net.unix_socket import UnixPeers
from elockd.protocol.config import Config
from tests.support.line_client import LineClient


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0, 0o077])
async def test_the_mode_is_0660_whatever_the_umask(
    nursery: trio.Nursery, tmp_path: Path, mask: int
) -> None:
    """Before, it followed the umask: 0777 under umask 000."""
    path = str(tmp_path / "elockd.sock")
    config = Config(port=0, metrics_port=0, unix=path)
    with umask(mask):
        await nursery.start(serve, config, make_service(config))
    assert mode_of(path) == 0o660


@pytest.mark.parametrize("given", ["0600", "0666", "0"])
async def test_unix_mode_sets_it(nursery: trio.Nursery, tmp_path: Path, given: str) -> None:
    path = str(tmp_path / "elockd.sock")
    config = Config(port=0, metrics_port=0, unix=path, unix_mode=given)
    with umask(0o022):
        await nursery.start(serve, config, make_service(config))
    assert mode_of(path) == int(given, 8)


async def test_each_peer_has_its_own_name_with_its_credentials_logged(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, every Unix client was ``unix``: holders could not be told apart."""
    path = str(tmp_path / "elockd.sock")
    config = Config(port=0, metrics_port=0, unix=path)
    await nursery.start(serve, config, make_service(config))
    with caplog.at_level(logging.DEBUG, logger="elockd"):
        first = LineClient(await trio.open_unix_socket(path))
        second = LineClient(await trio.open_unix_socket(path))
        assert await first.request(b"me") == b"1 unix:1 unix:1"
        assert await second.request(b"me") == b"1 unix:2 unix:2"
    assert await first.request(b"g k") == b"1 Got Lock"
    assert await second.listing(b"d") == b"k: unix:1\r\nEND\r\n"
    records = [r for r in caplog.records if r.getMessage() == "unix peer"]
    assert [r.peer for r in records] == ["unix:1", "unix:2"]  # type: ignore[attr-defined]
    for record in records:
        assert (record.pid, record.uid) == (os.getpid(), os.getuid())  # type: ignore[attr-defined]
    await first.aclose()
    await second.aclose()


def test_a_successor_numbers_on_after_the_peers_it_took_over() -> None:
    peers = UnixPeers()
    peers.skip_past([b"127.0.0.1:5000", b"unix:7", b"unix:3", b"unix:x"])
    left, right = socket.socketpair()
    with left, right:
        assert peers.name(left) == b"unix:8"


def start(*args: str) -> subprocess.Popen[str]:
    """A real server, once it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    for line in process.stderr:
        if "listening on" in line:
            return process
    raise AssertionError(f"no start (exit {process.wait()})")


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
    if process.stderr:
        process.stderr.close()


def request(path: str, line: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(line)
        return sock.recv(100)


def test_a_live_socket_is_refused_and_keeps_serving(tmp_path: Path) -> None:
    """Before, a second elockd silently took the path over, then unlinked it when
    it exited: the first one lost every new client."""
    path = str(tmp_path / "elockd.sock")
    first = start("--unix", path)
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "elockd",
                *("--port", "0", "--metrics-port", "0"),
                "--unix",
                path,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2
        assert second.stderr == f"elockd: --unix {path}: another elockd listens on {path}\n"
        assert request(path, b"g k\n") == b"1 Got Lock\r\n", "the first one still serves there"
    finally:
        stop(first)
    assert not os.path.exists(path), "its owner removed it on exit"


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "elockd.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    server = start("--unix", path)
    try:
        assert request(path, b"g k\n") == b"1 Got Lock\r\n"
    finally:
        stop(server)


def test_a_server_leaves_a_path_it_no_longer_owns(tmp_path: Path) -> None:
    """Someone removed the first server's socket file and started another there:
    the first one, stopping, must not unlink the second one's."""
    path = str(tmp_path / "elockd.sock")
    first = start("--unix", path)
    try:
        os.unlink(path)
        second = start("--unix", path)
        try:
            stop(first)
            assert os.path.exists(path)
            assert request(path, b"g k\n") == b"1 Got Lock\r\n"
        finally:
            stop(second)
        assert not os.path.exists(path)
    finally:
        stop(first)


def test_something_else_at_the_path_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "elockd.sock"
    path.write_text("mine\n")
    result = subprocess.run(
        [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0", "--unix", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr == f"elockd: --unix {path}: address already in use\n"
    assert path.read_text() == "mine\n"
