"""``elockctl watch [PREFIX]``: every grant and free under PREFIX, one line each,
stamped with the time it arrived, until Ctrl-C (exit 0) or the server ends it.

After ``200 Watching`` the connection is an event stream, not request and reply,
so the clients' request queue cannot carry it: this opens the connection the way
the trio client does (TCP, Unix socket, TLS or a WebSocket, the same options),
then reads the replies to ``auth`` and ``watch`` with the client's strict reply
reader and the events as lines. Exit statuses:

* 0 after Ctrl-C (quietly: stopping a watch is how a watch ends);
* 1 when the server sends ``OVERFLOW`` (this reader fell more than the server's
  ``--watch-buffer`` behind) and closes: one line says so;
* 3 when it cannot tell: no server, a token wanted or refused, ``413 Too Many
  Watchers``, the connection lost, or ``409 Backend Unavailable`` (a cluster node
  that can no longer vouch for its lock table refuses the watch, or ends it so).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

import trio

from elockd.client import AuthError, Client, ConnectionLost, RequestError
from elockd.client.base import describe
from elockd.client.core import AUTH_REFUSALS, BACKEND_UNAVAILABLE, auth_line, encode_key, printable
from elockd.client.errors import ReplyTimeout
from elockd.client.replies import ReplyReader
from elockd.ctl.status import EXIT_ERROR, EXIT_FALSE, say, where

#: The longest event line taken (a key and an owner name are far shorter).
MAX_EVENT_LINE = 1 << 20


def stamp(moment: datetime | None = None) -> str:
    """ISO-8601 UTC with milliseconds: ``2025-03-01T03:04:05.678Z``."""
    moment = moment or datetime.now(UTC)
    return (
        moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    )


class EventStream:
    """One connection read as replies first, then as event lines."""

    def __init__(self, stream: trio.abc.Stream, server: str) -> None:
        self.stream = stream
        self.server = server
        self.reader = ReplyReader()

    async def _more(self) -> bool:
        data = await self.stream.receive_some(65536)
        if not data:
            return False
        self.reader.feed(bytes(data))
        return True

    async def request(self, line: bytes, timeout: float) -> bytes:
        """Send one request line and read its one-line reply, strictly."""
        await self.stream.send_all(line + b"\n")
        with trio.fail_after(timeout):
            while True:
                reply = self.reader.take_reply(multiline=False)
                if reply is not None:
                    return reply[0]
                if not await self._more():
                    raise ConnectionLost(f"{self.server} closed the connection")

    async def event(self) -> bytes | None:
        """The next event line without ``\\r\\n``; None when the server closed."""
        buffer = self.reader.buffer
        while (cut := buffer.find(b"\n")) < 0:
            if len(buffer) > MAX_EVENT_LINE:
                raise ConnectionLost(f"{self.server}: an event line over {MAX_EVENT_LINE} bytes")
            if not await self._more():
                return None
        return buffer.take(cut + 1).rstrip(b"\r\n")


async def watch(args: argparse.Namespace, options: dict[str, Any]) -> int:
    server = where(options)
    async with trio.open_nursery() as nursery:  # a WebSocket's tasks run here
        # The trio client's own opening: TCP, Unix, TLS and WebSocket mean exactly
        # what they mean there, and fail in the same words.
        stream = await Client(**options)._connect_stream(nursery)
        try:
            status = await follow(EventStream(stream, server), args.prefix, options)
        except trio.TooSlowError as error:
            raise ReplyTimeout(f"{server}: no reply in time") from error
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            raise ConnectionLost(f"connection to {server}: {describe(error)}") from error
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            nursery.cancel_scope.cancel()
    return status


async def follow(events: EventStream, prefix: str | None, options: dict[str, Any]) -> int:
    """``auth`` when a token is given, ``watch``, then the events until the end."""
    timeout = options["reply_timeout"]
    # The first request goes after a blank, as the clients send it: a port that
    # speaks HTTP or TLS refuses it at once (elockd drops the blank).
    first = b" "
    if options.get("auth_token") is not None:
        reply = await events.request(first + auth_line(options["auth_token"]), timeout)
        if reply != b"200 OK":
            raise AuthError(f"auth: {printable(reply)}", reply)
        first = b""
    request = b"watch" + (b" " + encode_key(prefix) if prefix else b"")
    reply = await events.request(first + request, timeout)
    if reply in AUTH_REFUSALS:
        raise AuthError(f"watch: {printable(reply)}", reply)
    if reply != b"200 Watching":
        raise RequestError(f"watch: {printable(reply)}", reply)
    return await print_events(events, events.server)


async def print_events(events: EventStream, server: str) -> int:
    out = sys.stdout
    while True:
        line = await events.event()
        if line is None:
            raise ConnectionLost(f"{server} ended the watch: connection lost")
        if line == b"OVERFLOW":
            say(
                f"{server}: the server ended the watch: OVERFLOW (this reader fell more "
                "than the server's --watch-buffer behind; watch a narrower PREFIX)"
            )
            return EXIT_FALSE
        if line == BACKEND_UNAVAILABLE:
            say(
                f"{server}: the server ended the watch: {printable(line)} (a cluster node "
                "that can no longer vouch for its lock table: cut off from etcd?)"
            )
            return EXIT_ERROR
        out.write(f"{stamp()} {printable(line)}\n")
        out.flush()


def run_watch(args: argparse.Namespace, options: dict[str, Any]) -> int:
    return trio.run(watch, args, options)
