"""What every hand-over state has, whichever backend's tables it carries.

The stream's version, the service's own counters and histograms, and the parked
connections: each with its socket's place among the descriptors sent along, its
session, its reader, its backlog of requests and the waiting request it still has
to answer. The record format (record kinds, batches, bytes as latin-1 text) and
the tables are the backend's: :mod:`elockd.backend.state`, and each backend's
``dump`` and ``restore`` (:mod:`elockd.backend.memory_state` for the in-memory
engine, :mod:`elockd.backend.cluster.state` for a cluster node's books).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from elockd.backend.interface import Later
from elockd.backend.state import Record, StateError, raw, text
from elockd.engine.sessions import Session
from elockd.engine.watchers import Watcher
from elockd.handover.parked import Backlog, Parked
from elockd.net.transport import Transport
from elockd.protocol.commands import COMMANDS
from elockd.protocol.connection import WORD, Connection, Outcome, Service, gated
from elockd.protocol.framing import LineReader

#: What the stream is, the version of it this code writes, and the versions it
#: reads. An old server refuses a successor that does not read its version, and a
#: successor refuses a version it does not read; either way the old server serves
#: on. Version 2 added the replies a connection still owes (``unsent``): a successor
#: that would drop them unread must not take the state, so a version-1 successor is
#: refused. A version-1 state is a version-2 one without them. Version 3 added a
#: ``watch`` stream's prefix and unsent events (``watch``), for the same reason.
FORMAT = "elockd-state"
VERSION = 3
READABLE = (1, 2, 3)

#: Connections per record: each brings its socket, and one message carries at most
#: 253 descriptors (SCM_MAX_FD).
CONNECTIONS_BATCH = 250


# ------------------------------------------------------------------ the service


def service_counters(service: Service) -> Record:
    """The fields of the first record that are the service's, not the backend's."""
    counters, timings = service.counters, service.timings
    return {
        "commands": {text(verb): count for verb, count in counters.commands.items()},
        "invalid_commands": counters.invalid_commands,
        "handovers": counters.handovers,
        "timings": {
            kind: [[b.counts, b.sum] for b in buckets]
            for kind, buckets in (("wait", timings.wait), ("hold", timings.hold))
        },
    }


def restore_service_counters(service: Service, record: Record) -> None:
    """The service's counters as the old process had them, with this hand-over counted."""
    counters, timings = service.counters, service.timings
    for verb, count in record["commands"].items():
        if raw(verb) in counters.commands:
            counters.commands[raw(verb)] = count
    counters.invalid_commands = record["invalid_commands"]
    counters.handovers = record["handovers"] + 1
    for kind, buckets in (("wait", timings.wait), ("hold", timings.hold)):
        for target, (counts, total) in zip(buckets, record["timings"][kind], strict=True):
            if len(counts) != len(target.counts):
                raise StateError(f"{kind} histogram has other buckets")
            target.counts[:] = counts
            target.sum = total


# ---------------------------------------------------------------- connections


@dataclass
class ConnectionState:
    """A parked connection as the state names it: ``fd`` is its place among the
    sockets sent along, or None when its socket cannot move (TLS, WebSocket)."""

    parked: Parked
    fd: int | None


#: The waiting request a connection (of the session given) still has to answer, as
#: the backend's tables name it: its place in the backend's list of waits.
PendingRef = Callable[[Outcome, Session], int]


def connection_records(
    service: Service,
    connections: Sequence[ConnectionState],
    session_index: dict[Session, int],
    pending_ref: PendingRef,
) -> Iterator[Record]:
    """Every parked connection, a batch at a time, in the order of ``connections``
    (each movable one's socket goes along with its batch)."""
    named = {conn: place for place, conn in enumerate(service.named)}
    # A waiting request's reply is named by its verb (the table says how each words it).
    finish_names: dict[object, str] = {
        command.wait_reply: verb.decode()
        for verb, command in COMMANDS.items()
        if command.wait_reply is not None
    }
    rows: list[Record] = []
    for state in connections:
        parked = state.parked
        conn, backlog, reader = parked.conn, parked.backlog, parked.reader
        pending = None
        if backlog.pending is not None and conn is not None:
            ref = pending_ref(backlog.pending, conn.session)
            # inspect.unwrap: with --log-level debug the reply's wording is traced.
            pending = [ref, finish_names[inspect.unwrap(backlog.pending.finish)]]
        partial, discarding = reader.unread()
        rows.append(
            {
                "fd": state.fd,
                "session": None if conn is None else session_index[conn.session],
                "peer": text(parked.peer),
                "authenticated": conn is None or conn.authenticated,
                "admin": conn is not None and conn.admin,
                "named": None if conn is None else named.get(conn),
                "pending": pending,
                "lines": [None if line is None else text(line) for line in backlog.remaining()],
                "partial": text(partial),
                "discarding": discarding,
                "read_ahead": text(getattr(parked.transport, "read_ahead", b"")),
                # Replies it owes a client that was not reading when the pause came:
                # they go out before anything else.
                "unsent": text(bytes(getattr(parked.transport, "unsent", b""))),
                "watch": None if conn is None else watch_row(conn.watcher),
            }
        )
        if len(rows) == CONNECTIONS_BATCH:
            yield {"t": "connections", "rows": rows}
            rows = []
    if rows:
        yield {"t": "connections", "rows": rows}


def watch_row(watcher: Watcher | None) -> list[str] | None:
    """A ``watch`` stream's prefix and its events not yet sent (the connection parks
    only between two sends, after its snapshot, so that is all it has)."""
    if watcher is None:
        return None
    return [text(watcher.prefix), text(b"".join(watcher.lines))]


def watch_restored(service: Service, row: list[str]) -> Watcher:
    """The watcher of a moved ``watch`` stream, registered again with its unsent
    events first: the tables stood still since, so it misses nothing and gets
    nothing twice. It counts against ``--max-watchers`` but is never refused."""
    prefix, unsent = raw(row[0]), raw(row[1])
    watcher = Watcher(prefix, service.config.watch_buffer)
    if unsent:
        watcher.lines.append(unsent)
        watcher.unsent = len(unsent)
    service.backend.books.watchers.adopt(watcher)
    return watcher


def rebuild_connections(
    service: Service,
    records: list[Record],
    transports: dict[int, Transport],
    sessions: list[Session],
    pending_later: Callable[[int], Later[Any]],
) -> tuple[list[Parked], list[Session]]:
    """The connections to serve on, one per socket in ``transports`` (keyed by the
    fd index of the state), and the sessions whose connection did not come (its
    socket could not move): the caller disconnects those by their usual rules."""
    served: list[Parked] = []
    named: list[tuple[int, Connection]] = []
    for record in records:
        owner = record["session"]
        fd = record["fd"]
        if fd is None or fd not in transports:
            continue
        session = None if owner is None else sessions[owner]
        peer = raw(record["peer"])
        conn = None
        backlog = Backlog(lines=[None if x is None else raw(x) for x in record["lines"]])
        if session is not None:
            conn = Connection(service, peer, session)
            if record["authenticated"]:
                conn.authenticate()
            # None in a state from before kill. A successor started without
            # --admin-token-file lets no connection kill, a moved one included.
            conn.admin = bool(record.get("admin")) and service.admin_token is not None
            if record["named"] is not None:
                named.append((record["named"], conn))
            if record["pending"] is not None:
                ref, reply = record["pending"]
                finish = COMMANDS[reply.encode()].wait_reply
                if finish is None:
                    raise StateError(f"a waiting request of a verb that never waits: {reply}")
                pending = Outcome(pending_later(ref), finish, WORD, peer)
                if service.stale is not None:  # a grant is about a hold: the gate
                    # Read anew here: only a loss on this node counts from now on.
                    gated(pending, WORD, service.stale, trio.current_time(), conn)
                backlog.pending = pending
        reader = LineReader(service.config.max_line)
        reader.resume(raw(record["partial"]), record["discarding"])
        transport = transports[fd]
        transport.read_ahead = raw(record["read_ahead"])  # type: ignore[attr-defined]
        if record.get("unsent"):  # none in a version-1 state
            transport.unsent[:] = raw(record["unsent"])  # type: ignore[attr-defined]
        if conn is not None and record.get("watch") is not None:  # none before version 3
            conn.watcher = watch_restored(service, record["watch"])
        served.append(Parked(conn, reader, transport, peer, backlog))
    for _, conn in sorted(named, key=lambda pair: pair[0]):
        service.named[conn] = None
    # Sessions that were connected but came without a connection: treated as a
    # connection that closed at the hand-over.
    served_sessions = {id(p.conn.session) for p in served if p.conn is not None}
    gone = [s for s in sessions if s.connected and id(s) not in served_sessions]
    return served, gone
