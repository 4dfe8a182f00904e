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
from tests.support.foreign_service import foreign_service
from tests.support.polling import eventually_blocking
from tests.support.server_process import start_server, stop_server

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


def answer(port: int, *argv: str) -> tuple[int, str]:
    """The probe's exit status and what it printed on stdout."""
    result = probe(port, *argv)
    return result.returncode, result.stdout


def test_probe_ping_and_terse_verbs(port: int) -> None:
    assert answer(port) == (0, "200 PONG\n")
    assert answer(port, "i", "probe-key") == (1, "0 Not Locked\n")
    with BlockingClient(port=port) as holder:
        holder.command("g probe-key")
        assert answer(port, "i", "probe-key") == (0, "1 Locked\n")
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


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("argv", [["ping"], ["i", "k"], ["si", "k"], ["q"], ["stats"]])
def test_probe_without_a_needed_token_cannot_tell(
    token_server: tuple[int, Path], argv: list[str]
) -> None:
    """``0 Auth Required`` is no "not locked": a cron guard ``probe i job || run-job``
    must not run the job because the probe had no token."""
    port, token = token_server
    result = probe(port, *argv)
    assert (result.returncode, result.stdout) == (3, "")
    assert "auth required" in one_line(result.stderr)
    assert probe(port, "-a", str(token), *argv).returncode == (1 if argv[0] in ("i", "si") else 0)


def test_probe_with_a_refused_token_cannot_tell(
    token_server: tuple[int, Path], tmp_path: Path
) -> None:
    port, _ = token_server
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    result = probe(port, "-a", str(wrong), "i", "k")
    assert (result.returncode, result.stdout) == (3, "")
    assert "auth refused: 403 Bad Token" in one_line(result.stderr)


@pytest.mark.parametrize("argv", [["ping"], ["i", "k"], ["q"], ["lock", "k"]])
def test_probe_against_a_foreign_service_cannot_tell(argv: list[str], tmp_path: Path) -> None:
    """sshd on the port: its banner is no reply. It keeps the connection open, so
    only reading the banner for what it is ends the probe before its -t."""
    token = tmp_path / "token"
    token.write_text("letmein\n")
    with foreign_service() as port:
        for auth in ([], ["-a", str(token)]):
            result = probe(port, "-t", "600", *auth, *argv, timeout=60)
            assert (result.returncode, result.stdout) == (3, "")
            line = one_line(result.stderr)
            assert "not an elockd reply: 'SSH-2.0-OpenSSH_9.2p1" in line


def test_probe_reads_glockd_replies() -> None:
    server, port = start_server("--replies", "glockd")
    try:
        assert answer(port, "i", "probe-glockd") == (1, "0 Lock Not Locked: probe-glockd\n")
        with BlockingClient(port=port) as holder:
            holder.command("g probe-glockd")
            assert answer(port, "i", "probe-glockd") == (0, "1 Lock Is Locked: probe-glockd\n")
            assert probe(port, "g", "probe-glockd").returncode == 1
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["-p", "abc", "ping"], "-p 'abc' is not a port number"),
        (["-p", "70000", "ping"], "-p 70000 is not a port number"),
        (["-t", "soon", "ping"], "-t 'soon' is not a number of seconds"),
        (["-a", "/nonexistent/token", "ping"], "-a /nonexistent/token: cannot be read"),
        (["-x", "ping"], "unknown option -x"),
        (["-p"], "-p needs a value"),
    ],
)
def test_probe_usage_errors_are_one_line(argv: list[str], complaint: str) -> None:
    result = subprocess.run(["bash", str(PROBE), *argv], capture_output=True, text=True, timeout=10)
    assert result.returncode == 2
    assert complaint in one_line(result.stderr)


def test_probe_malformed_requests_are_usage_errors(port: int) -> None:
    for argv in (["lock"], ["frobnicate"]):  # 400 Bad Request, 0 Invalid Command
        result = probe(port, *argv)
        assert (result.returncode, result.stdout) == (2, "")
        assert "refused the request" in one_line(result.stderr)


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
    with BlockingClient(port=port) as client:  # once their ends are seen, orphans count
        eventually_blocking(lambda: client.stats()["connections"] == 1, timeout=5)
    orphaned = check(port, *state, "--orphans-critical", "1")
    assert orphaned.returncode == 2, orphaned.stdout
    assert "orphans_per_min=" in orphaned.stdout


def test_nagios_check_unknown_without_a_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        result = check(port)
    assert result.returncode == 3
    assert (
        result.stdout == f"ELOCKD UNKNOWN - 127.0.0.1:{port}: cannot connect: Connection refused\n"
    )


def test_nagios_check_without_a_needed_token_is_unknown_at_once(
    token_server: tuple[int, Path], tmp_path: Path
) -> None:
    """``0 Auth Required`` comes instead of the counters, with no END: UNKNOWN with
    the reason right away, not "timed out" after -t (far longer than this test)."""
    port, token = token_server
    result = check(port, "-t", "600", "--state-file", str(tmp_path / "state"))
    assert result.returncode == 3
    assert result.stdout.startswith(f"ELOCKD UNKNOWN - 127.0.0.1:{port}: auth required: ")
    assert "--auth-token-file" in result.stdout and "timed out" not in result.stdout
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    result = check(port, "--auth-token-file", str(wrong), "--state-file", str(tmp_path / "s"))
    assert result.returncode == 3 and "auth refused: 403 Bad Token" in result.stdout
    good = check(port, "--auth-token-file", str(token), "--state-file", str(tmp_path / "s"))
    assert good.returncode == 0 and good.stdout.startswith("ELOCKD OK - ")


def test_nagios_check_against_a_foreign_service_is_unknown(tmp_path: Path) -> None:
    with foreign_service() as port:
        result = check(port, "-t", "600", "--state-file", str(tmp_path / "state"))
    assert result.returncode == 3
    assert result.stdout == (
        f"ELOCKD UNKNOWN - 127.0.0.1:{port}: not an elockd reply to q: "
        "'SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3'\n"
    )


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["--waiting-warning", "lots"], "--waiting-warning: 'lots' is not a number"),
        (["-p", "http"], "-p/--port: 'http' is not a port number"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_nagios_check_usage_errors_are_unknown(argv: list[str], complaint: str) -> None:
    """Nagios reads 2 as CRITICAL: a wrong command line is UNKNOWN, on stdout."""
    result = subprocess.run(
        [sys.executable, str(CHECK), *argv], capture_output=True, text=True, timeout=20
    )
    assert result.returncode == 3
    assert result.stdout.startswith("ELOCKD UNKNOWN - usage: ") and complaint in result.stdout
    assert "invalid" not in result.stdout and result.stdout.count("\n") == 1


def test_nagios_check_names_a_state_file_it_cannot_write(port: int, tmp_path: Path) -> None:
    state = tmp_path / "missing-directory" / "state.json"
    result = check(port, "--state-file", str(state))
    assert result.returncode == 3
    assert f"--state-file {state}: No such file or directory" in result.stdout


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


@pytest.mark.parametrize(("flags", "limit"), [(["--limit", "2"], "limit 2"), ([], "no limit")])
def test_rate_limited_worker_with_a_rate(port: int, flags: list[str], limit: str) -> None:
    """``--rate 20/1s --burst 2``: 12 calls cannot take less than (12 - 2) / 20 s."""
    argv = ["--port", str(port), "--key", f"rated-{len(flags)}", "--rate", "20/1s"]
    result = subprocess.run(
        [
            sys.executable,
            str(CONTRIB / "rate_limited_worker.py"),
            *argv,
            "--burst",
            "2",
            *flags,
            "--workers",
            "4",
            "--jobs",
            "12",
            "--call-time",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    summary = re.fullmatch(
        rf"12 calls, at most (\d+) in flight \({limit}\), in ([\d.]+) s "
        r"\(rate 20 per 1 s, burst 2\)\n",
        result.stdout,
    )
    assert summary is not None, result.stdout
    peak, elapsed = summary.groups()
    assert float(elapsed) >= 0.5 and 1 <= int(peak) <= 4


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
