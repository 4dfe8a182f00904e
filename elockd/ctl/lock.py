"""``elockctl lock KEY COMMAND``: hold a lock for exactly as long as COMMAND runs.

It uses the trio client, because it has to do four things at once: keep the lock
(and renew its lease), wait for COMMAND, forward signals to it, and end it if the
lock is lost.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from elockd.client import (
    Client,
    ConnectionLost,
    ElockError,
    Hold,
    LockLost,
    ProtocolError,
    Unavailable,
)
from elockd.ctl import rwlock as ctl_rwlock
from elockd.ctl.doors import hint
from elockd.ctl.status import EXIT_LOST, failure, say, where

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


async def run_locked(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Hold the lock for exactly as long as COMMAND runs; see LOCK_EPILOG."""
    lost = trio.Event()

    def on_lost(hold: Hold) -> None:
        lost.set()

    started = time.monotonic()
    async with Client(**options) as client:
        try:
            hold = await ctl_rwlock.take(client, args, options, on_lost)
        except Unavailable:
            # Silent, as flock: a guard that skips a run because another runs is
            # no error to mail home from cron. --verbose says it in flock's words.
            if args.verbose:
                say("timeout while waiting to get lock" if args.wait else "failed to get lock")
            return int(args.conflict_exit_code)
        except ElockError as error:  # said here, not from inside a nursery's group
            status, message = failure(error, where(options))
            if isinstance(error, ConnectionLost) and not isinstance(error, ProtocolError):
                message += ", before the lock was granted"
            say(message + hint(error, options, bool(args.tls_cert)))
            return status
        if args.verbose:  # on stdout, as flock prints these
            print(f"elockctl: getting lock took {time.monotonic() - started:.6f} seconds")
            print(f"elockctl: executing {args.argv[0]}", flush=True)
        status = await run_command(args.argv, lost, args.kill_after)
        try:
            await client.release(hold)
        except LockLost as error:
            say(f"{error}")
            return EXIT_LOST
        if lost.is_set():
            return EXIT_LOST
        return status


async def run_command(argv: list[str], lost: trio.Event, kill_after: float) -> int:
    """Run COMMAND to its end, forwarding signals; end it if ``lost`` is set."""
    with trio.open_signal_receiver(*FORWARDED_SIGNALS) as signals:
        try:
            process = await trio.lowlevel.open_process(argv)
        except FileNotFoundError as error:
            say(f"{argv[0]}: {error.strerror}")
            return 127
        except OSError as error:
            say(f"{argv[0]}: {error.strerror}")
            return 126
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward_signals, signals, process.send_signal)
            nursery.start_soon(end_when_lost, lost, process, kill_after)
            await process.wait()
            nursery.cancel_scope.cancel()
    code = process.returncode
    assert code is not None
    return 128 - code if code < 0 else code


async def forward_signals(
    signals: AsyncIterator[int],
    send: Callable[[int], None],
    in_foreground: Callable[[], bool] | None = None,
) -> None:
    """Pass each signal on to COMMAND, unless the terminal delivered it already.

    The foreground test runs per signal, because it can change while COMMAND runs
    (``Ctrl-Z`` and ``bg``, for one).
    """
    foreground = in_terminal_foreground if in_foreground is None else in_foreground
    async for signum in signals:
        if not should_forward(signum, foreground):
            continue
        try:
            send(signum)
        except ProcessLookupError:
            return


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


async def end_when_lost(lost: trio.Event, process: trio.Process, kill_after: float) -> None:
    await lost.wait()
    say("lock lost: terminating the command")
    process.terminate()
    with trio.move_on_after(kill_after):
        await process.wait()
        return
    say(f"the command did not end within {kill_after:g} s: killing it")
    process.kill()
