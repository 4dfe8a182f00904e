"""elockctl's command line: options, their checks, and the client settings they make.

Every mistake is a usage error (exit 2) in one line that names the option, the file
or the key, before anything is sent: a key the server cannot take, a token file
that cannot be read, a number that is not one.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import ssl
import sys
from typing import Any, NoReturn

from elockd.client.base import describe
from elockd.client.core import encode_key, quoted
from elockd.client.websocket import parse_url
from elockd.ctl.argv import Scanner
from elockd.ctl.operator_args import add_operator_parsers
from elockd.ctl.status import EXIT_FALSE, EXIT_USAGE

PROBE_VERBS = ("g", "r", "i", "sg", "sr", "si")

EPILOG = """\
exit status: 0 yes; 1 no (a probe's reply began with 0); 2 usage error; 3 could
not tell: the server cannot be reached, wants a token (--auth-token-file) or
refused it, sent something that is not an elockd reply, or the connection was
lost. 'elockctl COMMAND --help' has each command's own.
"""

PROBE_EPILOG = """\
exit status: 0 when the reply's leading integer is not 0 (yes), 1 when it is 0
(no), 2 usage error, 3 when the server could not tell (unreachable, a token wanted
or refused, a reply that is not this verb's, e.g. '0 Auth Required' or another
service's banner). The connection closes right after the request, which frees
anything it took: 'i' and 'si' are the useful probes.
"""

LOCK_EPILOG = """\
flock(1) users: -w/--wait, -n/--nonblock, -c, -s/--shared, -x/--exclusive, -E
and --verbose mean what they mean there (shared and exclusive holders exclude each
other; a lock not granted is silent); KEY is a key on the server instead of a file.
Options end at COMMAND: 'elockctl lock K cmd -s' runs 'cmd -s'. Unlike flock,
without -w elockctl does not wait: it tries once, as -n does.

exit status:
  COMMAND's own     (128+N if a signal N killed it)
  1                 the lock was not granted at once (-n) or within -w/--wait
                    (change it with -E/--conflict-exit-code; silent, as flock)
  2                 usage error (e.g. a KEY with a blank: keys are one word)
  3                 could not tell: the server cannot be reached, wants a token
                    (--auth-token-file) or refused it, sent something that is not
                    an elockd reply ('Backend Unavailable' included), or went
                    away before the lock was granted
  75                the lock was lost while COMMAND ran (COMMAND is then sent
                    SIGTERM, and SIGKILL after --kill-after seconds)
  126, 127          COMMAND cannot run, is not found

Signals (INT TERM HUP QUIT USR1 USR2 WINCH) are forwarded to COMMAND, except INT
and QUIT while elockctl runs in a terminal's foreground: Ctrl-C and Ctrl-\\ reach
COMMAND from the terminal already.
"""


THROTTLE_EPILOG = """\
COUNT/PERIOD: at most COUNT runs per PERIOD on average, --burst at once (default
COUNT). PERIOD is seconds, or has a unit: s, m, h (100/1m, 5/1s, 10/60, 1000/h).
Every caller of KEY should give the same rate. Options end at COMMAND: 'elockctl
throttle K 5/1s cmd -w 1' runs 'cmd -w 1'.

exit status:
  COMMAND's own     when admitted (128+N if a signal N killed it)
  0                 --peek: the five fields were printed
  1                 limited: not admitted at once, or within -w (the line on
                    stderr says when a retry would pass)
  2                 usage error (a bad COUNT/PERIOD, a KEY with a blank, the
                    server's '400 Bad Request', such as a cost above the burst)
  3                 could not tell: the server cannot be reached, wants a token or
                    refused it, is full ('413 Too Many Throttles', '413 Too Many
                    Waiters'), has no etcd quorum ('409 Backend Unavailable'), or
                    sent something that is not an elockd reply
  126, 127          COMMAND cannot run, is not found
"""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors that name the option, and exit status 2.
    ``commands`` holds the parser of each command, for errors worded as its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see '{self.prog} --help')\n")


# ---------------------------------------------------------------- option types
# argparse names a type function in its errors ("invalid seconds value"), so each
# one raises ArgumentTypeError with a sentence of its own instead.


def seconds(text: str) -> float:
    """A duration: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds (0 or more)")
    return value


def positive_seconds(text: str) -> float:
    """A duration above 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"'{text}': give a number of seconds above 0")
    return value


def whole_number(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}")
    return value


#: COUNT/PERIOD: a whole COUNT, a PERIOD in seconds with an optional unit (the
#: number may be left out before a unit: 100/m is 100/1m).
RATE = re.compile(r"(?P<count>\d+)/(?P<period>\d+(?:\.\d*)?|\.\d+)?(?P<unit>[smh]?)\Z")
UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def rate(text: str) -> tuple[int, float]:
    """``COUNT/PERIOD`` as (count, seconds): ``100/1m``, ``5/1s``, ``10/60``."""
    match = RATE.match(text)
    if match is not None and (match["period"] or match["unit"]):
        count = int(match["count"])
        period = float(match["period"] or 1) * UNITS[match["unit"]]
        if count >= 1 and period > 0 and math.isfinite(period):
            return count, period
    raise argparse.ArgumentTypeError(
        f"'{text}' is not a rate: COUNT/PERIOD, a whole COUNT of 1 or more per a PERIOD "
        "above 0 in seconds or with a unit s, m or h (100/1m, 5/1s, 10/60)"
    )


def cost(text: str) -> int:
    return whole_number(text, 1, 2**31, "a whole cost, 1 or more (--peek asks at cost 0)")


def holders(text: str) -> int:
    return whole_number(text, 1, 2**31, "a whole number of holders, 1 or more")


def port(text: str) -> int:
    return whole_number(text, 1, 65535, "a port number (1-65535)")


def exit_status(text: str) -> int:
    return whole_number(text, 0, 255, "an exit status (0-255)")


def version() -> str:
    from importlib import metadata  # here: its import is a tenth of elockctl's start

    try:
        return metadata.version("elockd")
    except metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown (not installed)"


class ShowVersion(argparse.Action):
    """``--version``: the version is looked up only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        sys.stdout.write(f"{parser.prog} {version()}\n")
        parser.exit()


# ---------------------------------------------------------------- the command line


def build_parser() -> Parser:
    parser = Parser(
        prog="elockctl",
        description="Talk to an elockd server: probes, stats, and run a command under a lock.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--version", action=ShowVersion, help="show program's version number and exit")
    add("--host", help="server address (default: $ELOCKD_HOST, else 127.0.0.1)")
    add("--port", type=port, help="TCP port (default: $ELOCKD_PORT, else 9999)")
    add("--unix", metavar="PATH", help="connect to this Unix socket instead of TCP")
    add(
        "--url",
        metavar="URL",
        type=websocket_url,
        help="a WebSocket session on the server's HTTP port instead "
        "(ws://HOST:PORT/, or wss:// for TLS; default: $ELOCKD_URL)",
    )
    add("--tls", action="store_true", help="use TLS (implied by the other --tls options)")
    add("--tls-ca", metavar="PEM", help="CA to verify the server with (default: system CAs)")
    add("--tls-cert", metavar="PEM", help="client certificate, for mutual TLS")
    add("--tls-key", metavar="PEM", help="private key of --tls-cert")
    add("--tls-server-name", metavar="NAME", help="name the server certificate must carry")
    add("--auth-token-file", metavar="FILE", help="send 'auth' with this file's content")
    add(
        "--connect-timeout",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="seconds to connect, TLS handshake and auth included (default: 5)",
    )
    add(
        "--timeout",
        type=positive_seconds,
        default=10.0,
        metavar="S",
        help="seconds to wait for a reply (default: 10)",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do (each has --help)"
    )

    for verb in PROBE_VERBS:
        probe = commands.add_parser(
            verb,
            help=f"one '{verb} KEY' request; exit 0 when its leading integer is not 0",
            description=f"Send '{verb} KEY', print the reply, exit 0 when its leading "
            "integer is not 0, 1 when it is 0.",
            epilog=PROBE_EPILOG,
        )
        probe.add_argument("key", nargs="*", metavar="KEY", help="the key (words are joined)")
    commands.add_parser("q", help="raw terse stats ('name: value' lines)")
    stats = commands.add_parser("stats", help="server counters as a table")
    stats.add_argument("--json", action="store_true", help="print a JSON object instead")
    info = commands.add_parser("info", help="who holds KEY, its lease, token, waiters")
    info.add_argument("key", metavar="KEY", help="the key (one word)")
    info.add_argument("--json", action="store_true", help="print a JSON object instead")
    dump = commands.add_parser("dump", help="every hold: 'KEY: OWNER' lines")
    dump.add_argument("--shared", action="store_true", help="shared holds instead of exclusive")
    add_operator_parsers(commands)
    add_lock_parser(commands)
    add_throttle_parser(commands)
    upgrade = commands.add_parser(
        "upgrade",
        help="hand a running elockd's connections and locks to a new one",
        description="Start 'elockd --take-over PATH FLAGS' (the elockd beside this "
        "elockctl) and wait until it serves every connection and lock of the elockd "
        "whose --control-socket is PATH. Exit 0 when it does; 3 when it did not (the "
        "old one then serves on). See docs/upgrade.md.",
        usage="elockctl upgrade PATH [--wait S] [--log-file FILE] -- [ELOCKD FLAGS...]",
    )
    upgrade.add_argument("control", metavar="PATH", help="the old elockd's --control-socket")
    upgrade.add_argument(
        "--wait",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds the new elockd has to take over (default: 60)",
    )
    upgrade.add_argument(
        "--log-file",
        metavar="FILE",
        help="append the new elockd's log here (default: the journal; it never "
        "keeps this command's stdout or stderr)",
    )
    upgrade.add_argument("argv", nargs="*", metavar="-- FLAGS", help="the new elockd's flags")
    parser.commands = dict(commands.choices)
    return parser


def add_lock_parser(commands: Any) -> None:
    lock = commands.add_parser(
        "lock",
        help="run COMMAND while holding KEY (like flock(1))",
        description="Take KEY, run COMMAND, release KEY when it ends.",
        usage="elockctl lock [options] KEY [options] [--] COMMAND [ARGS...]\n"
        "       elockctl lock [options] KEY [options] -c 'SHELL COMMAND'",
        epilog=LOCK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = lock.add_argument
    add("key", metavar="KEY", help="the key (one word: no blanks)")
    waiting = lock.add_mutually_exclusive_group()
    waiting.add_argument(
        "-w",
        "--wait",
        type=seconds,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the lock, as flock -w (default: 0, try once)",
    )
    waiting.add_argument(
        "-n",
        "--nb",
        "--nonblock",
        action="store_true",
        help="do not wait: fail at once if KEY is held, as flock -n (the default)",
    )
    add(
        "-c",
        "--command",
        dest="shell",
        metavar="'SHELL COMMAND'",
        help="run this with '$SHELL -c' ('/bin/sh -c' without $SHELL), as flock -c, "
        "instead of COMMAND ARGS",
    )
    add("--ttl", type=positive_seconds, metavar="S", help="hold it as a lease of S seconds")
    add(
        "-s",
        "--shared",
        action="store_true",
        help="take a shared hold, as flock -s (the last of -s and -x counts)",
    )
    add(
        "-x",
        "-e",
        "--exclusive",
        dest="shared",
        action="store_false",
        help="take an exclusive hold, as flock -x (the default)",
    )
    add("--limit", type=holders, metavar="N", help="with --shared: at most N holders")
    add(
        "-E",
        "--conflict-exit-code",
        type=exit_status,
        default=EXIT_FALSE,
        metavar="N",
        help="exit status when the lock is not granted, as flock -E (default: 1)",
    )
    add(
        "--verbose",
        action="store_true",
        help="say how long getting the lock took, or why it was not granted, as flock "
        "--verbose (without it a lock not granted is silent, as in flock)",
    )
    add(
        "--kill-after",
        type=seconds,
        default=5.0,
        metavar="S",
        help="after a lost lock, SIGKILL COMMAND if SIGTERM did not end it (default: 5)",
    )
    add(
        "argv",
        nargs="*",
        metavar="COMMAND ARGS",
        help="what to run; options end at COMMAND, whose own options are its own "
        "(as in flock: 'elockctl lock K cmd -s' runs 'cmd -s'); '--' before it also works",
    )


def add_throttle_parser(commands: Any) -> None:
    throttle = commands.add_parser(
        "throttle",
        help="run COMMAND if KEY's rate allows it (at most COUNT per PERIOD)",
        description="Ask the server's rate limit for KEY (throttle, GCRA); run COMMAND "
        "when admitted, exit 1 when limited. With --peek, print the limit's state.",
        usage="elockctl throttle [options] KEY COUNT/PERIOD [options] [--] COMMAND [ARGS...]\n"
        "       elockctl throttle [options] KEY COUNT/PERIOD --peek [--json]",
        epilog=THROTTLE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = throttle.add_argument
    add("key", metavar="KEY", help="the key (one word: no blanks)")
    add("rate", metavar="COUNT/PERIOD", type=rate, help="the rate, e.g. 100/1m")
    add("--burst", type=holders, metavar="B", help="at most B at once (default: COUNT)")
    add("--cost", type=cost, metavar="N", help="this run weighs N (default: 1)")
    add(
        "-w",
        "--wait",
        type=seconds,
        default=0.0,
        metavar="S",
        help="wait up to S seconds in line for the rate to allow it, first come first "
        "served (default: 0, ask once)",
    )
    add(
        "--peek",
        action="store_true",
        help="run nothing and spend nothing (cost 0): print admitted, limit, "
        "remaining, retry_after, reset_after",
    )
    add("--json", action="store_true", help="with --peek: print a JSON object instead")
    add(
        "argv",
        nargs="*",
        metavar="COMMAND ARGS",
        help="what to run when admitted; options end at COMMAND ('--' before it also works)",
    )


def check_throttle_args(throttle: Parser, args: argparse.Namespace, command: list[str]) -> None:
    args.argv = command
    if args.peek:
        if command:
            throttle.error(f"--peek runs no COMMAND (found {quoted_words(command)})")
        if args.wait:
            throttle.error("--peek does not wait: leave out -w")
        if args.cost is not None:
            throttle.error("--peek asks at cost 0: leave out --cost")
    elif not command:
        throttle.error(
            "missing COMMAND (elockctl throttle KEY COUNT/PERIOD COMMAND ARGS, or --peek)"
        )
    elif args.json:
        throttle.error("--json goes with --peek")
    args.cost = 0 if args.peek else (args.cost or 1)
    check_key(throttle, args.key)


def parse(parser: Parser, raw: list[str]) -> argparse.Namespace:
    """Parse and check the command line; any mistake exits 2 with one line.

    :mod:`elockd.ctl.argv` first finds where the options end (``lock``'s COMMAND,
    ``upgrade``'s flags after ``--``) and puts global options first wherever they
    stood; argparse then reads the rest.
    """
    arranged = Scanner(parser, parser.commands).arrange(raw)
    args = parser.parse_args(arranged.words)
    if args.command == "upgrade":
        args.argv = [*args.argv, *(arranged.tail or [])]
    elif args.command == "lock":
        check_lock_args(parser.commands["lock"], args, arranged.tail or [])
    elif args.command == "throttle":
        check_throttle_args(parser.commands["throttle"], args, arranged.tail or [])
    elif args.command in ("info", "kill"):
        check_key(parser.commands[args.command], args.key)
    elif args.command in ("ls", "watch", "top") and args.prefix:
        check_key(parser.commands[args.command], args.prefix, "prefix")
    elif args.command in PROBE_VERBS and any(c in word for word in args.key for c in "\r\n"):
        parser.commands[args.command].error("a key cannot hold a line end")
    return args


def check_lock_args(lock: Parser, args: argparse.Namespace, command: list[str]) -> None:
    args.argv = command
    if args.shell is not None:
        if args.argv:
            lock.error(
                f"give COMMAND or -c 'SHELL COMMAND', not both (found {quoted_words(command)})"
            )
        args.argv = [os.environ.get("SHELL") or "/bin/sh", "-c", args.shell]  # as flock
    if not args.argv:
        lock.error("missing COMMAND (elockctl lock KEY COMMAND ARGS, or -c 'COMMAND')")
    if args.limit is not None and not args.shared:
        lock.error("--limit needs --shared")
    check_key(lock, args.key)


def quoted_words(words: list[str]) -> str:
    return " ".join(shlex.quote(word) for word in words)


def check_key(parser: Parser, key: str, what: str = "key") -> None:
    """A word-family key (or prefix) is one word: say so before connecting, as a
    usage error."""
    try:
        encode_key(key)
    except ValueError:
        parser.error(
            f"{what} {quoted(key.encode())} cannot be sent: a {what} is one word, "
            "not empty, without blanks or line ends"
        )


def client_options(parser: Parser, args: argparse.Namespace) -> dict[str, Any]:
    """The client's settings; a file that cannot be used is a usage error naming it."""
    options: dict[str, Any] = {
        "host": args.host or os.environ.get("ELOCKD_HOST") or "127.0.0.1",
        "port": args.port if args.port is not None else port_from_environment(parser),
        "unix": args.unix,
        "url": args.url or url_from_environment(parser),
        "connect_timeout": args.connect_timeout,
        "reply_timeout": args.timeout,
    }
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        options["ssl_context"] = tls_context(parser, args)
        options["server_hostname"] = args.tls_server_name
    if args.auth_token_file:
        options["auth_token"] = read_token(parser, args.auth_token_file)
    if args.command == "kill":  # the admin token passes wherever auth's does
        options["auth_token"] = read_token(
            parser.commands["kill"], args.admin_token_file, "--admin-token-file"
        )
    return options


def websocket_url(text: str) -> str:
    """A ``ws://`` or ``wss://`` URL (argparse names the flag when it is not one)."""
    try:
        parse_url(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


websocket_url.__name__ = "WebSocket URL"


def url_from_environment(parser: Parser) -> str | None:
    text = os.environ.get("ELOCKD_URL")
    if not text:
        return None
    try:
        return websocket_url(text)
    except argparse.ArgumentTypeError as error:
        parser.error(f"$ELOCKD_URL: {error}")


def port_from_environment(parser: Parser) -> int:
    text = os.environ.get("ELOCKD_PORT") or "9999"
    try:
        return port(text)
    except argparse.ArgumentTypeError as error:
        parser.error(f"$ELOCKD_PORT: {error}")


def tls_context(parser: Parser, args: argparse.Namespace) -> ssl.SSLContext:
    if args.tls_key and not args.tls_cert:
        parser.error("--tls-key needs --tls-cert")
    try:
        context = ssl.create_default_context(cafile=args.tls_ca)
    except (OSError, ssl.SSLError) as error:
        parser.error(f"--tls-ca {args.tls_ca}: {describe(error)}")
    if args.tls_cert:
        for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            if path is not None and not os.access(path, os.R_OK):
                parser.error(f"{flag} {path}: cannot be read")
        try:
            context.load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as error:
            parser.error(f"--tls-cert {args.tls_cert} / --tls-key: {describe(error)}")
    return context


def read_token(parser: Parser, path: str, flag: str = "--auth-token-file") -> bytes:
    try:
        with open(path, "rb") as file:
            token = file.read().strip()
    except OSError as error:
        parser.error(f"{flag} {path}: {describe(error)}")
    if not token or b"\n" in token or b"\r" in token:
        parser.error(f"{flag} {path}: the token must be one line, not empty")
    return token
