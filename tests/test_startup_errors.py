"""Start-up mistakes as a real operator meets them: one line naming the flag, the
value and the cause, exit status 2, no traceback; and signals obeyed while a
cluster node still waits for etcd."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

LOCK_HINT = "(another elockd? choose another --port)"
METRICS_HINT = "(another elockd? set --metrics-port 0 to turn metrics off)"


def elockd(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the server with ``args`` after free ports, expecting it to give up."""
    return subprocess.run(
        [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def refused(*args: str) -> str:
    """The one line a start-up mistake prints; checks exit 2 and that it is the only
    line (no "elockd starting" record before it)."""
    result = elockd(*args)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[-1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other program listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_lock_port_in_use(busy_port: int) -> None:
    line = refused("--port", str(busy_port))
    assert line == f"elockd: --port {busy_port}: address already in use {LOCK_HINT}"


def test_metrics_port_in_use(busy_port: int) -> None:
    line = refused("--metrics-port", str(busy_port))
    assert line == f"elockd: --metrics-port {busy_port}: address already in use {METRICS_HINT}"


def test_unresolvable_hosts() -> None:
    line = refused("--host", "no-such-host.invalid")
    assert line.startswith("elockd: --host no-such-host.invalid: cannot resolve the address")
    line = refused("--metrics-port", "1", "--metrics-host", "no-such-host.invalid")
    assert line.startswith("elockd: --metrics-host no-such-host.invalid: cannot resolve")


def test_an_address_this_machine_does_not_have() -> None:
    line = refused("--host", "192.0.2.1")  # TEST-NET-1: nobody's address
    assert line == "elockd: --host 192.0.2.1: not an address of this machine"


def test_unix_socket_in_a_missing_directory(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "elockd.sock"
    assert refused("--unix", str(path)) == f"elockd: --unix {path}: no such file or directory"


def test_token_file_missing_or_empty(tmp_path: Path) -> None:
    missing = tmp_path / "token"
    line = refused("--auth-token-file", str(missing))
    assert line == f"elockd: --auth-token-file {missing}: no such file or directory"
    missing.write_text("  \n")
    line = refused("--auth-token-file", str(missing))
    assert line == f"elockd: --auth-token-file {missing}: empty (the token is its content)"


@pytest.mark.parametrize("missing", ["--tls-cert", "--tls-key", "--tls-client-ca"])
def test_each_missing_tls_file_is_named(
    tls_files: dict[str, str], tmp_path: Path, missing: str
) -> None:
    files = {"--tls-cert": tls_files["cert"], "--tls-key": tls_files["key"]}
    files["--tls-client-ca"] = tls_files["ca"]
    files[missing] = str(tmp_path / "gone.pem")
    args = [part for flag, path in files.items() for part in (flag, path)]
    assert refused(*args) == f"elockd: {missing} {tmp_path / 'gone.pem'}: no such file or directory"


def test_tls_files_that_are_not_what_they_should_be(
    tls_files: dict[str, str], tmp_path: Path
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    line = refused("--tls-cert", str(junk))
    assert line == f"elockd: --tls-cert {junk}: needs --tls-key (no private key in this file)"
    line = refused("--tls-cert", tls_files["cert"])  # not "PEM lib" (issue 24, E6)
    assert line.endswith(": needs --tls-key (no private key in this file)")
    line = refused("--tls-cert", str(junk), "--tls-key", tls_files["key"])
    assert line.startswith(f"elockd: --tls-cert {junk} / --tls-key {tls_files['key']}: not a PEM")
    cert, wrong_key = tls_files["cert"], tls_files["client_key"]
    line = refused("--tls-cert", cert, "--tls-key", wrong_key)
    assert line.startswith(f"elockd: --tls-cert {cert} / --tls-key {wrong_key}: not a PEM")
    line = refused("--tls-cert", cert, "--tls-key", tls_files["key"], "--tls-client-ca", str(junk))
    assert line.startswith(f"elockd: --tls-client-ca {junk}: not a PEM CA certificate")


def test_with_json_logs_the_failure_is_json_too(busy_port: int) -> None:
    result = elockd("--port", str(busy_port), "--log-format", "json")
    assert result.returncode == 2
    records = [json.loads(line) for line in result.stderr.splitlines()]
    assert len(records) == 1, "no start record before the failure"
    assert records[-1]["level"] == "error"
    assert records[-1]["event"] == "cannot start"
    assert records[-1]["problem"].startswith(f"--port {busy_port}: address already in use")


# ------------------------------------------------------------ waiting for etcd


def start_waiting_for_etcd(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """A cluster node whose etcd does not answer, once it has said so; and the
    lines it logged up to then."""
    process = subprocess.Popen(
        [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if "etcd endpoint failed" in line:
            return process, lines
    raise AssertionError(f"no etcd failure logged (exit {process.wait()})")


def stop(process: subprocess.Popen[str], signum: signal.Signals) -> tuple[float, str]:
    """Send ``signum``; seconds until the process exited 0, and the rest of its log."""
    try:
        process.send_signal(signum)
        sent = time.monotonic()
        assert process.wait(timeout=10) == 0
        elapsed = time.monotonic() - sent
    finally:
        process.kill()
        process.wait()
    assert process.stderr is not None
    rest = process.stderr.read()
    process.stderr.close()
    return elapsed, rest


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_a_node_still_waiting_for_etcd(signum: signal.Signals) -> None:
    process, _ = start_waiting_for_etcd("--etcd", "http://127.0.0.1:1")
    elapsed, rest = stop(process, signum)
    assert elapsed < 2
    assert f"{signum.name} received" in rest
    assert "Traceback" not in rest


def test_each_failing_endpoint_is_logged_with_url_and_cause_rate_limited() -> None:
    process, lines = start_waiting_for_etcd(
        "--etcd",
        "127.0.0.1:1,no-such-host.invalid:2379",
        "--etcd-timeout",
        "1",
        "--log-format",
        "json",
    )
    # Dozens more attempts on both endpoints (a round every 50 ms), and two start-up
    # steps that gave up after --etcd-timeout.
    time.sleep(3)
    _, rest = stop(process, signal.SIGTERM)
    records = [json.loads(line) for line in [*lines, *rest.splitlines()]]
    failures = [
        (r["endpoint"], r["cause"]) for r in records if r["event"] == "etcd endpoint failed"
    ]
    assert sorted(failures) == [
        ("http://127.0.0.1:1", "connection refused"),
        ("http://no-such-host.invalid:2379", "cannot resolve the host (Name or service not known)"),
    ]
    waits = [r for r in records if r["event"] == "waiting for etcd to start"]
    assert len(waits) == 1
    assert "http://" in waits[0]["cause"]
