"""One client connection, served to its end: the per-connection loop.

A connection task reads bytes, hands every complete line of the chunk to its
sans-IO :class:`~elockd.protocol.connection.Connection`, and sends all the replies of the chunk
in one write. Only a reply that is not ready breaks that rhythm (:func:`deliver`):
replies before it are flushed, then the task waits for the grant, the timeout, the
backend's answer or the peer going away. A reply that grows with the tables (a dump)
is sent a chunk at a time, each made only once the one before went out.

The loop knows nothing of sockets: TCP, TLS, Unix sockets and WebSocket sessions all
run it over a :class:`~elockd.net.transport.Transport`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from functools import cached_property

import trio

from elockd.backend.interface import REFUSALS
from elockd.handover.parked import Backlog, Parked
from elockd.handover.pause import HandedOver, Interrupted, Pause
from elockd.net.tcp_silence import LATE_REPLY
from elockd.net.transport import Transport
from elockd.net.watching import BYE, serve_watch
from elockd.observe.logs import log_connection_close, log_connection_error, log_connection_open
from elockd.protocol.connection import (
    Connection,
    Delayed,
    Outcome,
    Reply,
    Reports,
    Service,
    Streamed,
)
from elockd.protocol.framing import LineReader

#: Replies of one received chunk are sent once they reach this many bytes, not only
#: at the end of the chunk. A 64 KiB chunk of ``d\n`` is 32,768 dumps: buffering
#: all their replies before one write would cost gigabytes and stall every other
#: connection; flushing (and yielding) at this size bounds both.
REPLY_FLUSH_BYTES = 65536


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets (``[::1]:9999``): how peers and
    listening addresses are named, in replies and in the log."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PausableService(Service):
    """The request layer's :class:`~elockd.protocol.connection.Service` as a server
    runs it: with the switch that stops every connection between two requests for a
    hand-over (:mod:`elockd.handover.pause`). The pause is trio's and the hand-over's
    business, so the sans-IO service does not carry it."""

    @cached_property
    def pause(self) -> Pause[Parked]:
        return Pause()


def peer_name(address: object) -> bytes:
    """``IP:PORT`` for TCP peers (``[IP]:PORT`` for IPv6); ``unix`` otherwise."""
    if isinstance(address, tuple) and len(address) >= 2:
        return host_port(address[0], address[1]).encode()
    return b"unix"


async def serve_connection(
    service: PausableService,
    transport: Transport,
    peer: bytes,
    resumed: Parked | None = None,
    counted: bool = False,
) -> None:
    """Run one client connection to its end, then free its session per its rules.

    ``resumed`` is a connection taken over from a predecessor (docs/upgrade.md): its
    session, reader state and backlog of requests are served on as they were. A
    connection handed over to a successor ends here without closing anything.
    ``counted``: the accept loop already counted it in ``connections``."""
    pause = service.pause
    transport.pause = pause
    if resumed is None:
        rest = Parked(None, LineReader(service.config.max_line), transport, peer, Backlog())
        if pause.requested:  # accepted just before a hand-over: nothing handled yet
            try:
                await pause.park(rest)
            except BaseException as error:
                if counted:  # no Connection will take the count over
                    service.counters.connections -= 1
                if isinstance(error, HandedOver):
                    return
                raise
        log_connection_open(peer)
        rest.conn = Connection(service, peer, counted=counted)
    else:
        rest = resumed
        if rest.conn is None:
            rest.conn = Connection(service, peer)
    conn = rest.conn
    transport.rest = rest
    handed_over = False
    try:
        # The backend may end the connection (its session was lost) through abort.
        with trio.CancelScope() as ended:
            conn.set_abort(ended.cancel)
            await _serve_requests(conn, rest, pause, service.config.idle_timeout)
    except trio.BrokenResourceError:
        pass  # the peer is gone; nothing to tell it
    except HandedOver:
        handed_over = True  # the successor serves it now: its socket and session stay
    except Exception as error:  # a bug must end this connection, never the server
        log_connection_error(peer, error)
    finally:
        # Once the service was handed over, nothing here is ours to close: a
        # connection that could not move (TLS) ends with this process.
        if not handed_over and not pause.handed_over:
            conn.close(trio.current_time())
            # The transport and its resting state point at each other: break the
            # cycle, so that the connection is freed now by its reference counts
            # and not by a collection the raised GC thresholds rarely run.
            transport.rest = None
            await transport.aclose()
            log_connection_close(peer)


async def _serve_requests(
    conn: Connection, rest: Parked, pause: Pause[Parked], idle_timeout: float | None
) -> None:
    """Read, answer and write until the peer leaves or asks to close.

    The fast path: every complete line of a received chunk is answered at once, and
    the replies go out in one write. Three things end such a run of replies early,
    each after that one write: a reply that is not ready (a wait, the backend's
    I/O, a dump: :func:`deliver` sends it, so replies stay in order), the replies
    reaching :data:`REPLY_FLUSH_BYTES` (then other connections run), and a
    hand-over's pause (:mod:`elockd.handover.pause`): the connection parks between
    two requests with what is left of the chunk, and a request still waiting, as its
    backlog (:mod:`elockd.handover.parked`). After a failed hand-over it goes on
    with the backlog first."""
    reports = conn.service.reports
    reader, transport, backlog = rest.reader, rest.transport, rest.backlog
    if conn.watcher is not None:  # a watch stream taken over from a predecessor
        await serve_watch(conn, rest, pause)
        return
    while not conn.closing:
        if backlog.pending is not None:
            delivered = await deliver(backlog.pending, transport, reports=reports)
            if delivered is None:
                await pause.park(rest)  # the request still waits in the engine
                continue
            backlog.pending = None
            if not delivered:
                return
            if conn.closing:
                break
        if backlog.lines:
            lines = backlog.take()
        else:
            try:
                if idle_timeout is None:
                    data = await transport.receive()
                else:
                    data = b""  # stays empty when the idle timeout ends the connection
                    with trio.move_on_after(idle_timeout):
                        data = await transport.receive()
                    if not data and pause.requested:
                        raise Interrupted  # it went idle too long during a hand-over
            except Interrupted:
                await pause.park(rest)
                continue
            if not data:
                break
            lines = reader.feed(data)
            del data  # nothing of a chunk outlives it (see the end of the loop)
        now = trio.current_time()
        requests = enumerate(lines, 1)  # each line with the index of the one after it
        more = True
        while more:
            more = False
            replies: list[bytes] = []
            buffered = 0
            for after, line in requests:  # noqa: B007 (read once the loop breaks)
                reply = conn.handle(line, now)
                if isinstance(reply, bytes):
                    if reply:  # glockd's dialect answers some requests with nothing at all
                        replies.append(reply)
                        buffered += len(reply)
                    if not (conn.closing or pause.requested or buffered >= REPLY_FLUSH_BYTES):
                        continue
                more = True  # answered up to here; the rest of the chunk waits
                break
            if replies:
                await transport.send(b"".join(replies))  # the one write of this run
            if not more:
                break
            if not isinstance(reply, bytes):
                # While the reply is awaited, the connection rests with the rest of
                # the chunk (and this request, if it waits) as its backlog.
                backlog.awaiting(reply, lines, after)
                delivered = await deliver(reply, transport, now, reports=reports)
                if delivered is None:  # paused while the request waits for its grant
                    await pause.park(rest)
                    break
                backlog.answered()
                if not delivered:
                    return  # the client left while its request waited
                if conn.watcher is not None and not conn.closing:  # `watch`: a stream now
                    if after < len(lines):
                        await transport.send(BYE)  # a line after watch ends it at once
                        return
                    del lines, requests, replies
                    await serve_watch(conn, rest, pause)
                    return
            elif buffered >= REPLY_FLUSH_BYTES and not conn.closing:
                # Backpressure from a client that does not read starts here, and
                # the checkpoint lets other connections run between batches.
                await trio.lowlevel.checkpoint()
            if conn.closing:
                break
            now = trio.current_time()
            if pause.requested:
                await rest.park_between(pause, lines, after)
                break
        # The chunk's lines and replies are dropped before the next read: an idle
        # connection would otherwise keep its last chunk (100 pipelined requests
        # are ~6 KiB, 57 bytes per lock on the hold row) for as long as it idles.
        del lines, requests, replies


async def deliver(
    reply: Reply, transport: Transport, asked: float = -math.inf, *, reports: Reports
) -> bool | None:
    """Send a reply that was not ready at once; False when the client went away while
    its request waited (its session's disconnect then cancels the wait), None when a
    hand-over's pause came first (the request still waits in the engine, or was
    granted but not answered: either way the reply is whoever serves it next's).

    ``asked`` is when the request was read (unknown for one resumed after a
    hand-over): a reply :data:`~elockd.net.tcp_silence.LATE_REPLY` or more after it
    tells the transport, so that a client whose host vanished while it waited is
    given up on within the keepalive bound of its last word, not of the grant.
    ``reports``: where a refusal at a limit is reported."""
    if isinstance(reply, Outcome):
        try:
            settled = await settle(reply, transport, reports)
        except Interrupted:
            return None
        if settled is None:
            return False
        if reply.waits and transport.pause.requested:
            return None  # granted while the connection counted as at rest
        reply = settled
    elif isinstance(reply, Delayed):
        await trio.sleep(reply.seconds)
        reply = reply.reply
    if trio.current_time() - asked >= LATE_REPLY:
        transport.replying_late()
    if isinstance(reply, Streamed):
        await send_streamed(reply, transport)
    elif reply:  # glockd's dialect answers some requests with nothing at all
        assert isinstance(reply, bytes)
        await transport.send(reply)
    return True


async def answered(outcome: Outcome, reports: Reports) -> bytes | Streamed:
    """An outcome's reply once the backend has answered: the request layer's
    ``finish``, or its family's refusal when the backend refused (a limit, or etcd
    without quorum). The request layer never awaits; this is where it is done."""
    return (await fetched(outcome, reports))()


async def fetched(outcome: Outcome, reports: Reports) -> Callable[[], bytes | Streamed]:
    """The backend's answer to ``outcome``, as what makes its reply: called after
    the request's last await, so that the reply (and the deadline gate in its
    ``finish``) comes after every await, not before one."""
    try:
        value = await outcome.later.run()
    except REFUSALS as error:
        refusal = outcome.family.refusal(error, outcome.peer, reports)
        return lambda: refusal
    return lambda: outcome.finish(value)


async def settle(
    outcome: Outcome, transport: Transport, reports: Reports
) -> bytes | Streamed | None:
    """An outcome's reply. One that waits for a grant is raced against the client
    going away, and abandoned (None) if it does first; a hand-over's pause interrupts
    it (:class:`~elockd.handover.pause.Interrupted`) and leaves the request waiting."""
    if not outcome.waits:
        return await answered(outcome, reports)
    make: Callable[[], bytes | Streamed] | None = None
    interrupted = False

    async def run() -> None:
        nonlocal make
        make = await fetched(outcome, reports)
        nursery.cancel_scope.cancel()

    async def watch_peer() -> None:
        nonlocal interrupted
        try:
            await transport.watch_for_close()
        except Interrupted:
            interrupted = True
        except trio.BrokenResourceError:
            # A send while watching failed (a WebSocket pong, unsent bytes carried
            # through a hand-over): the peer is gone, as if it had hung up. Raised
            # from here it would leave this nursery as an exception group, which no
            # handler expects, and end the whole server.
            pass
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        nursery.start_soon(watch_peer)
    if interrupted and make is None:
        raise Interrupted
    # Made here, after the nursery's last await (its close waits for the peer
    # watcher to stop): a grant's reply passes the deadline gate after it.
    return None if make is None else make()


async def send_streamed(reply: Streamed, transport: Transport) -> None:
    """Send a streamed reply a chunk at a time: the next chunk is made only after the
    last one went out (a client that does not read stops the dump, not the server),
    and other connections run between chunks."""
    await transport.send_stream(reply.chunks)


class ConnectionSlots:
    """Connections counted from accept to the end of their task, across listeners.

    ``--max-connections`` is checked against this, not against the connections
    the protocol layer counts: the accept loop takes every pending connection of a
    burst before any new task runs (so that count would still be stale), and a TLS
    connection exists for up to ``--handshake-timeout`` before its session does.
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    async def run(self, serve: Callable[..., Awaitable[None]], *args: object) -> None:
        """Run one connection's task; its slot is free again when it ends."""
        try:
            await serve(*args)
        finally:
            self.used -= 1
