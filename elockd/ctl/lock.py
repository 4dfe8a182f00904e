"""``elockctl lock KEY COMMAND``: hold a lock for exactly as long as COMMAND runs.

It uses the trio client, because it has to do four things at once: keep the lock
(and renew its lease), wait for COMMAND, forward signals to it, and end it if the
lock is lost.
"""

from __future__ import annotations

import argparse
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
from elockd.ctl.signals import (
    FORWARDED_SIGNALS,
    cannot_start,
    in_terminal_foreground,
    shell_status,
    should_forward,
)
from elockd.ctl.status import EXIT_LOST, failure, say, where


def run_lock(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``elockctl lock``: :func:`run_locked` in a trio run of its own."""
    return trio.run(run_locked, args, options)


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
        except OSError as error:
            return cannot_start(argv, error)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward_signals, signals, process.send_signal)
            nursery.start_soon(end_when_lost, lost, process, kill_after)
            await process.wait()
            nursery.cancel_scope.cancel()
    code = process.returncode
    assert code is not None
    return shell_status(code)


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


async def end_when_lost(lost: trio.Event, process: trio.Process, kill_after: float) -> None:
    await lost.wait()
    say("lock lost: terminating the command")
    process.terminate()
    with trio.move_on_after(kill_after):
        await process.wait()
        return
    say(f"the command did not end within {kill_after:g} s: killing it")
    process.kill()
