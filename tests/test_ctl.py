"""``elockctl`` against a real server process.

One-liners run in-process (``main(argv)``, captured output); ``elockctl lock`` runs
as a real process, because signals, exit codes and child processes are the point.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elockd import ctl
from elockd.client import BlockingClient
from tests.server_process import start_server, stop_server


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    process, port = start_server()
    yield port
    stop_server(process)


def run(port: int, *argv: str) -> int:
    return ctl.main(["--port", str(port), *argv])


def elockctl(port: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "elockd.ctl", "--port", str(port), *argv]


def python(code: str, path: Path) -> list[str]:
    """A child command: ``code`` run with ``path`` as its argument."""
    return [sys.executable, "-c", code, str(path)]


def wait_for_file(path: Path, timeout: float = 10) -> str:
    """Poll for a file the child writes when it is ready (a condition, not a nap)."""
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def test_probes_exit_zero_when_the_leading_integer_is_not_zero(
    port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(port, "i", "ctl-probe") == 1
    assert capsys.readouterr().out == "0 Not Locked\n"
    with BlockingClient(port=port) as holder:
        holder.command("g ctl-probe")
        holder.command("sg ctl-shared")
        assert run(port, "i", "ctl-probe") == 0
        assert capsys.readouterr().out == "1 Locked\n"
        assert run(port, "g", "ctl-probe") == 1
        assert capsys.readouterr().out == "0 Cannot Get Lock\n"
        assert run(port, "si", "ctl-shared") == 0
        assert capsys.readouterr().out == "1 Locked\n"
        assert run(port, "sg", "ctl-shared") == 0
        assert capsys.readouterr().out == "2 Got Lock\n"
        assert run(port, "r", "ctl-probe") == 1  # not this connection's
        assert run(port, "g", "ctl", "two", "words") == 0
        capsys.readouterr()
        assert run(port, "q") == 0
        assert "connections: " in capsys.readouterr().out


def test_stats_info_and_dump(port: int, capsys: pytest.CaptureFixture[str]) -> None:
    with BlockingClient(port=port) as holder, holder.lock("ctl-info") as hold:
        assert run(port, "stats") == 0
        table = capsys.readouterr().out.splitlines()
        name, value = table[0].split()  # other tests' connections may still be closing
        assert name == "clients" and int(value) >= 2
        assert run(port, "stats", "--json") == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["clients"] >= 2 and stats["locks"] >= 1
        assert run(port, "info", "ctl-info") == 0
        text = capsys.readouterr().out
        assert f"token: {hold.token}\n" in text and "exclusive: 127.0.0.1:" in text
        assert run(port, "info", "--json", "ctl-info") == 0
        details = json.loads(capsys.readouterr().out)
        assert details["token"] == hold.token and details["ttl"] is None
        assert run(port, "dump") == 0
        assert "ctl-info: 127.0.0.1:" in capsys.readouterr().out
        holder.command("sg ctl-dump-shared")
        assert run(port, "dump", "--shared") == 0
        assert "ctl-dump-shared: 127.0.0.1:" in capsys.readouterr().out


def test_a_reader_that_leaves_early_gets_a_quiet_exit(port: int) -> None:
    """``elockctl stats | head -1``: the pipe breaks; exit 1 without a message."""
    reader, writer = os.pipe()
    os.close(reader)  # the reader has already left
    try:
        result = subprocess.run(
            [*elockctl(port, "stats")], stdout=writer, stderr=subprocess.PIPE, timeout=30
        )
    finally:
        os.close(writer)
    assert (result.returncode, result.stderr) == (1, b"")


def test_unreachable_server_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["--port", "1", "--connect-timeout", "1", "i", "k"]) == ctl.EXIT_ERROR
    assert "cannot connect" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", ["g", "r", "i", "sg", "sr", "si", "q", "stats", "info", "dump", "lock"]
)
def test_help_on_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        ctl.main([command, "--help"])
    assert exited.value.code == 0
    assert f"usage: elockctl {command}" in capsys.readouterr().out


def test_lock_passes_the_exit_status_through(port: int) -> None:
    def status(*argv: str) -> int:
        return subprocess.run(elockctl(port, "lock", *argv), timeout=20).returncode

    assert status("ctl-exit", "--", sys.executable, "-c", "raise SystemExit(7)") == 7
    assert status("ctl-exit", "--", "true") == 0
    assert status("ctl-exit", "--", "sh", "-c", "kill -TERM $$") == 128 + signal.SIGTERM
    assert status("ctl-exit", "--", "/nonexistent/command") == 127
    with BlockingClient(port=port) as holder, holder.lock("ctl-exit"):
        assert status("ctl-exit", "--", "true") == 1
        assert status("ctl-exit", "-E", "9", "--", "true") == 9
        assert status("--shared", "ctl-exit", "--", "true") == 0  # another table
    with BlockingClient(port=port) as holder, holder.shared("ctl-api"):
        assert status("ctl-api", "--shared", "--limit", "1", "--", "true") == 1
        assert status("ctl-api", "--shared", "--limit", "2", "--", "true") == 0


def test_concurrent_runs_never_overlap(port: int, tmp_path: Path) -> None:
    log = tmp_path / "log"
    child = (
        "import sys, time\n"
        "with open(sys.argv[1], 'a') as f: f.write(f'start {time.time()}\\n')\n"
        "time.sleep(0.3)\n"
        "with open(sys.argv[1], 'a') as f: f.write(f'end {time.time()}\\n')\n"
    )
    runs = [
        subprocess.Popen(
            [*elockctl(port, "lock", "ctl-serial", "--wait", "30", "--"), *python(child, log)]
        )
        for _ in range(3)
    ]
    assert [process.wait(timeout=30) for process in runs] == [0, 0, 0]
    events = [line.split() for line in log.read_text().splitlines()]
    assert [kind for kind, _ in events] == ["start", "end"] * 3, "two runs overlapped"
    times = [float(stamp) for _, stamp in events]
    assert times == sorted(times)


CHILD_WITH_HANDLER = """\
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def on_term(signum, frame):
    out.with_suffix(".signal").write_text(signal.Signals(signum).name)
    raise SystemExit(42)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_term)
out.write_text("ready")
time.sleep(60)
"""


def test_signals_are_forwarded_to_the_command(port: int, tmp_path: Path) -> None:
    ready = tmp_path / "child.ready"
    process = subprocess.Popen(
        [*elockctl(port, "lock", "ctl-signal", "--"), *python(CHILD_WITH_HANDLER, ready)]
    )
    wait_for_file(ready)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=10) == 42
    assert (tmp_path / "child.signal").read_text() == "SIGUSR1"
    with BlockingClient(port=port) as client:
        assert not client.info("ctl-signal").locked


CHILD_COUNTING_SIGINT = """\
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
seen = []
signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
out.write_text("ready")
while not seen:
    time.sleep(0.01)
time.sleep(1)  # room for a second SIGINT, if one comes
sys.exit(40 + len(seen))
"""


def test_sigint_is_forwarded_outside_a_terminal(port: int, tmp_path: Path) -> None:
    """cron, scripts, ``kill -INT``: only elockctl gets the signal, so it passes it on.
    (A new session has no terminal, whatever the one running the tests is.)"""
    ready = tmp_path / "child.ready"
    process = subprocess.Popen(
        [*elockctl(port, "lock", "ctl-int", "--"), *python(CHILD_COUNTING_SIGINT, ready)],
        start_new_session=True,
    )
    wait_for_file(ready)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) == 41  # the command saw SIGINT once
    with BlockingClient(port=port) as client:
        assert not client.info("ctl-int").locked


# Make the pty on stdin the controlling terminal of a new session, then run Python.
ATTACH_TTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_ctrl_c_on_a_terminal_reaches_the_command_once(port: int, tmp_path: Path) -> None:
    """The terminal sends Ctrl-C to the whole foreground group, COMMAND included:
    elockctl must not forward it as well."""
    master, slave = pty.openpty()
    ready = tmp_path / "child.ready"
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                ATTACH_TTY,
                *elockctl(port, "lock", "ctl-tty", "--")[1:],
                *python(CHILD_COUNTING_SIGINT, ready),
            ],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        slave = -1
        wait_for_file(ready)
        os.write(master, b"\x03")  # Ctrl-C
        assert process.wait(timeout=10) == 41, "the command did not see SIGINT exactly once"
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    with BlockingClient(port=port) as client:
        assert not client.info("ctl-tty").locked


def test_only_terminal_signals_in_the_foreground_are_not_forwarded() -> None:
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        assert ctl.should_forward(signum, lambda: True)
        assert ctl.should_forward(signum, lambda: False)
    for signum in (signal.SIGINT, signal.SIGQUIT):
        assert not ctl.should_forward(signum, lambda: True)
        assert ctl.should_forward(signum, lambda: False)
    asked: list[bool] = []
    assert ctl.should_forward(signal.SIGTERM, lambda: asked.append(True) or True)
    assert asked == [], "the terminal is asked about INT and QUIT only"


def test_in_terminal_foreground(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tty = tmp_path / "tty"
    tty.write_text("")
    monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp())
    assert ctl.in_terminal_foreground(str(tty))
    monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp() + 1)
    assert not ctl.in_terminal_foreground(str(tty))  # a background job

    def not_a_tty(fd: int) -> int:
        raise OSError(errno.ENOTTY, "not a tty")

    monkeypatch.setattr(os, "tcgetpgrp", not_a_tty)
    assert not ctl.in_terminal_foreground(str(tty))
    # No controlling terminal: standard input is asked instead, if there is one.
    missing = str(tmp_path / "missing")
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # fileno() raises
    assert not ctl.in_terminal_foreground(missing)
    monkeypatch.setattr(sys, "stdin", None)
    assert not ctl.in_terminal_foreground(missing)
    with open(tty) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp() if fd == stdin.fileno() else 0)
        assert ctl.in_terminal_foreground(missing)


def test_the_command_is_terminated_when_the_lock_is_lost(tmp_path: Path) -> None:
    server, port = start_server()
    try:
        ready = tmp_path / "child.ready"
        process = subprocess.Popen(
            [*elockctl(port, "lock", "ctl-lost", "--"), *python(CHILD_WITH_HANDLER, ready)],
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for_file(ready)
        server.kill()
        _, err = process.communicate(timeout=10)
        assert process.returncode == ctl.EXIT_LOST
        assert (tmp_path / "child.signal").read_text() == "SIGTERM"
        assert "lock lost" in err
    finally:
        stop_server(server)


def test_tls_and_auth_options(tls_files: dict[str, str]) -> None:
    paths = tls_files
    server, port = start_server(
        "--tls-cert",
        paths["cert"],
        "--tls-key",
        paths["key"],
        "--tls-client-ca",
        paths["ca"],
        "--auth-token-file",
        paths["token"],
    )
    tls = [
        "--tls-ca",
        paths["ca"],
        "--tls-cert",
        paths["client_cert"],
        "--tls-key",
        paths["client_key"],
    ]
    try:
        assert run(port, *tls, "--auth-token-file", paths["token"], "g", "k") == 0
        assert run(port, *tls, "g", "k") == 1  # 0 Auth Required
        assert run(port, "--tls-ca", paths["ca"], "i", "k") == ctl.EXIT_ERROR  # no client cert
        argv = elockctl(port, *tls, "--auth-token-file", paths["token"], "lock", "k", "--")
        assert subprocess.run([*argv, "true"], timeout=20).returncode == 0
    finally:
        stop_server(server)
