"""What the server tells operators about events a client causes: one function per
record, so a record's wording and fields are decided in one place.

Every layer that does I/O reports through these (the connection loop, the accept
loops, the cluster, the hand-over); the request layer does not log at all, it
reports through hooks the daemon wires to them. The process's own set-up (where
records go, in which format) is :mod:`elockd.daemon.logs`.

Two rules hold whatever the caller logs (docs/operations.md):

* Every line a client can cause again and again (per connection, session or
  request) above debug goes through a :class:`~elockd.observe.logthrottle.LogThrottle`:
  bounded lines per interval, with a count of the rest.
* A client's text is cut by :func:`shown`; the text format escapes every field with
  :func:`escape`, so a client's ``iam`` name or key cannot move the cursor, repaint
  the screen, or fake a line. Secrets (tokens, session ids) are never handed to a
  logger; the request traces redact them (:mod:`elockd.observe.tracing`).
"""

from __future__ import annotations

import logging

from elockd.backend.interface import Evicted
from elockd.engine.bookkeeping import ENDED_SESSION_LIMIT
from elockd.engine.sessions import Session
from elockd.observe.logthrottle import LogThrottle

log = logging.getLogger("elockd")

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


def shown(data: bytes, limit: int = SHOWN) -> str:
    """A client's bytes as text for a record: at most ``limit`` bytes (``...``
    marks a cut), undecodable bytes as ``\\xNN``. Control characters stay: the
    text formatter escapes them (:func:`escape`), the JSON one encodes them."""
    cut = data[:limit].decode(errors="backslashreplace")
    return cut + "..." if len(data) > limit else cut


#: Failed `auth` comes in floods when someone guesses: one warning per 10 s, naming
#: the peer, with a count of the others held back.
_auth_failure_warning = LogThrottle(log, logging.WARNING, REFUSAL_INTERVAL)


def log_auth_failure(peer: bytes) -> None:
    """A wrong ``auth`` token: someone guessing, or a client with a stale token.
    (The connection is closed after the reply; the delay is the protocol's.)"""
    _auth_failure_warning("auth failed", fields={"peer": shown(peer)})


def log_kill(peer: bytes, key: bytes, evicted: list[Evicted]) -> None:
    """An operator's ``kill K``: one warning naming the admin's peer, the key and
    every evicted owner (``OWNER (IP:PORT) exclusive token=T`` or ``... shared``),
    the audit trail of who was thrown out of what. Not rate-limited: only a
    connection with the admin token can cause it, and every kill must be on record."""
    owners = ", ".join(
        f"{shown(e.owner)} ({shown(e.peer)}) "
        + ("shared" if e.shared else f"exclusive token={e.token}")
        for e in evicted
    )
    log.warning(
        "kill",
        extra={"peer": shown(peer), "key": shown(key), "freed": len(evicted), "evicted": owners},
    )


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


#: A connection task that failed in a way nobody foresaw (a bug): it ends that
#: connection only. Once per 10 s, with a count.
_connection_error_log = LogThrottle(log, logging.ERROR, REFUSAL_INTERVAL)


def log_connection_error(peer: bytes, error: BaseException) -> None:
    """A connection ended by an unexpected error: its session ends by its rules,
    the server and every other connection go on."""
    _connection_error_log(
        "connection ended by an unexpected error: %s",
        f"{type(error).__name__}: {error}"[:200],
        fields={"peer": shown(peer)},
    )
