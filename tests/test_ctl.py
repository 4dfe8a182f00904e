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
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from elockd.client import BlockingClient
from elockd.ctl import args as ctl_args
from elockd.ctl import main as ctl
from elockd.ctl import signals as ctl_signals
from elockd.ctl.status import EXIT_ERROR, EXIT_FALSE, EXIT_LOST, EXIT_USAGE
from tests.support.foreign_service import foreign_service, quorumless_answer
from tests.support.polling import eventually_blocking
from tests.support.server_process import start_server, stop_server


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
    """The text of a file the child writes when it is ready, once it has some."""
    text = eventually_blocking(
        lambda: path.exists() and path.read_text(),
        timeout=timeout,
        interval=0.02,
        what=f"{path} written",
    )
    return str(text)


def until_waiting_on(
    holder: BlockingClient, key: str, process: subprocess.Popen[str] | subprocess.Popen[bytes]
) -> None:
    """Until ``process``, an elockctl that must still run, waits for ``key`` on the server."""

    def waits() -> bool:
        assert process.poll() is None, process.communicate()
        return holder.info(key).waiting >= 1

    eventually_blocking(waits, timeout=20, interval=0.02, what=f"elockctl waiting for {key}")


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
    assert ctl.main(["--port", "1", "--connect-timeout", "1", "i", "k"]) == EXIT_ERROR
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
        # Readers and a writer exclude each other, as flock -s and -x do.
        assert status("--shared", "ctl-exit", "--", "true") == 1
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
        assert ctl_signals.should_forward(signum, lambda: True)
        assert ctl_signals.should_forward(signum, lambda: False)
    for signum in (signal.SIGINT, signal.SIGQUIT):
        assert not ctl_signals.should_forward(signum, lambda: True)
        assert ctl_signals.should_forward(signum, lambda: False)
    asked: list[bool] = []
    assert ctl_signals.should_forward(signal.SIGTERM, lambda: asked.append(True) or True)
    assert asked == [], "the terminal is asked about INT and QUIT only"


def test_in_terminal_foreground(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tty = tmp_path / "tty"
    tty.write_text("")
    monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp())
    assert ctl_signals.in_terminal_foreground(str(tty))
    monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp() + 1)
    assert not ctl_signals.in_terminal_foreground(str(tty))  # a background job

    def not_a_tty(fd: int) -> int:
        raise OSError(errno.ENOTTY, "not a tty")

    monkeypatch.setattr(os, "tcgetpgrp", not_a_tty)
    assert not ctl_signals.in_terminal_foreground(str(tty))
    # No controlling terminal: standard input is asked instead, if there is one.
    missing = str(tmp_path / "missing")
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # fileno() raises
    assert not ctl_signals.in_terminal_foreground(missing)
    monkeypatch.setattr(sys, "stdin", None)
    assert not ctl_signals.in_terminal_foreground(missing)
    with open(tty) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp() if fd == stdin.fileno() else 0)
        assert ctl_signals.in_terminal_foreground(missing)


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
        assert process.returncode == EXIT_LOST
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
        assert run(port, *tls, "g", "k") == EXIT_ERROR  # 0 Auth Required: cannot tell
        assert run(port, "--tls-ca", paths["ca"], "i", "k") == EXIT_ERROR  # no client cert
        argv = elockctl(port, *tls, "--auth-token-file", paths["token"], "lock", "k", "--")
        assert subprocess.run([*argv, "true"], timeout=20).returncode == 0
    finally:
        stop_server(server)


# ---------------------------------------------------------------- honest exit codes


def ctl_process(port: int, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """elockctl as a shell sees it: exit status, stdout, stderr."""
    return subprocess.run(elockctl(port, *argv), capture_output=True, text=True, timeout=timeout)


def one_line(stderr: str) -> str:
    """The single line a failure may print: never a traceback, never two lines."""
    assert "Traceback" not in stderr and "Error:" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["i", "k"],
        ["si", "k"],
        ["g", "k"],
        ["q"],
        ["stats"],
        ["info", "k"],
        ["dump"],
        ["lock", "k", "--", "true"],
        ["lock", "k", "-c", "true"],
    ],
)
def test_a_missing_token_is_could_not_tell(token_server: tuple[int, Path], argv: list[str]) -> None:
    """``0 Auth Required`` starts with a 0, but it is no "not locked": a cron guard
    ``elockctl i job || run-job`` must not run the job because of it."""
    port, _ = token_server
    result = ctl_process(port, *argv)
    assert result.returncode == EXIT_ERROR, result
    assert result.stdout == ""
    line = one_line(result.stderr)
    assert f"127.0.0.1:{port}" in line and "Auth Required" in line and "--auth-token-file" in line


def test_a_refused_token_is_could_not_tell(token_server: tuple[int, Path], tmp_path: Path) -> None:
    port, token = token_server
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    for argv in (["i", "k"], ["lock", "k", "--", "true"]):
        result = ctl_process(port, "--auth-token-file", str(wrong), *argv)
        assert result.returncode == EXIT_ERROR, result
        assert "403 Bad Token" in one_line(result.stderr)
    good = ctl_process(port, "--auth-token-file", str(token), "i", "k")
    assert (good.returncode, good.stdout) == (1, "0 Not Locked\n")  # a real "no"


@pytest.mark.parametrize(
    "argv", [["i", "k"], ["g", "k"], ["q"], ["stats"], ["dump"], ["lock", "k", "--", "true"]]
)
def test_a_foreign_service_is_could_not_tell(argv: list[str]) -> None:
    """A wrong port where sshd listens: its banner is no reply. The connection stays
    open, so only reading the banner for what it is ends this before --timeout."""
    with foreign_service() as port:
        result = ctl_process(port, "--timeout", "600", *argv, timeout=60)
    assert result.returncode == EXIT_ERROR, result
    line = one_line(result.stderr)
    assert f"127.0.0.1:{port}" in line and "not an elockd reply: 'SSH-2.0-OpenSSH" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["i", "k"],
        ["g", "k"],
        ["si", "k"],
        ["q"],
        ["stats"],
        ["info", "k"],
        ["dump"],
        ["lock", "k", "true"],
        ["lock", "k", "-w", "5", "true"],
        ["lock", "-s", "k", "true"],
        ["lock", "-s", "--limit", "2", "k", "true"],
    ],
)
def test_backend_unavailable_is_could_not_tell(argv: list[str], tmp_path: Path) -> None:
    """A cluster node without etcd quorum: ``409 Backend Unavailable`` (word verbs)
    and ``0 Backend Unavailable`` (terse) say nothing about the key. A cron guard
    must see 3, not the 1 of a busy lock, and COMMAND must not run."""
    ran = tmp_path / "ran"
    argv = [word if word != "true" else f"touch {ran}" for word in argv]
    if argv[0] == "lock":
        argv = [*argv[:-1], "-c", argv[-1]]
    with foreign_service(b"", quorumless_answer) as port:
        result = ctl_process(port, *argv)
    assert result.returncode == EXIT_ERROR, result
    assert result.stdout == "" and not ran.exists()
    line = one_line(result.stderr)
    assert f"127.0.0.1:{port}" in line and "Backend Unavailable" in line


def test_a_key_with_a_blank_is_a_usage_error(port: int) -> None:
    for argv in (["lock", "a b", "--", "true"], ["info", "a b"], ["lock", "", "-c", "true"]):
        result = ctl_process(port, *argv)
        assert result.returncode == EXIT_USAGE, result
        line = one_line(result.stderr)
        assert "cannot be sent" in line and "b'a" not in line
    assert "key 'a b' cannot be sent" in ctl_process(port, "lock", "a b", "--", "true").stderr
    # The terse probes take keys with blanks (the rest of the line is the key).
    assert ctl_process(port, "i", "a b").returncode == EXIT_FALSE


def test_lock_exits_3_when_the_server_stops_while_it_waits() -> None:
    server, port = start_server()
    try:
        with BlockingClient(port=port) as holder:
            holder.command("g ctl-stopping")
            waiting = subprocess.Popen(
                elockctl(port, "lock", "ctl-stopping", "-w", "60", "--", "true"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            until_waiting_on(holder, "ctl-stopping", waiting)
            server.kill()
            server.wait()
            _, err = waiting.communicate(timeout=20)
    finally:
        stop_server(server)
    assert waiting.returncode == EXIT_ERROR, err
    line = one_line(err)
    assert f"127.0.0.1:{port}" in line and "before the lock was granted" in line


def test_a_missing_token_file_is_a_usage_error_naming_it(port: int, tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = ctl_process(port, "--auth-token-file", str(missing), "i", "k")
    assert result.returncode == EXIT_USAGE
    assert f"--auth-token-file {missing}: No such file" in one_line(result.stderr)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    result = ctl_process(port, "--auth-token-file", str(empty), "i", "k")
    assert result.returncode == EXIT_USAGE and "not empty" in one_line(result.stderr)


# ---------------------------------------------------------------- flock's options


def test_nonblock_fails_at_once_when_held(port: int) -> None:
    with BlockingClient(port=port) as holder, holder.lock("ctl-nb"):
        result = ctl_process(port, "lock", "-n", "ctl-nb", "--", "true")
        assert result.returncode == 1
        assert result.stderr == ""  # silent, as flock: a skipped run is no error
        verbose = ctl_process(port, "lock", "-n", "--verbose", "ctl-nb", "--", "true")
        assert (verbose.returncode, verbose.stderr) == (1, "elockctl: failed to get lock\n")
        assert ctl_process(port, "lock", "-n", "-E", "9", "ctl-nb", "-c", "true").returncode == 9
    assert ctl_process(port, "lock", "-n", "ctl-nb", "--", "true").returncode == 0


def test_wait_gives_up_with_the_conflict_code_or_gets_the_lock(port: int, tmp_path: Path) -> None:
    with BlockingClient(port=port) as holder:
        hold = holder.acquire("ctl-w")
        assert ctl_process(port, "lock", "-w", "0.2", "ctl-w", "--", "true").returncode == 1
        assert ctl_process(port, "lock", "ctl-w", "-w", "0.2", "-E", "5", "-c", ":").returncode == 5
        done = tmp_path / "done"
        waiting = subprocess.Popen(
            elockctl(port, "lock", "-w", "30", "ctl-w", "-c", f"echo ran > {done}")
        )
        until_waiting_on(holder, "ctl-w", waiting)
        assert not done.exists()  # it waits for the lock before running
        holder.release(hold)
        assert waiting.wait(timeout=30) == 0
    assert done.read_text() == "ran\n"


def test_command_runs_through_the_shell(port: int, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = ctl_process(port, "lock", "ctl-c", "-c", f'echo "$((6 * 7))" > {out}; exit 7')
    assert result.returncode == 7
    assert out.read_text() == "42\n"
    assert ctl_process(port, "lock", "-s", "ctl-c", "-c", "exit 0").returncode == 0


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["lock", "k", "-c", "true", "--", "true"], "not both"),
        (["lock", "k", "-n", "-w", "3", "--", "true"], "not allowed with"),
        (["lock", "k"], "missing COMMAND"),
        (["lock", "k", "--wait", "abc", "--", "true"], "--wait: 'abc' is not a number of seconds"),
        (["lock", "k", "--limit", "0", "-s", "--", "true"], "--limit: '0' is not a whole number"),
        (["lock", "k", "-E", "300", "--", "true"], "'300' is not an exit status"),
        (["--port", "99999", "i", "k"], "--port: '99999' is not a port number"),
        (["--timeout", "-1", "i", "k"], "--timeout: '-1' is not a number of seconds"),
        (["--tls-ca", "/nonexistent/ca.pem", "i", "k"], "--tls-ca /nonexistent/ca.pem: No such"),
        (["--tls-key", "/nonexistent/key.pem", "i", "k"], "--tls-key needs --tls-cert"),
        (["i", "a\nb"], "a key cannot hold a line end"),
    ],
)
def test_usage_errors_are_one_line_in_words(argv: list[str], complaint: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elockd.ctl", *argv], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == EXIT_USAGE
    line = one_line(result.stderr)
    assert complaint in line
    for internal in ("invalid", "_float", "_int", "positive_", "non_negative"):
        assert internal not in line


def test_g_and_sg_say_the_hold_ended_with_the_connection(port: int) -> None:
    for verb in ("g", "sg"):
        result = ctl_process(port, verb, "ctl-oneshot")
        assert result.returncode == 0 and result.stdout.endswith("Got Lock\n")
        assert "ended with this command's connection" in one_line(result.stderr)
    with BlockingClient(port=port) as client:
        assert not client.info("ctl-oneshot").locked  # it did end
    probe = ctl_process(port, "i", "ctl-oneshot")
    assert (probe.returncode, probe.stderr) == (1, "")
    with BlockingClient(port=port) as holder:
        holder.command("g ctl-oneshot")
        refused = ctl_process(port, "g", "ctl-oneshot")
        assert (refused.returncode, refused.stderr) == (1, "")  # nothing held, nothing said


# ---------------------------------------------------------------- humane help


def all_parsers() -> list[ctl_args.Parser]:
    parser = ctl_args.build_parser()
    return [parser, *parser.commands.values()]


def test_every_option_has_help_and_no_default_reads_none() -> None:
    for parser in all_parsers():
        for action in parser._actions:
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest}"
        text = parser.format_help()
        assert "default: None" not in text and "(default: False)" not in text, parser.prog


def test_the_lock_epilog_documents_every_exit_status() -> None:
    text = ctl_args.build_parser().commands["lock"].format_help()
    for status in ("COMMAND's own", "128+N", "1 ", "2 ", "3 ", "75", "126", "127"):
        assert status in text, status
    for option in ("-w", "-n", "-c", "-E", "-s"):
        assert option in text


def test_version_comes_from_the_package() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elockd.ctl", "--version"], capture_output=True, text=True
    )
    assert (result.returncode, result.stdout) == (0, f"elockctl {metadata.version('elockd')}\n")


def test_every_command_of_its_own_names_a_runner_that_exists() -> None:
    """The runners are looked up by name when their command runs: a wrong name would
    show only then."""
    for command in ctl.RUNNERS:
        assert callable(ctl.runner_of(command)), command
