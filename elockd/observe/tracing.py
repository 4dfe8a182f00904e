"""``--log-level debug``: every request with its reply, and every wait with its end.

A request costs a few hundred nanoseconds; a log record costs microseconds. So
nothing here runs unless debug logging is on when the server starts: then
:func:`trace_requests` swaps the service's command table for one whose commands
log around the real ones (grants, releases, refusals and waits are all a request
and its reply). At info and above the table is the plain one and the hot path
pays nothing, not even a level check.

A verb declared ``secret`` in the command table (``auth``, ``conn_id``) carries a
bearer secret in its arguments or its reply: its records say the verb and the
reply's status, never the rest.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from elockd.observe.logs import shown
from elockd.protocol.connection import Command, Connection, Outcome, Reply, Service, Streamed

log = logging.getLogger("elockd.requests")

#: What a record shows in place of a secret.
REDACTED = "***"


def trace_requests(service: Service) -> None:
    """Log every request of an authenticated connection with its reply (debug)."""
    service.commands = {verb: traced(command) for verb, command in service.commands.items()}


def _shown(reply: bytes | Streamed) -> str:
    """A reply's first line, for a record."""
    if isinstance(reply, Streamed):
        return "(streamed)"
    line, _, more = reply.partition(b"\r\n")
    return shown(line) + (" ..." if more else "")


def _status_only(reply: bytes | Streamed) -> str:
    """A secret verb's reply for a record: its status code, the rest redacted
    (``conn_id`` answers ``200 ID``)."""
    if isinstance(reply, Streamed):
        return "(streamed)"
    status, _, rest = reply.partition(b" ")
    return shown(status) + (f" {REDACTED}" if rest else "")


def traced(command: Command) -> Command:
    """``command``, also logging each request, its reply, and for a request whose
    reply comes later, the wait (if it waits) and how it ended."""
    name = command.verb.decode(errors="backslashreplace")
    call = command.call
    secret = command.secret
    show_reply = _status_only if secret else _shown

    def handle(conn: Connection, rest: bytes, now: float) -> Reply:
        reply = call(conn, rest, now)
        fields: dict[str, object] = {
            "peer": shown(conn.peer),
            "verb": name,
            "arguments": REDACTED if secret and rest.strip() else shown(rest),
        }
        if isinstance(reply, Outcome):
            if reply.waits:
                log.debug("waiting", extra=fields)
            reply.finish = _logging_end(
                reply.finish, fields, "wait ended" if reply.waits else "request", show_reply
            )
        elif isinstance(reply, bytes | Streamed):
            log.debug("request", extra={**fields, "reply": show_reply(reply)})
        return reply

    return Command(
        command.verb,
        command.family,
        handle,
        needs_auth=command.needs_auth,
        raw=True,
        secret=secret,
        wait_reply=command.wait_reply,
        holds=command.holds,  # its call is the gated one already: the mark goes along
    )


def _logging_end(
    finish: Callable[[Any], bytes | Streamed],
    fields: dict[str, object],
    event: str,
    show_reply: Callable[[bytes | Streamed], str],
) -> Callable[[Any], bytes | Streamed]:
    @functools.wraps(finish)  # a hand-over names a waiting reply by the function it wraps
    def logged(value: Any) -> bytes | Streamed:
        reply = finish(value)
        log.debug(event, extra={**fields, "reply": show_reply(reply)})
        return reply

    return logged
