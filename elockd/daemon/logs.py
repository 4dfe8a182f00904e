"""Operational logging, the process's side: where log lines go and in which format.

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
  (:mod:`elockd.observe.tracing`). Nothing per request is logged at info.

The records a client can cause (and their throttles) are :mod:`elockd.observe.logs`,
which every I/O layer calls; the process's own records (start, stop, a crash) are
here. Text logs are safe to read in a terminal: :func:`escape_fields` runs in the
formatter over every field of every record (elockd's and its libraries'). JSON logs
need nothing more: the JSON renderer escapes every control character and everything
outside ASCII.
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
from elockd.observe.logs import escape
from elockd.protocol.config import Config

log = logging.getLogger("elockd")

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
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
