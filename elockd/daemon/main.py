"""Command line: flags, ``ELOCKD_*`` variables and a TOML file -> :class:`Config` -> serve.

Every setting can come from three places. Precedence: a flag beats the environment
(``ELOCKD_METRICS_PORT``), which beats the file named by ``--config`` (or
``ELOCKD_CONFIG``; keys are the flag names with ``_``: ``metrics_port = 9100``),
which beats the defaults. A value from any of them goes through the same type
function as the flag, so ``ELOCKD_PORT=99999`` is refused like ``--port 99999``.

Mistakes are one line that names the flag, variable or key and the value (cut to
200 characters), with exit status 2, never a traceback: bad usage, a value the
operating system would refuse later (``--keepalive 70000``), a file that cannot be
read, and a set-up that fails at start (a port in use, :mod:`elockd.daemon.startup`) alike.
Whatever else fails before the server listens is one line and exit 2 too
(:func:`main`), so a hand-over successor refuses exactly what a fresh server does,
before it takes anything over.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import reprlib
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NoReturn
from urllib.parse import urlsplit

import trio

from elockd import __version__
from elockd.daemon.bounds import (
    MAX_COUNT,
    MAX_KEEPALIVE,
    MAX_LEASE_TTL,
    MAX_PORT,
    MAX_SECONDS,
    check_host,
    check_path,
    check_text,
    check_unix_path,
)
from elockd.daemon.combinations import COMMAND_LINE, ENV_PREFIX, ENVIRONMENT, combination_problem
from elockd.daemon.logs import (
    FORMATS,
    LEVELS,
    configure_logging,
    log_crash,
    log_setting_note,
    log_startup_failure,
    log_stop,
)
from elockd.daemon.server import run_until_signal
from elockd.daemon.startup import StartupError, find, one_line, shown
from elockd.protocol.config import Config
from elockd.protocol.replies import STYLES

log = logging.getLogger("elockd")

#: Settings that are not Config fields but may still be given: the deprecated alias.
ALIASES = frozenset({"grace_ms"})


class UsageError(Exception):
    """A setting that cannot be used, found before start: exit status 2."""


# ------------------------------------------------------------ value types
# Each raises ArgumentTypeError with what is expected, so argparse says
# "argument --port: a port number 0-65535, not '99999'".


def refused(expected: str, text: str) -> argparse.ArgumentTypeError:
    """``a port number 0-65535, not '99999'``, the value cut to a readable length."""
    return argparse.ArgumentTypeError(f"{expected}, not '{shown(text)}'")


def _parse(text: str, kind: Callable[[str], Any], expected: str) -> Any:
    try:
        return kind(text.strip())
    except ValueError:  # also: more digits than Python converts (4300)
        raise refused(expected, text) from None


def _whole(text: str, low: int, high: int, expected: str) -> int:
    value: int = _parse(text, int, expected)
    if value < low:
        raise refused(expected, text)
    if value > high:
        raise refused(expected if str(high) in expected else f"{expected}, at most {high}", text)
    return value


def _seconds(text: str, low: float, high: float, above_low: bool, expected: str) -> float:
    value: float = _parse(text, float, expected)
    if not (low < value if above_low else low <= value) or value == float("inf"):
        raise refused(expected, text)  # nan fails every comparison
    if value > high:
        raise refused(f"{expected}, at most {high:g}", text)
    return value


def port_number(text: str) -> int:
    return _whole(text, 0, MAX_PORT, f"a port number 0-{MAX_PORT}")


def positive_int(text: str) -> int:
    return _whole(text, 1, MAX_COUNT, "a whole number, 1 or more")


def non_negative_int(text: str) -> int:
    return _whole(text, 0, MAX_COUNT, "a whole number, 0 or more")


def positive_float(text: str) -> float:
    return _seconds(text, 0, MAX_SECONDS, True, "a number of seconds above 0")


def non_negative_float(text: str) -> float:
    return _seconds(text, 0, MAX_SECONDS, False, "a number of seconds, 0 or more")


def keepalive_seconds(text: str) -> float:
    """The bound is the kernel's (:data:`elockd.daemon.bounds.MAX_KEEPALIVE`): TCP_KEEPIDLE
    is half of it, and Linux refuses more than 32767 s."""
    return _seconds(text, 0, MAX_KEEPALIVE, False, "a number of seconds, 0 or more")


def session_ttl(text: str) -> int:
    """etcd raises lease TTLs below its own minimum (about 1.5 election timeouts,
    2 s at etcd's defaults) anyway; asking for less would only mislead. Above
    etcd's largest lease TTL a node could not start."""
    return _whole(text, 2, MAX_LEASE_TTL, "a whole number of seconds, 2 or more")


def file_mode(text: str) -> str:
    """Octal permission digits (``0660``, ``660``, ``0o660``), as four digits."""
    value: int = _parse(text.removeprefix("0o"), partial(int, base=8), "octal digits like 0660")
    if not 0 <= value <= 0o777:
        raise refused("octal digits from 0000 to 0777", text)
    return f"{value:04o}"


def _checked(check: Callable[[str], str], text: str) -> str:
    try:
        return check(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def plain_text(text: str) -> str:
    """A string setting: no NUL (the C library would cut it there) and nothing that
    is not Unicode (bytes the locale could not decode)."""
    return _checked(partial(check_text, what="text"), text)


def path_name(text: str) -> str:
    return _checked(check_path, text)


def host_name(text: str) -> str:
    return _checked(check_host, text)


def host_names(text: str) -> str:
    """Comma-separated host names, each checked as ``--host`` is; kept as one string."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    return ",".join(host_name(name) for name in names)


def unix_path(text: str) -> str:
    return _checked(check_unix_path, text)


def etcd_endpoints(text: str) -> str:
    """Comma-separated etcd endpoints as URLs. ``host:port`` is read as
    ``http://host:port``, as etcdctl reads it; anything else must be an http(s) URL."""
    urls = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        _checked(partial(check_text, what="an etcd endpoint"), item)
        url = item if "://" in item else f"http://{item}"
        parts = urlsplit(url)
        if parts.hostname:
            _checked(check_host, parts.hostname)
        try:
            port = parts.port
        except ValueError:
            port = None
            parts = parts._replace(scheme="")  # refused below
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.query
            or parts.fragment
            or (port is None and "://" not in item)
        ):
            raise argparse.ArgumentTypeError(
                f"'{shown(item)}' is not host:port or an http(s)://host:port URL"
            )
        urls.append(url.rstrip("/"))
    if not urls:
        raise argparse.ArgumentTypeError("no endpoint given (host:port[,host:port...])")
    return ",".join(urls)


# ------------------------------------------------------------ the parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, but no "(default: None)" for settings that are off."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (``elockd: argument --port: ...``), cut to
    a readable length, rather than the usage and then the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"elockd: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    defaults = Config()
    parser = Parser(
        prog="elockd",
        usage="%(prog)s [--option VALUE]... (elockd --help lists them)",
        description="Network lock server: exclusive and counted shared locks owned by "
        "a connection, freed when it goes away. Every option can also be set as an "
        "ELOCKD_<OPTION> environment variable (ELOCKD_METRICS_PORT=9100) or in the "
        "--config file (metrics_port = 9100); flags win over the environment, which "
        "wins over the file.",
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--version", action="version", version=f"%(prog)s {__version__}")
    add(
        "--config",
        metavar="FILE",
        type=path_name,
        default=None,
        help="read settings from this TOML file (keys: option names with '_'); "
        "also ELOCKD_CONFIG",
    )
    add(
        "--host",
        type=host_name,
        default=defaults.host,
        help="address to listen on (127.0.0.1: local only)",
    )
    add("--port", type=port_number, default=defaults.port, help="TCP port (0: any free)")
    add(
        "--unix",
        metavar="PATH",
        type=unix_path,
        default=None,
        help="also listen on this Unix socket (a live one there is refused, a stale one "
        "replaced)",
    )
    add(
        "--unix-mode",
        metavar="OCTAL",
        type=file_mode,
        default=defaults.unix_mode,
        help="permissions of the --unix socket, whatever the umask",
    )
    add("--metrics-host", type=host_name, default=defaults.metrics_host, help="address of /metrics")
    add(
        "--http-allowed-hosts",
        type=host_names,
        default=defaults.http_allowed_hosts,
        metavar="NAME[,NAME...]",
        help="host names a browser may reach the HTTP port's WebSocket by (the status "
        "page), besides IP addresses, localhost and --metrics-host",
    )
    add(
        "--metrics-port",
        type=port_number,
        default=defaults.metrics_port,
        help="HTTP port of /metrics, /healthz, the /status page and WebSocket sessions (0: off)",
    )
    add(
        "--metrics-max-connections",
        type=positive_int,
        default=defaults.metrics_max_connections,
        metavar="N",
        help="HTTP connections at once on the metrics port; more wait in the backlog",
    )
    add(
        "--metrics-idle-timeout",
        type=positive_float,
        default=defaults.metrics_idle_timeout,
        metavar="SECONDS",
        help="close an HTTP connection idle for this long",
    )
    add(
        "--metrics-cache",
        type=non_negative_float,
        default=defaults.metrics_cache,
        metavar="SECONDS",
        help="render /metrics at most once per this long; scrapers in between get the "
        "same text (0: render on every scrape)",
    )
    add(
        "--replies",
        choices=sorted(STYLES),
        default=defaults.replies,
        help="reply texts of the terse family",
    )
    add(
        "--max-connections",
        type=positive_int,
        default=defaults.max_connections,
        metavar="N",
        help="connections at once; one more is told '0 Too Many Connections'",
    )
    add(
        "--max-line",
        type=positive_int,
        default=defaults.max_line,
        metavar="BYTES",
        help="longest request line in bytes; longer ones get '0 Line Too Long'",
    )
    add(
        "--max-keys",
        type=positive_int,
        default=defaults.max_keys,
        metavar="N",
        help="keys per mlock (more: '413 Too Many Keys')",
    )
    add(
        "--max-waiters",
        type=positive_int,
        default=defaults.max_waiters,
        metavar="N",
        help="waiting requests per key (more: '413 Too Many Waiters')",
    )
    add(
        "--max-throttles",
        type=positive_int,
        default=defaults.max_throttles,
        metavar="N",
        help="throttle keys with state at once (more: '413 Too Many Throttles')",
    )
    add(
        "--max-watchers",
        type=positive_int,
        default=defaults.max_watchers,
        metavar="N",
        help="'watch' streams at once (more: '413 Too Many Watchers')",
    )
    add(
        "--watch-buffer",
        type=positive_int,
        default=defaults.watch_buffer,
        metavar="BYTES",
        help="unsent events one watcher may owe; past it: 'OVERFLOW', then close",
    )
    add(
        "--max-holds",
        type=positive_int,
        default=defaults.max_holds,
        metavar="N",
        help="holds one session may have at once ('0 Too Many Holds' / '413 Too Many Holds')",
    )
    add(
        "--max-sessions",
        type=positive_int,
        default=defaults.max_sessions,
        metavar="N",
        help="sessions without a connection (in grace or owning leases) kept at once; "
        "one more ends at once, its holds freed",
    )
    add(
        "--max-ttl",
        type=positive_float,
        default=defaults.max_ttl,
        metavar="SECONDS",
        help="longest WAIT, wait=, ttl= and set_timeout a request may ask for (longer: 400)",
    )
    add(
        "--idle-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="close a connection that sends nothing for this long (off by default; "
        "holders keep theirs open with 'ping')",
    )
    add(
        "--send-timeout",
        type=positive_float,
        default=defaults.send_timeout,
        metavar="SECONDS",
        help="drop a client whose replies cannot be sent for this long (it stopped reading)",
    )
    add(
        "--handshake-timeout",
        type=positive_float,
        default=defaults.handshake_timeout,
        metavar="SECONDS",
        help="time a TLS client has to finish its handshake",
    )
    add(
        "--keepalive",
        type=keepalive_seconds,
        default=defaults.keepalive,
        metavar="SECONDS",
        help="notice a client host that vanished (no FIN, no RST) within this long "
        "through TCP keepalive (0: the operating system's defaults)",
    )
    add(
        "--auth-failure-delay",
        type=non_negative_float,
        default=defaults.auth_failure_delay,
        metavar="SECONDS",
        help="answer a wrong 'auth' token only after this long (other clients go on)",
    )
    add(
        "--auth-token-file",
        metavar="FILE",
        type=path_name,
        default=None,
        help="demand 'auth TOKEN' with this file's content as the first request",
    )
    add(
        "--admin-token-file",
        metavar="FILE",
        type=path_name,
        default=None,
        help="'auth' with this file's content marks an operator's connection, the only "
        "kind that may 'kill' (a token of its own, not --auth-token-file's)",
    )
    add(
        "--tls-cert",
        metavar="PEM",
        type=path_name,
        default=None,
        help="serve the lock port over TLS",
    )
    add("--tls-key", metavar="PEM", type=path_name, default=None, help="private key of --tls-cert")
    add(
        "--tls-client-ca",
        metavar="PEM",
        type=path_name,
        default=None,
        help="require client certificates signed by this CA (mutual TLS)",
    )
    add(
        "--grace",
        type=non_negative_float,
        default=defaults.grace,
        metavar="SECONDS",
        help="how long a dropped connection's holds stay for a conn_id takeover "
        "(each session may change its own with set_timeout)",
    )
    add(
        "--grace-ms",
        type=non_negative_int,
        default=None,
        metavar="MS",
        help="deprecated: --grace in milliseconds",
    )
    add(
        "--control-socket",
        metavar="PATH",
        type=unix_path,
        default=None,
        help="wait on this Unix socket (mode 0600) for a successor to hand every "
        "connection and lock to (docs/upgrade.md)",
    )
    add(
        "--take-over",
        metavar="PATH",
        type=unix_path,
        default=None,
        help="take every listener, connection and lock over from the elockd whose "
        "--control-socket is PATH, then serve them",
    )
    add(
        "--handover-timeout",
        type=positive_float,
        default=defaults.handover_timeout,
        metavar="SECONDS",
        help="how long a hand-over may take before the old process serves on",
    )
    add(
        "--etcd",
        type=etcd_endpoints,
        metavar="URL[,URL...]",
        default=None,
        help="keep every lock in this etcd cluster, shared with other elockd nodes "
        "(docs/cluster.md); host:port means http://host:port; default: in memory, "
        "this process only",
    )
    add(
        "--etcd-prefix",
        type=plain_text,
        default=defaults.etcd_prefix,
        help="root of elockd's keys in etcd",
    )
    add(
        "--session-ttl",
        type=session_ttl,
        default=defaults.session_ttl,
        metavar="SECONDS",
        help="with --etcd: a crashed node's locks are freed after this long",
    )
    add(
        "--etcd-timeout",
        type=positive_float,
        default=defaults.etcd_timeout,
        metavar="SECONDS",
        help="with --etcd: give up on etcd after this long and reply 'Backend Unavailable' "
        "(counted from when a call is sent, not while it waits behind this node's others)",
    )
    add(
        "--etcd-in-flight",
        type=positive_int,
        default=defaults.etcd_in_flight,
        metavar="N",
        help="with --etcd: calls to etcd in flight at once; the others wait in order",
    )
    add(
        "--throttle-line-grace",
        type=positive_float,
        default=defaults.throttle_line_grace,
        metavar="SECONDS",
        help="with --etcd: a throttle line's head whose node has not taken its turn this "
        "long after it came is passed over (less than --session-ttl)",
    )
    add("--log-level", choices=LEVELS, default=defaults.log_level, help="least severe level logged")
    add(
        "--log-format",
        choices=FORMATS,
        default=defaults.log_format,
        help="text for people, json for log pipelines (one object per line)",
    )
    return parser


def setting_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's actions that are settings (a Config field or an alias), by name."""
    names = {field.name for field in dataclasses.fields(Config)} | ALIASES
    return {action.dest: action for action in parser._actions if action.dest in names}


# ------------------------------------------------------------ the three sources


def convert(action: argparse.Action, text: str, where: str) -> object:
    """``text`` through the flag's own type function and choices; a UsageError that
    names ``where`` the value came from otherwise."""
    try:
        value = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"{where}: {error}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UsageError(f"{where}: one of {choices}, not '{shown(text)}'")
    return value


def from_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> dict[str, Any]:
    """Only the settings given as flags (the parser's defaults come last, not first)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


#: How much of a value the "where" of an error repeats (the reason shows more).
WHERE_SHOWN = 40


def from_environment(
    actions: Mapping[str, argparse.Action], environ: Mapping[str, str], notes: list[str]
) -> dict[str, Any]:
    """Settings from ``ELOCKD_<NAME>`` variables; an empty one counts as unset, an
    unknown one is a note with the nearest name (a typo must not pass unseen)."""
    settings: dict[str, Any] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or not text:
            continue
        dest = name[len(ENV_PREFIX) :].lower()
        if dest in actions:
            settings[dest] = convert(actions[dest], text, f"{name}={shown(text, WHERE_SHOWN)}")
        elif dest != "config":
            close = _nearest(dest, [*actions, "config"])
            hint = f" (did you mean {ENV_PREFIX}{close.upper()}?)" if close else ""
            notes.append(f"{shown(name, 60)} is not an elockd setting{hint}; ignored")
    return settings


def _nearest(name: str, names: list[str]) -> str | None:
    """The setting ``name`` was probably meant to be (difflib, as argparse does)."""
    if len(name) > 64:  # no setting is that long; and difflib is quadratic
        return None
    close = difflib.get_close_matches(name.replace("-", "_"), names, 1)
    return close[0] if close else None


#: Settings whose file value may be a TOML array of strings (joined with commas).
LIST_KEYS = frozenset({"etcd"})
#: Settings whose file value must be a TOML string (``unix_mode = "0660"``): a TOML
#: integer cannot say octal (``660`` is decimal, and ``0o660`` is 432 once read).
STRING_KEYS = frozenset({"unix_mode"})
#: TOML values as the errors show them: short, and never recursing far.
_toml_repr = reprlib.Repr()
_toml_repr.maxstring = WHERE_SHOWN
_toml_repr.maxother = WHERE_SHOWN
_toml_repr.maxlevel = 2


def toml_text(key: str, value: object) -> str | None:
    """A TOML value as the text a flag would have been given; None for what no
    setting takes: tables, booleans, dates, arrays (but for :data:`LIST_KEYS`)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and key not in STRING_KEYS:
        try:
            return str(value)
        except ValueError:  # an integer of more digits than Python converts
            return None
    if key in LIST_KEYS and isinstance(value, list) and all(isinstance(x, str) for x in value):
        return ",".join(value)  # etcd = ["host:2379", "host2:2379"]
    return None


def read_toml(path: str) -> dict[str, Any]:
    """The file's table; a UsageError naming the file for anything that keeps it
    from being read as TOML, whatever raised it (a directory, bytes that are not
    UTF-8, nesting deeper than the parser recurses, a file too large for memory)."""
    where = f"--config {shown(path)}"
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise UsageError(f"{where}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{where}: not valid TOML ({shown(error)})") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"{where}: not UTF-8 text (byte {error.start})") from None
    except RecursionError:
        raise UsageError(f"{where}: not valid TOML (nested too deep)") from None
    except (ValueError, MemoryError) as error:
        raise UsageError(f"{where}: not valid TOML ({type(error).__name__})") from None


def from_file(path: str, actions: Mapping[str, argparse.Action]) -> dict[str, Any]:
    """Settings from a TOML file; an unknown key is refused by name."""
    table = read_toml(path)
    settings: dict[str, Any] = {}
    for key, value in table.items():
        where = f"--config {shown(path)}: {shown(key, WHERE_SHOWN)}"
        if key not in actions:
            close = _nearest(key, list(actions))
            hint = f" (did you mean {close}?)" if close else ""
            raise UsageError(f"--config {shown(path)}: unknown key '{shown(key)}'{hint}")
        text = toml_text(key, value)
        if text is None:
            expected = "a string" if key in STRING_KEYS else "a number or a string"
            raise UsageError(f"{where}: {expected}, not {_toml_repr.repr(value)}")
        settings[key] = convert(actions[key], text, f"{where} = {_toml_repr.repr(value)}")
    return settings


def apply_alias(settings: dict[str, Any], where: str, notes: list[str]) -> None:
    """``grace_ms`` (deprecated) becomes ``grace`` in seconds, within one source."""
    if "grace_ms" not in settings:
        return
    milliseconds = settings.pop("grace_ms")
    if "grace" in settings:
        raise UsageError(f"{where}: --grace and --grace-ms both given; keep --grace")
    settings["grace"] = milliseconds / 1000
    notes.append(f"--grace-ms is deprecated: use --grace {milliseconds / 1000:g} (seconds)")


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[Config, list[str]]:
    """The Config in force, and notes to log once logging is set up (deprecations,
    ignored variables). Raises UsageError; argparse exits 2 on a bad flag itself."""
    environ = os.environ if environ is None else environ
    build_parser().parse_args(argv)  # --help, --version and bad flags end here
    parser = build_parser()
    actions = setting_actions(parser)
    flags = from_flags(parser, argv)
    notes: list[str] = []
    config_file = flags.pop("config", None)
    if not config_file and environ.get(f"{ENV_PREFIX}CONFIG"):
        config_file = environ[f"{ENV_PREFIX}CONFIG"]
        try:
            check_path(config_file)
        except ValueError as error:
            raise UsageError(f"{ENV_PREFIX}CONFIG: {error}") from None
    sources = [
        (from_file(config_file, actions) if config_file else {}, f"--config {config_file}"),
        (from_environment(actions, environ, notes), ENVIRONMENT),
        (flags, COMMAND_LINE),
    ]
    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}  # the form each setting was given in, for its errors
    for source, where in sources:
        apply_alias(source, where, notes)
        settings.update(source)
        origin.update((key, where) for key in source)
    config = Config(**settings)
    problem = combination_problem(config, origin)
    if problem is not None:
        raise UsageError(problem)
    return config, notes


# ------------------------------------------------------------ main


def fail_to_start(problem: str, config: Config | None = None) -> NoReturn:
    """The one line of a start-up failure (of any kind: the settings name something
    this machine does not give, or cannot be read at all), then exit 2."""
    if config is not None and config.log_format == "json":
        log_startup_failure(one_line(problem))
    else:
        print(f"elockd: {one_line(problem)}", file=sys.stderr)
    raise SystemExit(2)


def innermost(error: BaseException) -> BaseException:
    """The first exception that is not a group (trio wraps a nursery's in groups)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def unexpected(error: BaseException) -> str:
    """An exception nobody turned into words, as one line: its type and message."""
    return f"{type(error).__name__}: {shown(error)}" if str(error) else type(error).__name__


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    try:
        config, notes = load_config(argv, environ)
    except UsageError as error:
        fail_to_start(str(error))
    except Exception as error:  # whatever else the settings make fail: still one line
        fail_to_start(f"cannot read the settings: {unexpected(error)}")
    configure_logging(config.log_level, config.log_format)
    for note in notes:
        log_setting_note(note)
    started = False

    def now_started() -> None:
        nonlocal started
        started = True

    try:
        trio.run(run_until_signal, config, (), now_started)
    except KeyboardInterrupt:  # before the signal handlers were in place
        return 130
    except BaseException as error:
        problem = find(error, StartupError)
        if problem is not None:
            fail_to_start(str(problem), config)
        if not started and isinstance(error, Exception):
            # Before the server listens nothing is held yet, and the cause lies in the
            # settings or the machine: one line like any other, the traceback at debug.
            log.debug("start-up failed", exc_info=error)
            fail_to_start(f"cannot start: {unexpected(innermost(error))}", config)
        if config.log_format != "json" or not isinstance(error, Exception):
            raise
        log_crash(error)  # a bug: its traceback, but as JSON like every other line
        return 1
    log_stop()
    return 0
