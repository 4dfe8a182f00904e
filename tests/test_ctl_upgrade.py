"""``elockctl upgrade`` leaves the new elockd none of its stdio: ``out=$(elockctl
upgrade …)`` and a piped stderr return as soon as the new process serves."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elockd.client import BlockingClient
from tests.support.polling import eventually_blocking
from tests.support.server_process import start_server, stop_server

ELOCKCTL = f"{sys.executable} -m elockd.ctl.main"


@contextlib.contextmanager
def upgraded_server(tmp_path: Path) -> Iterator[tuple[Path, int, list[int]]]:
    """An elockd with a control socket, holding a lock; yields the socket, the port
    and a list the test fills with successor pids (killed at the end)."""
    control = tmp_path / "control.sock"
    process, port = start_server("--control-socket", str(control))
    successors: list[int] = []
    try:
        yield control, port, successors
    finally:
        stop_server(process)
        for pid in successors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def successor_pid(text: str) -> int:
    found = re.search(r"elockd pid (\d+) took over", text)
    assert found is not None, text
    return int(found[1])


def shell(script: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """``script`` under sh, stdout and stderr on pipes (as ``$(…)`` and ``2>&1 |
    tee`` have them), and how long it took to end."""
    started = time.monotonic()
    result = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    return result, time.monotonic() - started


@pytest.mark.serial  # the 5 s bound is wall-clock, and the point of the test
def test_command_substitution_returns_with_a_log_file(tmp_path: Path) -> None:
    log = tmp_path / "elockd.log"
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET")}
    with upgraded_server(tmp_path) as (control, port, successors):
        with BlockingClient(port=port) as holder:
            holder.command("g kept")
            result, took = shell(
                f'out=$({ELOCKCTL} upgrade {control} --log-file {log} -- 2>&1); echo "$out"',
                env,
            )
            successors.append(successor_pid(result.stdout))
            assert result.returncode == 0, result
            assert took < 5, f"$(elockctl upgrade) took {took:.1f} s"
            assert holder.command("i kept") == [b"1 Locked"]
        # The new elockd logs to the file, and only there.
        text = eventually_blocking(
            lambda: "listening on" in log.read_text() and log.read_text(),
            timeout=10,
            interval=0.05,
            what="the new elockd's log in --log-file",
        )
        assert "listening on" in str(text) and "listening on" not in result.stdout


@pytest.mark.serial
def test_without_journal_or_log_file_it_says_the_log_is_discarded(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET")}
    with upgraded_server(tmp_path) as (control, _, successors):
        result, took = shell(f"{ELOCKCTL} upgrade {control} 2>&1 | cat", env)
        successors.append(successor_pid(result.stdout))
        assert took < 5, f"elockctl upgrade | cat took {took:.1f} s"
        if Path("/run/systemd/journal/stdout").exists():  # a systemd host: the journal
            assert "discarded" not in result.stdout
        else:
            assert "the new elockd's log is discarded" in result.stdout
        assert "listening on" not in result.stdout


def test_an_unwritable_log_file_is_a_usage_error(tmp_path: Path) -> None:
    with upgraded_server(tmp_path) as (control, port, _):
        missing = tmp_path / "no" / "such" / "dir" / "elockd.log"
        result = subprocess.run(
            [*ELOCKCTL.split(), "upgrade", str(control), "--log-file", str(missing)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2, result
        assert f"--log-file {missing}: No such file" in result.stderr
        with BlockingClient(port=port) as client:  # the old one serves on
            assert client.command("i k") == [b"0 Not Locked"]
