"""The signals elockctl passes on to the COMMAND it runs, and a blocking run of it.

``elockctl lock`` runs COMMAND under trio (:mod:`elockd.ctl.lock`), since it also
keeps a lease; ``elockctl throttle`` has nothing to keep once admitted and runs it
here, without trio (:func:`run_forwarding`). Both pass signals on alike: the rule
is :func:`should_forward`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType

from elockd.ctl.status import say

#: Signals elockctl catches while COMMAND runs (so that they do not end it and its
#: lock first) and passes on to COMMAND, except as :func:`should_forward` says.
FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)
#: Signals a terminal's Ctrl-C / Ctrl-\ sends to its whole foreground process group,
#: COMMAND included: passing them on as well would deliver them twice.
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT})


def should_forward(signum: int, in_foreground: Callable[[], bool]) -> bool:
    """Whether elockctl passes ``signum`` on to COMMAND.

    A terminal sends Ctrl-C's SIGINT and Ctrl-\\'s SIGQUIT to every process of its
    foreground process group, and COMMAND is in elockctl's group: when that group
    is in the foreground, COMMAND has had the signal already. Otherwise (cron,
    scripts, ``kill -INT PID``) only elockctl got it, and COMMAND must get it too.
    Every other signal is always passed on: TERM, HUP and USR1/2 are aimed at
    elockctl alone, and a doubled WINCH only makes COMMAND re-read the window size.
    """
    return signum not in TERMINAL_SIGNALS or not in_foreground()


def in_terminal_foreground(tty: str = "/dev/tty") -> bool:
    """True when elockctl's process group is the foreground group of its terminal
    (the controlling terminal ``tty``, else standard input); False without one.
    """
    try:
        fd = os.open(tty, os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        fd = None
    try:
        if fd is None:
            if sys.stdin is None:
                return False
            fd_to_ask = sys.stdin.fileno()
        else:
            fd_to_ask = fd
        return os.tcgetpgrp(fd_to_ask) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        # No terminal (ENOTTY, ENXIO), or stdin closed or replaced: no terminal can
        # have sent COMMAND the signal as well.
        return False
    finally:
        if fd is not None:
            os.close(fd)


def run_forwarding(argv: list[str]) -> int:
    """Run COMMAND to its end, passing signals on as :func:`should_forward` says;
    its exit status, ``128 + N`` when signal N ended it (as a shell reports it),
    127 when it is not found and 126 when it cannot be run.

    The handlers are in place before COMMAND starts, so that no signal can meet
    elockctl's default action (its end, COMMAND left running) in between: one that
    comes before COMMAND exists is passed on as soon as it does."""
    started: list[subprocess.Popen[bytes]] = []
    early: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if not should_forward(signum, in_terminal_foreground):
            return
        if not started:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            started[0].send_signal(signum)

    # Handlers can be set from the main thread only; elsewhere (an embedding
    # program's thread) the signals stay as they were.
    in_main = threading.current_thread() is threading.main_thread()
    before: dict[signal.Signals, Callable[[int, FrameType | None], object] | int | None] = {}
    try:
        if in_main:
            for caught in FORWARDED_SIGNALS:
                before[caught] = signal.signal(caught, forward)
        try:
            started.append(subprocess.Popen(argv))
        except OSError as error:
            return cannot_start(argv, error)
        for signum in early:
            with contextlib.suppress(ProcessLookupError):
                started[0].send_signal(signum)
        code = started[0].wait()
    finally:
        for caught, handler in before.items():
            signal.signal(caught, handler)
    return shell_status(code)


def cannot_start(argv: list[str], error: OSError) -> int:
    """COMMAND could not be started: said in one line; 127 when it is not found,
    126 when it cannot be run, as a shell says."""
    say(f"{argv[0]}: {error.strerror}")
    return 127 if isinstance(error, FileNotFoundError) else 126


def shell_status(code: int) -> int:
    """A child's return code as a shell reports it: ``128 + N`` for signal N."""
    return 128 - code if code < 0 else code
