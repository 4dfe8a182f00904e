"""``elockctl upgrade PATH -- [ELOCKD FLAGS]``: hand a running elockd over to a new one.

It starts ``elockd --take-over PATH FLAGS`` (whatever ``elockd`` is on the PATH next
to elockctl: the new version after an install), detached so that it outlives this
command, and waits for the outcome:

* the new process says it serves (``READY=1`` on a notify socket of our own, the
  systemd protocol): exit 0;
* it exits first (refused, or the old one aborted): its status is reported and the
  old process serves on: exit 3.

Under systemd (``ExecReload=``) ``$NOTIFY_SOCKET`` is set: the new process's
``MAINPID=``/``READY=1`` message is passed on to it, so systemd follows the new main
process (docs/upgrade.md).

The new process keeps none of this command's stdio: whoever ran ``out=$(elockctl
upgrade …)`` or piped its stderr would otherwise wait for as long as the new
elockd lives. Its log goes to ``--log-file``, else to the journal (the stream
systemd gave this command, or a new one through ``systemd-cat``), else nowhere,
and elockctl says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from elockd.ctl.status import EXIT_ERROR, EXIT_USAGE, say
from elockd.systemd import send_notification


def elockd_command() -> list[str]:
    """The elockd beside this elockctl (the same install), else this interpreter's."""
    beside = Path(sys.argv[0]).resolve().with_name("elockd")
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which("elockd")
    return [found] if found else [sys.executable, "-m", "elockd"]


def run_upgrade(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``elockctl upgrade`` (``options``, the lock port's, are not used: it speaks to
    the control socket)."""
    control: str = args.control
    if not Path(control).exists():
        say(f"upgrade: {control}: no control socket (start elockd with --control-socket)")
        return EXIT_ERROR
    if args.log_file is not None:
        try:
            with open(args.log_file, "ab"):
                pass
        except OSError as error:
            say(f"upgrade: --log-file {args.log_file}: {error.strerror}")
            return EXIT_USAGE
    upstream = os.environ.get("NOTIFY_SOCKET")
    with tempfile.TemporaryDirectory(prefix="elockctl-") as scratch:
        notify_path = str(Path(scratch) / "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(notify_path)
            env = {**os.environ, "NOTIFY_SOCKET": notify_path}
            command = [*elockd_command(), "--take-over", control, *args.argv]
            with log_destination(args.log_file) as (log, wrapper):
                process = subprocess.Popen(
                    [*wrapper, *command],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            message = _wait_ready(notify, process, args.wait)
    if message is None:
        status = process.poll()
        if status is None:
            process.kill()
            say(f"upgrade: the new elockd did not serve within {args.wait:g} s; stopped it")
        else:
            say(f"upgrade: the new elockd exited with status {status}; the old one serves on")
        return EXIT_ERROR
    if upstream:
        _forward(upstream, message)
    print(f"elockd pid {process.pid} took over from {control}")
    return 0


@contextmanager
def log_destination(path: str | None) -> Iterator[tuple[int | IO[bytes], list[str]]]:
    """Where the new elockd's stdout and stderr go, and a command to run it under.

    Never this command's own stdio, unless it is the journal's stream: that one is
    nobody's pipe to wait on (systemd gave it to ``ExecReload=``), and the log of the
    new main process belongs there as the old one's did.
    """
    if path is not None:
        with open(path, "ab") as file:  # a usage error if it fails: see run_upgrade
            yield file, []
        return
    if stderr_is_the_journal():
        yield sys.stderr.fileno(), []
        return
    cat = shutil.which("systemd-cat")
    if cat is not None and Path("/run/systemd/journal/stdout").exists():
        yield subprocess.DEVNULL, [cat, "--identifier=elockd", "--"]
        return
    say("upgrade: no --log-file and no journal here: the new elockd's log is discarded")
    yield subprocess.DEVNULL, []


def stderr_is_the_journal() -> bool:
    """``$JOURNAL_STREAM`` (``DEV:INODE``) names our stderr: systemd connected it."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        status = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return stream == f"{status.st_dev}:{status.st_ino}"


def _wait_ready(
    notify: socket.socket, process: subprocess.Popen[bytes], wait: float
) -> bytes | None:
    """The notify message that says READY=1, or None if the process exited first."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        notify.settimeout(0.1)
        try:
            message = notify.recv(4096)
        except TimeoutError:
            if process.poll() is not None:
                return None
            continue
        if b"READY=1" in message.split(b"\n"):
            return message
    return None


def _forward(address: str, message: bytes) -> None:
    if not send_notification(address, message):
        say(f"upgrade: could not tell systemd ($NOTIFY_SOCKET {address})")
