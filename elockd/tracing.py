"""``--log-level debug``: every request with its reply, and every wait with its end.

A request costs a few hundred nanoseconds; a log record costs microseconds. So
nothing here runs unless debug logging is on when the server starts: then
:func:`trace_requests` swaps the service's command table for one whose commands
log around the real ones (grants, releases, refusals and waits are all a request
and its reply). At info and above the table is the plain one and the hot path
pays nothing, not even a level check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from elockd.protocol import Command, Connection, Outcome, Reply, Service, Streamed

log = logging.getLogger("elockd.requests")

SHOWN_ARGS = 200  # characters of a request's arguments in a record


def trace_requests(service: Service) -> None:
    """Log every request of an authenticated connection with its reply (debug)."""
    service.commands = {verb: traced(command) for verb, command in service.commands.items()}


def _text(data: bytes, limit: int = SHOWN_ARGS) -> str:
    return data[:limit].decode(errors="backslashreplace")


def _shown(reply: bytes | Streamed) -> str:
    """A reply's first line, for a record."""
    if isinstance(reply, Streamed):
        return "(streamed)"
    line, _, more = reply.partition(b"\r\n")
    return _text(line) + (" ..." if more else "")


def traced(command: Command) -> Command:
    """``command``, also logging each request, its reply, and for a request whose
    reply comes later, the wait (if it waits) and how it ended."""
    name = command.verb.decode(errors="backslashreplace")
    call = command.call

    def handle(conn: Connection, rest: bytes, now: float) -> Reply:
        reply = call(conn, rest, now)
        fields: dict[str, object] = {
            "peer": _text(conn.peer),
            "verb": name,
            "arguments": _text(rest),
        }
        if isinstance(reply, Outcome):
            if reply.waits:
                log.debug("waiting", extra=fields)
            reply.finish = _logging_end(
                reply.finish, fields, "wait ended" if reply.waits else "request"
            )
        elif isinstance(reply, bytes | Streamed):
            log.debug("request", extra={**fields, "reply": _shown(reply)})
        return reply

    return Command(command.verb, command.family, handle, needs_auth=command.needs_auth, raw=True)


def _logging_end(
    finish: Callable[[Any], bytes | Streamed], fields: dict[str, object], event: str
) -> Callable[[Any], bytes | Streamed]:
    def logged(value: Any) -> bytes | Streamed:
        reply = finish(value)
        log.debug(event, extra={**fields, "reply": _shown(reply)})
        return reply

    return logged
