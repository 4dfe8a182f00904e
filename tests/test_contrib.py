"""contrib/ against a real server: the bash probe, the Nagios check and the example
worker (the systemd unit: tests/test_systemd_unit.py)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elockd.client import BlockingClient
from tests.server_process import start_server, stop_server

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"
PROBE = CONTRIB / "elockd-probe.sh"
CHECK = CONTRIB / "check_elockd"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    process, port = start_server()
    yield port
    stop_server(process)


def probe(port: int, *argv: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(PROBE), "-p", str(port), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_probe_ping_and_terse_verbs(port: int) -> None:
    result = probe(port)
    assert (result.returncode, result.stdout) == (0, "200 PONG\n")
    result = probe(port, "i", "probe-key")
    assert (result.returncode, result.stdout) == (1, "0 Not Locked\n")
    with BlockingClient(port=port) as holder:
        holder.command("g probe-key")
        result = probe(port, "i", "probe-key")
        assert (result.returncode, result.stdout) == (0, "1 Locked\n")
        assert probe(port, "lock", "probe-key").returncode == 1  # 409 Unavailable
        assert probe(port, "lock", "probe-free").returncode == 0  # 200 Acquired
    result = probe(port, "q")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[-1] == "END" and any(line.startswith("connections: ") for line in lines)
    result = probe(port, "stats")
    assert result.returncode == 0 and result.stdout.startswith("200 STATS\n")


def test_probe_fails_fast_without_a_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: refused
        result = probe(sock.getsockname()[1])
    assert result.returncode == 3 and "cannot connect" in result.stderr
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        start = time.monotonic()
        result = probe(silent.getsockname()[1], "-t", "0.3", "ping")
    assert result.returncode == 3 and "no answer" in result.stderr
    assert time.monotonic() - start < 5


def test_probe_with_auth(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("letmein\n")
    server, port = start_server("--auth-token-file", str(token))
    try:
        assert probe(port, "-a", str(token), "ping").returncode == 0
        result = probe(port, "ping")
        assert (result.returncode, result.stdout) == (1, "403 Auth Required\n")
    finally:
        stop_server(server)


def check(port: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), "-p", str(port), *argv],
        capture_output=True,
        text=True,
        timeout=20,
    )


def test_nagios_check_ok_warning_critical(port: int, tmp_path: Path) -> None:
    state = ["--state-file", str(tmp_path / "state.json")]
    first = check(port, *state)
    assert first.returncode == 0, first.stdout
    assert first.stdout.startswith("ELOCKD OK - ") and "first run" in first.stdout
    assert re.search(r"\| connections=\d+;8000;9500;0 waiting=0;100;1000;0 ", first.stdout)
    with BlockingClient(port=port):
        warning = check(port, *state, "--connections-warning", "2")
        assert warning.returncode == 1 and warning.stdout.startswith("ELOCKD WARNING")
        critical = check(port, *state, "--connections-critical", "2")
        assert critical.returncode == 2 and critical.stdout.startswith("ELOCKD CRITICAL")
    # Crashing workers: holds freed without a release are orphans.
    for index in range(3):
        with socket.create_connection(("127.0.0.1", port)) as crashing:
            crashing.sendall(b"g orphan-%d\n" % index)
            assert crashing.recv(100) == b"1 Got Lock\r\n"
    with BlockingClient(port=port) as client:  # a round trip: the orphans are counted
        deadline = time.monotonic() + 5
        while client.stats()["connections"] > 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    orphaned = check(port, *state, "--orphans-critical", "1")
    assert orphaned.returncode == 2, orphaned.stdout
    assert "orphans_per_min=" in orphaned.stdout


def test_nagios_check_unknown_without_a_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        result = check(sock.getsockname()[1])
    assert result.returncode == 3 and result.stdout.startswith("ELOCKD UNKNOWN")


@pytest.mark.parametrize("mode", [[], ["--threads"]])
def test_rate_limited_worker_example(port: int, mode: list[str]) -> None:
    argv = ["--port", str(port), "--limit", "2", "--workers", "5", "--jobs", "10", *mode]
    result = subprocess.run(
        [sys.executable, str(CONTRIB / "rate_limited_worker.py"), *argv, "--call-time", "0.02"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    summary = re.fullmatch(r"(\d+) calls, at most (\d+) in flight \(limit 2\)\n", result.stdout)
    assert summary is not None, result.stdout
    calls, peak = summary.groups()
    assert int(calls) == 10 and 1 <= int(peak) <= 2  # 1 only on a badly overloaded machine


def test_rate_limit_holds_across_processes(port: int) -> None:
    """Two worker processes share one limit: the server never sees 3 holders."""
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        with BlockingClient(port=port) as observer:
            while not stop.is_set():
                peak = max(peak, observer.info("cross-process").shared)

    watcher = threading.Thread(target=watch)
    watcher.start()
    argv = ["--port", str(port), "--key", "cross-process", "--limit", "2", "--workers", "3"]
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                str(CONTRIB / "rate_limited_worker.py"),
                *argv,
                "--jobs",
                "8",
                "--call-time",
                "0.1",
            ],
            stdout=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    try:
        assert [run.wait(timeout=30) for run in runs] == [0, 0]
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak <= 2
