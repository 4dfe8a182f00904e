"""Operational logging: where log lines go, in which format, and what is logged.

Every record goes through the standard :mod:`logging` module (hypercorn's and
trio's too), and structlog's :class:`~structlog.stdlib.ProcessorFormatter` renders
it: ``--log-format text`` for a person (``TIME [level] event key=value ...``),
``--log-format json`` for a log pipeline (one JSON object per line with ``ts``,
``level``, ``event`` and the record's fields). Fields travel as ``extra=`` so the
same call reads well in both.

What is logged, by level (docs/operations.md):

* info: start (with the effective configuration), stop, sessions that ended
  holding locks (the audit trail of orphans), refusals at a limit.
* warning: a failed ``auth``, with the peer.
* debug: connections opening and closing, and every request with its reply
  (:mod:`elockd.daemon.tracing`). Nothing per request is logged at info.

Three rules hold whatever the caller logs:

* Every line a client can cause again and again (per connection, session or
  request) above debug goes through a :class:`~elockd.daemon.logthrottle.LogThrottle`:
  bounded lines per interval, with a count of the rest.
* Text logs are safe to read in a terminal: :func:`escape` runs in the formatter
  over every field of every record (elockd's and its libraries'), so a client's
  ``iam`` name or key cannot move the cursor, repaint the screen, or fake a line.
  JSON logs need nothing more: the JSON renderer escapes every control character
  and everything outside ASCII.
* Secrets (tokens, session ids) are never handed to a logger; the request traces
  redact them (:mod:`elockd.daemon.tracing`).

The functions here are what the rest of the server calls, so a record's wording
and fields are decided in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import sys
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import structlog

from elockd import __version__
from elockd.daemon.config import Config
from elockd.daemon.logthrottle import LogThrottle
from elockd.engine.bookkeeping import ENDED_SESSION_LIMIT
from elockd.engine.sessions import Session

log = logging.getLogger("elockd")

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
#: Refusals at a limit come in floods (a connection storm, a runaway client): one
#: line per limit and interval, with a count of the ones held back.
REFUSAL_INTERVAL = 10.0
#: Sessions that end holding locks are the audit trail of orphans, so more of them
#: get through than refusals: at most this many lines per interval, then a count.
SESSION_END_BURST = 10
SESSION_END_INTERVAL = 1.0
#: Characters of a client's text (a name, a request's arguments) in a record.
SHOWN = 200

#: How :func:`escape` writes the few controls that have a short name.
_NAMED_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
#: Record fields that hold a multi-line text of the server's own (a traceback).
_MULTI_LINE_FIELDS = ("exception", "stack")


def configure_logging(level: str, log_format: str, stream: IO[str] | None = None) -> None:
    """Send every log record (elockd's and its libraries') to ``stream`` (stderr)
    at ``level`` and above, rendered as ``log_format`` (``text`` or ``json``)."""
    renderer: Any
    if log_format == "json":
        stamp = structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts")
        renderer = structlog.processors.JSONRenderer()
        extra_steps: list[Any] = [structlog.stdlib.add_logger_name]
        final: list[Any] = [structlog.processors.format_exc_info, renderer]
    else:
        # ConsoleRenderer puts a "timestamp" first; no logger name, so a line
        # without fields ends with its event ("elockd listening on HOST:PORT").
        stamp = structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp")
        extra_steps = []
        final = [
            structlog.processors.format_exc_info,
            escape_fields,
            structlog.dev.ConsoleRenderer(colors=False, pad_level=False),
        ]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            *extra_steps,
            structlog.stdlib.ExtraAdder(),
            stamp,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every etcd request at INFO: thousands a second on a cluster node.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Python's warnings (deprecations from libraries) become records too, so a JSON
    # log stays JSON throughout.
    logging.captureWarnings(True)


def escape(text: str) -> str:
    """``text`` with every character that does not print as itself written as a
    Python escape (``\\x1b``, ``\\u2028``, ``\\t``, ``\\U000e0041``): what
    :meth:`str.isprintable` refuses, that is Unicode's controls (Cc: C0, DEL, C1
    such as NEL and CSI), formats (Cf: bidi overrides, zero-width, tags), line and
    paragraph separators (Zl, Zp), spaces other than the ASCII space, surrogates,
    private-use and unassigned code points. An escape sequence thus loses its ESC
    and a line break its break, so nothing a client sent acts on a terminal."""
    if text.isprintable():  # nearly always: one pass in C
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_fields(_logger: object, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """The text format's last step before rendering: every key and value escaped
    (values that are not strings first rendered with :func:`repr`, as the renderer
    would). A traceback keeps its line breaks, each of its lines escaped and
    indented, so no line of it can pass for a record of its own."""
    escaped: dict[str, Any] = {}
    for key, value in event_dict.items():
        text = value if isinstance(value, str) else repr(value)
        if key in _MULTI_LINE_FIELDS:
            escaped[key] = "\n".join("    " + escape(line) for line in text.split("\n"))
        else:
            escaped[escape(str(key))] = escape(text)
    return escaped


def shown(data: bytes, limit: int = SHOWN) -> str:
    """A client's bytes as text for a record: at most ``limit`` bytes (``...``
    marks a cut), undecodable bytes as ``\\xNN``. Control characters stay: the
    text formatter escapes them (:func:`escape`), the JSON one encodes them."""
    cut = data[:limit].decode(errors="backslashreplace")
    return cut + "..." if len(data) > limit else cut


def redact_url(url: str) -> str:
    """``url`` without a password (``http://user:***@host``): etcd endpoints may
    carry credentials, and the start-up record must not."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def effective_configuration(config: Config) -> dict[str, object]:
    """Every setting as it is in force, fit for a log: secrets redacted. The token
    file is named by its path (never read here); etcd URLs lose any password."""
    settings = dataclasses.asdict(config)
    if config.etcd:
        settings["etcd"] = ",".join(redact_url(url) for url in config.etcd.split(","))
    return settings


def log_start(config: Config) -> None:
    log.info(
        "elockd starting",
        extra={
            "version": __version__,
            "python": platform.python_version(),
            **effective_configuration(config),
        },
    )


def log_stop() -> None:
    log.info("elockd stopped")


def log_startup_failure(problem: str) -> None:
    """One record for a start-up mistake (``--port 9999: address already in use``)."""
    log.error("cannot start", extra={"problem": problem})


def log_setting_note(note: str) -> None:
    """Something about the settings worth a look (a deprecated flag, a stray
    ``ELOCKD_*`` variable), found before logging was set up."""
    log.warning("setting", extra={"note": note})


def log_crash(error: BaseException) -> None:
    log.critical("elockd stopped by an unexpected error", exc_info=error)


#: Failed `auth` comes in floods when someone guesses: one warning per 10 s, naming
#: the peer, with a count of the others held back.
_auth_failure_warning = LogThrottle(log, logging.WARNING, REFUSAL_INTERVAL)


def log_auth_failure(peer: bytes) -> None:
    """A wrong ``auth`` token: someone guessing, or a client with a stale token.
    (The connection is closed after the reply; the delay is the protocol's.)"""
    _auth_failure_warning("auth failed", fields={"peer": shown(peer)})


#: Sessions ended at --max-sessions come in floods when a client churns: one warning
#: per 10 s, with a count.
_session_limit_warning = LogThrottle(log, logging.WARNING, REFUSAL_INTERVAL)
#: One client churning sessions that hold a lock (4 KiB names) once wrote 14-20 MB
#: of log a second: SESSION_END_BURST lines a second now, with a count.
_session_end_log = LogThrottle(log, logging.INFO, SESSION_END_INTERVAL, burst=SESSION_END_BURST)


def log_session_end(session: Session, exclusive: int, shared: int, why: str) -> None:
    """The audit trail of orphans: who lost how many holds, and why. Wired to
    :attr:`elockd.engine.locks.LockEngine.on_session_end`, which reports only sessions
    that held something. Rate-limited (``held_back`` counts the sessions not
    logged): a client can end sessions as fast as it can connect."""
    fields = {
        "peer": shown(session.peer),
        "client_name": None if session.name is None else shown(session.name),
        "freed": exclusive + shared,
        "exclusive": exclusive,
        "shared": shared,
        "why": why,
    }
    if why == ENDED_SESSION_LIMIT:
        _session_limit_warning("session ended at --max-sessions", fields=fields)
    else:
        _session_end_log("session ended holding locks", fields=fields)


_refusals: dict[str, LogThrottle] = {}


def log_refusal(limit: str, peer: bytes | None = None) -> None:
    """A request or connection refused at the limit set by the flag ``limit``
    (``--max-connections``, ``--max-holds``, ``--max-waiters``, ``--max-keys``):
    at most one record per limit every :data:`REFUSAL_INTERVAL` seconds, counting
    the ones held back."""
    throttle = _refusals.get(limit)
    if throttle is None:
        throttle = _refusals[limit] = LogThrottle(log, logging.INFO, REFUSAL_INTERVAL)
    fields = {"limit": limit}
    if peer is not None:
        fields["peer"] = shown(peer)
    throttle("refused at a limit", fields=fields)


def log_connection_open(peer: bytes) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("connection opened", extra={"peer": shown(peer)})


def log_connection_close(peer: bytes) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("connection closed", extra={"peer": shown(peer)})


#: A client can fail TLS handshakes as fast as it can connect: one line per 10 s.
_tls_failure_log = LogThrottle(log, logging.INFO, REFUSAL_INTERVAL)


def log_tls_failure(peer: bytes, cause: BaseException) -> None:
    """A TLS client that did not complete its handshake (plain TCP on a TLS port, a
    missing or unknown client certificate), at most once per 10 s with a count."""
    _tls_failure_log("TLS handshake with %s failed: %s", shown(peer), cause)
