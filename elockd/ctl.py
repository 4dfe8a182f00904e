"""``elockctl``: probes, stats and ``elockctl lock KEY -- COMMAND`` from the shell.

One-liners (``g r i sg sr si q``, ``stats``, ``info``, ``dump``) use the blocking
client: a connection, one request, done. ``lock`` uses the trio client, because it
has to do four things at once: keep the lock (and renew its lease), wait for the
command, forward signals to it, and kill it if the lock is lost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import trio

from elockd.client import BlockingClient, Client, ElockError, Hold, Unavailable, tls_context
from elockd.client.errors import LockLost

EXIT_FALSE = 1  # a probe's leading integer was 0
EXIT_USAGE = 2  # argparse's own
EXIT_ERROR = 3  # the server could not be reached or refused the request
EXIT_LOST = 75  # EX_TEMPFAIL: the lock was lost while COMMAND ran
PROBE_VERBS = ("g", "r", "i", "sg", "sr", "si")
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

LOCK_EPILOG = """\
exit status: COMMAND's own (128+N if a signal N killed it); the --conflict-exit-code
(default 1) when the lock was not granted within --wait; 75 when the lock was lost
while COMMAND ran (COMMAND is then sent SIGTERM, and SIGKILL after --kill-after
seconds); 3 when the server cannot be reached; 126/127 when COMMAND cannot run.
Signals (INT TERM HUP QUIT USR1 USR2 WINCH) are forwarded to COMMAND, except INT
and QUIT while elockctl runs in a terminal's foreground: Ctrl-C and Ctrl-\\ reach
COMMAND from the terminal already.
"""


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError("must be a number above 0")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError("must be a number, 0 or more")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elockctl",
        description="Talk to an elockd server: probes, stats, and run a command under a lock.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--host", default=os.environ.get("ELOCKD_HOST", "127.0.0.1"), help="server address")
    add("--port", type=int, default=int(os.environ.get("ELOCKD_PORT", "9999")), help="TCP port")
    add("--unix", metavar="PATH", help="connect to this Unix socket instead of TCP")
    add("--tls", action="store_true", help="use TLS (implied by the other --tls options)")
    add("--tls-ca", metavar="PEM", help="CA to verify the server with (default: system CAs)")
    add("--tls-cert", metavar="PEM", help="client certificate, for mutual TLS")
    add("--tls-key", metavar="PEM", help="private key of --tls-cert")
    add("--tls-server-name", metavar="NAME", help="name the server certificate must carry")
    add("--auth-token-file", metavar="FILE", help="send 'auth' with this file's content")
    add("--connect-timeout", type=positive_float, default=5.0, metavar="S")
    add("--timeout", type=positive_float, default=10.0, metavar="S", help="reply timeout")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for verb in PROBE_VERBS:
        probe = commands.add_parser(
            verb,
            help=f"one '{verb} KEY' request; exit 0 when its leading integer is not 0",
            description=f"Send '{verb} KEY', print the reply, exit 0 when its leading "
            "integer is not 0 (else 1). The connection closes right after, which "
            "frees anything it took: 'i' and 'si' are the useful probes.",
        )
        probe.add_argument("key", nargs="*", metavar="KEY", help="the key (words are joined)")
    commands.add_parser("q", help="raw terse stats ('name: value' lines)")
    stats = commands.add_parser("stats", help="server counters as a table")
    stats.add_argument("--json", action="store_true", help="print a JSON object instead")
    info = commands.add_parser("info", help="who holds KEY, its lease, token, waiters")
    info.add_argument("key", metavar="KEY")
    info.add_argument("--json", action="store_true", help="print a JSON object instead")
    dump = commands.add_parser("dump", help="every hold: 'KEY: OWNER' lines")
    dump.add_argument("--shared", action="store_true", help="shared holds instead of exclusive")
    lock = commands.add_parser(
        "lock",
        help="run COMMAND while holding KEY (like flock(1))",
        description="Take KEY, run COMMAND, release KEY when it ends.",
        epilog=LOCK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lock.add_argument("key", metavar="KEY")
    lock.add_argument(
        "--wait",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the lock (default 0: try once)",
    )
    lock.add_argument("--ttl", type=positive_float, metavar="S", help="hold it as a renewed lease")
    lock.add_argument("--shared", action="store_true", help="take a shared hold")
    lock.add_argument("--limit", type=positive_int, metavar="N", help="at most N shared holders")
    lock.add_argument(
        "-E",
        "--conflict-exit-code",
        type=int,
        default=EXIT_FALSE,
        metavar="N",
        help="exit status when the lock is not granted (default 1)",
    )
    lock.add_argument(
        "--kill-after",
        type=non_negative_float,
        default=5.0,
        metavar="S",
        help="after a lost lock, SIGKILL COMMAND if SIGTERM did not end it in S seconds",
    )
    lock.add_argument("argv", nargs="*", metavar="-- COMMAND ARGS", help="what to run")
    return parser


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "unix": args.unix,
        "connect_timeout": args.connect_timeout,
        "reply_timeout": args.timeout,
    }
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        options["ssl_context"] = tls_context(args.tls_ca, args.tls_cert, args.tls_key)
        options["server_hostname"] = args.tls_server_name
    if args.auth_token_file:
        with open(args.auth_token_file, "rb") as file:
            options["auth_token"] = file.read().strip()
    return options


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args, command = parse_lock_aware(parser, raw)
    if args.command == "lock":
        if command is not None:
            if args.argv:
                parser.error(f"lock: unexpected arguments before '--': {' '.join(args.argv)}")
            args.argv = command
        if not args.argv:
            parser.error("lock: missing COMMAND (elockctl lock KEY -- COMMAND ARGS...)")
        if args.limit is not None and not args.shared:
            parser.error("lock: --limit needs --shared")
    try:
        options = client_options(args)
        if args.command == "lock":
            return trio.run(run_locked, args, options)
        return run_one_liner(args, options)
    except ElockError as error:
        print(f"elockctl: {error}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `elockctl stats | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FALSE
    except (OSError, ValueError) as error:
        print(f"elockctl: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def parse_lock_aware(
    parser: argparse.ArgumentParser, raw: list[str]
) -> tuple[argparse.Namespace, list[str] | None]:
    """Parse, cutting ``lock``'s COMMAND off at the first ``--`` first, so that lock
    options may come after KEY (``elockctl lock KEY --wait 5 -- COMMAND``)."""
    if "lock" in raw and "--" in raw and raw.index("lock") < raw.index("--"):
        cut = raw.index("--")
        args = parser.parse_args(raw[:cut])
        if args.command == "lock":
            return args, raw[cut + 1 :]
    return parser.parse_args(raw), None


# ---------------------------------------------------------------- one-liners


def run_one_liner(args: argparse.Namespace, options: dict[str, Any]) -> int:
    out = sys.stdout
    with BlockingClient(**options) as client:
        if args.command in PROBE_VERBS:
            line = " ".join([args.command, *args.key]).encode()
            reply = client.command(line)[0]
            out.write(reply.decode(errors="replace") + "\n")
            head = reply.split(b" ", 1)[0]
            return 0 if head.isdigit() and int(head) != 0 else EXIT_FALSE
        if args.command == "q":
            for line in client.command(b"q"):
                out.write(line.decode(errors="replace") + "\n")
            return 0
        if args.command == "stats":
            print_stats(client.stats(), args.json)
            return 0
        if args.command == "info":
            details = client.info(args.key)
            values = {
                "key": details.key.decode(errors="replace"),
                "exclusive": None
                if details.owner is None
                else details.owner.decode(errors="replace"),
                "shared": details.shared,
                "waiting": details.waiting,
                "ttl": details.ttl,
                "token": details.token,
            }
            if args.json:
                out.write(json.dumps(values) + "\n")
            else:
                for name, value in values.items():
                    out.write(f"{name}: {'-' if value is None else value}\n")
            return 0
        assert args.command == "dump"
        for line in client.command(b"dump shared" if args.shared else b"dump"):
            out.write(line.decode(errors="replace") + "\n")
        return 0


def print_stats(values: dict[str, int], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(values, sort_keys=True) + "\n")
        return
    width = max(len(name) for name in values)
    for name, value in values.items():
        sys.stdout.write(f"{name:<{width}}  {value:>12}\n")


# ---------------------------------------------------------------- lock -- COMMAND


def say(message: str) -> None:
    print(f"elockctl: {message}", file=sys.stderr, flush=True)


async def run_locked(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Hold the lock for exactly as long as COMMAND runs; see LOCK_EPILOG."""
    lost = trio.Event()

    def on_lost(hold: Hold) -> None:
        lost.set()

    async with Client(**options) as client:
        try:
            if args.shared:
                hold = await client.acquire_shared(
                    args.key, args.limit, args.wait, args.ttl, on_lost
                )
            else:
                hold = await client.acquire(args.key, args.wait, args.ttl, on_lost)
        except Unavailable as error:
            say(f"{error}")
            return int(args.conflict_exit_code)
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


if __name__ == "__main__":
    sys.exit(main())
