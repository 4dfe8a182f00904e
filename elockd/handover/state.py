"""The state a hand-over moves, as a stream of records (docs/upgrade.md).

Pure: no sockets, no clock. :func:`dump_state` asks the backend for its tables
(:meth:`~elockd.backend.interface.Backend.dump`), adds the service's counters to the
backend's first record and the parked connections after its last, and yields
JSON-ready records a batch at a time, so the state is never built whole a second
time. :class:`Restorer` takes them in, in the same order: the backend's records go
to the fresh backend's :meth:`~elockd.backend.interface.Backend.restore`, the rest
rebuild the connections. Neither looks inside the tables, which are the
backend's own (:mod:`elockd.backend.memory_state`, :mod:`elockd.backend.cluster.state`).
"""

from __future__ import annotations

from collections.abc import Iterator

from elockd.backend.state import Record, StateError
from elockd.engine.sessions import Session
from elockd.handover.parked import Parked
from elockd.handover.records import (
    ConnectionState,
    connection_records,
    rebuild_connections,
    restore_service_counters,
    service_counters,
)
from elockd.net.transport import Transport
from elockd.protocol.connection import Outcome, Service

__all__ = ["ConnectionState", "Record", "Restorer", "StateError", "dump_state"]


def dump_state(
    service: Service, connections: list[ConnectionState], now: float
) -> Iterator[Record]:
    """The records of the whole state, in the order :class:`Restorer` reads them."""
    pending = [
        (state.parked.conn.session, state.parked.backlog.pending.later)
        for state in connections
        if state.parked.backlog.pending is not None and state.parked.conn is not None
    ]
    tables = service.backend.dump(now, pending)
    records = tables.records()
    yield {**next(records), **service_counters(service)}
    yield from records

    def pending_ref(outcome: Outcome, session: Session) -> int:
        return tables.pending_ref(outcome.later, session)

    yield from connection_records(service, connections, tables.places, pending_ref)
    yield {"t": "end"}


class Restorer:
    """Rebuilds the state into a fresh service, record by record.

    :meth:`feed` each record in order; :meth:`connections` then gives the
    connections to serve, given a transport for each socket."""

    def __init__(self, service: Service, now: float) -> None:
        self.service = service
        self.now = now
        self.tables = service.backend.restore(now)
        self.records: list[Record] = []  # the connection records, for connections()
        self.first = True
        self.ended = False

    def feed(self, record: Record) -> None:
        kind = record.get("t")
        if self.ended:
            raise StateError(f"unexpected record {kind!r}")
        if kind == "connections":
            self.records.extend(record["rows"])
        elif kind == "end":
            self.ended = True
        else:
            self.tables.feed(record)
            if self.first:  # the backend's header carries the service's counters too
                restore_service_counters(self.service, record)
        self.first = False

    def connections(self, transports: dict[int, Transport]) -> list[Parked]:
        """The connections to serve on, one per socket in ``transports`` (keyed by
        the fd index of the state); the sessions of connections whose socket could
        not move end by the backend's usual rules."""
        if not self.ended:
            raise StateError("the state ended early")
        tables = self.tables
        served, gone = rebuild_connections(
            self.service, self.records, transports, tables.sessions, tables.pending
        )
        tables.finish(gone)
        return served

    def counts(self) -> tuple[int, int]:
        """Sessions and holds taken over, for the log line."""
        return self.tables.counts()
