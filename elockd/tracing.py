"""``--log-level debug``: every request with its reply, and every wait with its end.

A request costs a few hundred nanoseconds; a log record costs microseconds. So
nothing here runs unless debug logging is on when the server starts: then
:func:`trace_requests` swaps the service's command table for one whose handlers
log around the real ones (grants, releases, refusals and waits are all a request
and its reply). At info and above the table is the plain one and the hot path
pays nothing, not even a level check.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import ParamSpec

from elockd.protocol import Connection, Deferred, Handler, Pending, Reply, Service, Streamed

log = logging.getLogger("elockd.requests")

SHOWN_ARGS = 200  # characters of a request's arguments in a record

P = ParamSpec("P")


def trace_requests(service: Service) -> None:
    """Log every request of an authenticated connection with its reply (debug)."""
    service.commands = {verb: traced(verb, handler) for verb, handler in service.commands.items()}


def _text(data: bytes, limit: int = SHOWN_ARGS) -> str:
    return data[:limit].decode(errors="backslashreplace")


def _first_line(reply: bytes) -> str:
    line, _, more = reply.partition(b"\r\n")
    return _text(line) + (" ..." if more else "")


def traced(verb: bytes, handler: Handler) -> Handler:
    """``handler`` that also logs the request, its reply, and for a request that
    waits, the start and the end of the wait."""
    name = verb.decode(errors="backslashreplace")

    def handle(conn: Connection, rest: bytes, now: float) -> Reply:
        reply = handler(conn, rest, now)
        fields: dict[str, object] = {
            "peer": _text(conn.peer),
            "verb": name,
            "arguments": _text(rest),
        }
        if isinstance(reply, bytes):
            log.debug("request", extra={**fields, "reply": _first_line(reply)})
        elif isinstance(reply, Streamed):
            log.debug("request", extra={**fields, "reply": "(streamed)"})
        elif isinstance(reply, Pending):
            log.debug("waiting", extra={**fields, "timeout": reply.timeout})
            reply.on_granted = _logging_end(reply.on_granted, fields)
            reply.on_refused = _logging_end(reply.on_refused, fields)
        elif isinstance(reply, Deferred):
            reply.run = _logging_settle(reply, fields)
        return reply

    return handle


def _logging_end(end: Callable[P, bytes], fields: dict[str, object]) -> Callable[P, bytes]:
    def logged(*args: P.args, **kwargs: P.kwargs) -> bytes:
        reply = end(*args, **kwargs)
        log.debug("wait ended", extra={**fields, "reply": _first_line(reply)})
        return reply

    return logged


def _logging_settle(
    deferred: Deferred, fields: dict[str, object]
) -> Callable[[], Awaitable[bytes | Streamed]]:
    run = deferred.run
    if deferred.waits:
        log.debug("waiting", extra=fields)

    async def logged() -> bytes | Streamed:
        reply = await run()
        shown = "(streamed)" if isinstance(reply, Streamed) else _first_line(reply)
        log.debug("wait ended" if deferred.waits else "request", extra={**fields, "reply": shown})
        return reply

    return logged
