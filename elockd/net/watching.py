"""A connection that became an event stream (``watch``, docs/protocol.md).

Once ``watch`` has been answered (``200 Watching``, the snapshot, ``SYNCED``) the
connection runs here until it ends. Two tasks share it:

* the *drainer* sends the watcher's unsent events (:class:`~elockd.engine.watchers.Watcher`),
  a batch of at most :data:`BATCH_BYTES` per send, waking when the engine reports
  one; the send timeout rules apply as to any reply;
* the *reader* only listens: any line ends the stream (``200 Bye``), the peer
  closing ends the connection. It never sends (a send is the drainer's alone; over
  a WebSocket a pong rides on the drainer's flush, or goes out itself when none
  runs).

The events are queued by the engine, not here: whatever the client does, the
server holds at most ``--watch-buffer`` bytes of them plus one batch in flight.
Past it the engine drops them and stops reporting to the watcher; the drainer
sends what it had in flight and ``OVERFLOW`` (within ``--send-timeout``, as any
reply), and the connection closes.

Events describe holds, so they pass the deadline gate (the service's ``stale``,
:func:`elockd.protocol.connection.gated`) before each send: a cluster node that can
no longer vouch for them (past its lease's local deadline, without a lease, or since
it lost its sessions after the stream began: the backend wakes its watchers when
that happens) sends ``409 Backend Unavailable``
in place of them, and the connection closes. A client watches again; a node that
cannot vouch refuses the new ``watch`` the same way until it can.

A hand-over's pause stops the stream between two sends: the connection parks with
its events still queued (and, on a socket, the bytes of a send cut short), and they
move with it to the successor (:mod:`elockd.handover.records`). Nothing is
reported meanwhile: the tables stand still.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import trio

from elockd.engine.watchers import OVERFLOW, Watcher
from elockd.handover.parked import Parked
from elockd.handover.pause import Interrupted, Pause
from elockd.protocol.connection import WORD, Connection

#: Bytes of events handed to the transport per send (a WebSocket message each).
BATCH_BYTES = 65536
BYE = b"200 Bye\r\n"


class End(enum.Enum):
    """Why a stream stopped."""

    GONE = enum.auto()  # the peer closed
    BYE = enum.auto()  # the peer sent a line
    OVERFLOWED = enum.auto()
    STALE = enum.auto()  # the deadline gate: the node can no longer vouch for them
    PAUSED = enum.auto()  # a hand-over's pause: park, then go on (or move)


async def serve_watch(conn: Connection, rest: Parked, pause: Pause[Parked]) -> None:
    """Stream ``conn``'s events until it ends; parks across a hand-over's pause."""
    watcher = conn.watcher
    assert watcher is not None
    transport = rest.transport
    while True:
        if pause.requested:
            await pause.park(rest)  # HandedOver: the successor streams on
            continue
        end = await _stream(watcher, rest, pause, conn.service.stale)
        if end is not End.PAUSED:
            break
    conn.closing = True
    if end is End.OVERFLOWED:
        await transport.send(OVERFLOW)
    elif end is End.BYE:
        await transport.send(BYE)
    elif end is End.STALE:
        await transport.send(WORD.unavailable)


async def _stream(
    watcher: Watcher, rest: Parked, pause: Pause[Parked], stale: Callable[[float], bool] | None
) -> End:
    """Run the reader and the drainer until one of them ends the stream. ``stale``:
    the deadline gate, asked before each wait and each send (None: never stale)."""
    end = End.GONE
    transport, reader = rest.transport, rest.reader
    since = trio.current_time()  # a loss of the node's sessions after this ends it

    def stop(why: End) -> None:
        nonlocal end
        end = why
        nursery.cancel_scope.cancel()

    async def read() -> None:
        while True:
            try:
                data = await transport.receive_beside()
            except Interrupted:
                return stop(End.PAUSED)
            if not data:
                return stop(End.GONE)
            if reader.feed(data):
                return stop(End.BYE)

    async def drain() -> None:
        while True:
            if watcher.overflowed:
                return stop(End.OVERFLOWED)
            if pause.requested:
                return stop(End.PAUSED)
            if stale is not None and stale(since):
                return stop(End.STALE)
            if not watcher.lines:
                woken = trio.Event()
                watcher.wake = woken.set
                try:
                    await woken.wait()
                finally:
                    watcher.wake = None
                continue
            batch = _batch(watcher)
            try:
                await transport.send(batch)
            finally:  # out of the watcher's lines either way: the transport has it
                watcher.sent(len(batch))
            await trio.lowlevel.checkpoint()  # a socket's send may not have yielded

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(drain)
    except BaseExceptionGroup as group:
        # One task's failure (the peer gone mid-send) is the connection's end, as
        # the request loop sees it: re-raised bare, not as a group.
        raise group.exceptions[0] from None
    return end


def _batch(watcher: Watcher) -> bytes:
    """Up to :data:`BATCH_BYTES` of the watcher's events (at least one), in order."""
    lines = watcher.lines
    size = count = 0
    for line in lines:
        size += len(line)
        count += 1
        if size >= BATCH_BYTES:
            break
    if count == len(lines):
        watcher.lines = []
    else:
        watcher.lines = lines[count:]
    return b"".join(lines[:count])
