"""The state a hand-over moves, as a stream of records (docs/upgrade.md).

Pure: no sockets, no clock. :func:`dump_state` walks the in-memory backend and the
parked connections and yields JSON-ready records a batch at a time, so the state is
never built whole a second time; :class:`Restorer` takes them in, in the same order,
and rebuilds the tables in a fresh backend.

Times move as durations: a hold's age, a lease's and a wait's time left, a grace's
time left. Each process has its own clock, and only "how long from now" means the
same in both. Bytes (keys, peers, names, unread requests) travel as latin-1
strings, which map every byte to one character and back.

Order is kept where the protocol shows it: the tables' key order (``d``), a shared
key's holders, every queue (FIFO grants), the arrival serials that keep ``mlock``
deadlock-free, the order names were set (``who``), and the order deadlines were
set, which decides what runs first when two fall due at the same instant.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from elockd.backend.memory import MemoryBackend
from elockd.engine.sessions import WAITING, Hold, Session, Waiter
from elockd.handover.parked import Parked
from elockd.handover.records import (
    SESSION_FIELDS,
    ConnectionState,
    Record,
    StateError,
    StateReader,
    batches,
    connection_records,
    raw,
    rebuild_connections,
    restore_service_counters,
    restored_session,
    service_counters,
    session_row,
    text,
    time_left,
)
from elockd.net.transport import Transport
from elockd.protocol.connection import Outcome, Service

__all__ = ["ConnectionState", "Restorer", "StateError", "dump_state"]

#: Holds per record (column by column, see _holds).
HOLDS_BATCH = 5000


Deadlined = Hold | Session | Waiter


def _deadline_order(engine: MemoryBackend) -> dict[Deadlined, int]:
    """When each live deadline was set, as the heap's tie-break count of its entry.

    Deadlines that fall due at the same instant run in the order they were set: a
    wait and the lease it waits for ending together time the waiter out, or grant it
    the key, by which came first; two leases ending together hand their keys to
    their waiters, and fencing tokens, in that order. The successor sets its
    deadlines again in this order, so the same one runs first. One pass over the
    heap, no sort: the successor sorts, after the pause's critical part."""
    heap = engine._deadlines
    order: dict[Deadlined, int] = {}
    for deadline, tiebreak, target in heap._heap:
        if heap.is_current(deadline, target) and tiebreak < order.get(target, tiebreak + 1):
            order[target] = tiebreak  # a target's first live entry is the one that runs
    return order


def _holds(
    kind: str, holds: Iterator[Hold], now: float, index: dict[Session, int], order: dict[Any, int]
) -> Iterator[Record]:
    """Holds in table order, a column per field: a million of them decode several
    times faster than as a million small rows (decoding bounds the pause). Keys are
    joined with newlines, which no key holds (a request is a line)."""
    while chunk := list(itertools.islice(holds, HOLDS_BATCH)):
        record: Record = {
            "t": kind,
            "keys": b"\n".join([h.key for h in chunk]).decode("latin-1"),
            "owners": [index[h.session] for h in chunk],
            "ages": [now - h.granted_at for h in chunk],
            # Sparse: [place in this record, time left, deadline order].
            "leases": [
                [place, h.lease_deadline - now, order.get(h)]
                for place, h in enumerate(chunk)
                if h.lease_deadline is not None
            ],
        }
        if kind == "exclusive":
            record["tokens"] = [h.token for h in chunk]
        yield record


def dump_state(
    service: Service, connections: list[ConnectionState], now: float
) -> Iterator[Record]:
    """The records of the whole state, in the order :class:`Restorer` reads them."""
    engine = service.backend
    if not isinstance(engine, MemoryBackend):
        raise StateError("only the in-memory backend's state moves")
    yield {
        "t": "engine",
        "next_token": engine._next_token,
        "orphans": engine.orphans,
        "shared_orphans": engine.shared_orphans,
        "expired": engine.expired,
        "timeouts": engine.timeouts,
        **service_counters(service),
    }
    index: dict[Session, int] = {}
    order = _deadline_order(engine)  # the last field of each row with a deadline

    def sessions() -> Iterator[list[Any]]:
        for session in engine.sessions.values():
            index[session] = len(index)
            yield [*session_row(session, now), order.get(session)]

    yield from batches("sessions", sessions())
    yield from _holds("exclusive", iter(engine.exclusive.values()), now, index, order)
    yield from _holds(
        "shared",
        (
            h
            for entry in engine.shared.values()
            for h in ([entry] if isinstance(entry, Hold) else list(entry.values()))
        ),
        now,
        index,
        order,
    )
    # Every waiting request, and those a parked connection still has to answer.
    waiters = {w for session in engine.sessions.values() for w in session.waiters}
    waiters.update(
        c.parked.backlog.pending.later.waiter  # type: ignore[attr-defined]
        for c in connections
        if c.parked.backlog.pending is not None
    )
    refs: dict[Waiter, int] = {}
    ordered = sorted(waiters, key=lambda w: w.serial)
    for waiter in ordered:
        refs[waiter] = len(refs)
    yield from batches(
        "waiters",
        (
            [
                w.serial,
                index[w.session],
                [text(k) for k in w.keys],
                w.shared,
                w.limit,
                w.ttl,
                now - w.since,
                time_left(w.deadline, now) if w.state == WAITING else None,
                [text(k) for k in w.taken],
                w.missing,
                w.count,
                w.state,
                order.get(w) if w.state == WAITING else None,
            ]
            for w in ordered
        ),
    )
    yield from batches(
        "queues",
        (
            [table, text(key), [refs[w] for w in queue]]
            for table, queues in (("x", engine._xqueues), ("s", engine._squeues))
            for key, queue in queues.items()
        ),
    )
    yield from batches("ending", ([index[session], why] for session, why in engine._ending))
    # The next arrival serial (taking one from the counter costs nothing: serials
    # only need to grow).
    yield {"t": "engine_tail", "next_arrival": next(engine._arrivals)}

    def pending_ref(outcome: Outcome, session: Session) -> int:
        return refs[outcome.later.waiter]  # type: ignore[attr-defined]

    yield from connection_records(service, connections, index, pending_ref)
    yield {"t": "end"}


class Restorer(StateReader):
    """Rebuilds the state into a fresh service's in-memory backend, record by record.

    :meth:`feed` each record in order; :meth:`connections` then gives the
    connections to serve, given a transport for each socket."""

    def __init__(self, service: Service, now: float) -> None:
        engine = service.backend
        if not isinstance(engine, MemoryBackend):
            raise StateError("only the in-memory backend takes a state over")
        if engine.sessions:
            raise StateError("the backend already has sessions")
        super().__init__(service, now)
        self.engine = engine
        self.sessions: list[Session] = []
        self.waiters: list[Waiter] = []
        # (order, deadline, target): set once every table is in, in the old order.
        self.deadlines: list[tuple[int | None, float, Deadlined]] = []

    # Each record kind, in stream order.

    def _engine(self, record: Record) -> None:
        engine = self.engine
        engine._next_token = max(engine._next_token, int(record["next_token"]))
        engine.orphans = record["orphans"]
        engine.shared_orphans = record["shared_orphans"]
        engine.expired = record["expired"]
        engine.timeouts = record["timeouts"]
        restore_service_counters(self.service, record)

    def _sessions(self, record: Record) -> None:
        engine, now = self.engine, self.now
        for row in record["rows"]:
            session, grace_deadline = restored_session(Session, row, now)
            (order,) = row[SESSION_FIELDS:]
            engine.sessions[session.id] = session
            if not session.connected:
                engine.detached += 1
            if grace_deadline is not None:
                engine.sessions_in_grace += 1
                session.grace_deadline = grace_deadline
                self.deadlines.append((order, grace_deadline, session))
            self.sessions.append(session)

    def _columns(self, record: Record, *fields: str) -> tuple[list[bytes], list[list[Any]]]:
        keys = raw(record["keys"]).split(b"\n")
        columns = [record[field] for field in fields]
        if any(len(column) != len(keys) for column in columns):
            raise StateError(f"a {record['t']} record with columns of different lengths")
        return keys, columns

    def _leases(self, record: Record, holds: list[Hold]) -> None:
        now = self.now
        for place, left, order in record["leases"]:
            self.deadlines.append((order, now + left, holds[place]))

    def _exclusive(self, record: Record) -> None:
        now, sessions, table = self.now, self.sessions, self.engine.exclusive
        keys, (owners, tokens, ages) = self._columns(record, "owners", "tokens", "ages")
        holds = []
        for key, owner, token, age in zip(keys, owners, tokens, ages, strict=True):
            session = sessions[owner]
            hold = Hold(session, key, False, token, now - age)
            table[key] = hold
            session.exclusive[key] = hold
            holds.append(hold)
        self._leases(record, holds)

    def _shared(self, record: Record) -> None:
        engine, now, sessions, table = self.engine, self.now, self.sessions, self.engine.shared
        keys, (owners, ages) = self._columns(record, "owners", "ages")
        holds = []
        for key, owner, age in zip(keys, owners, ages, strict=True):
            session = sessions[owner]
            hold = Hold(session, key, True, 0, now - age)
            entry = table.get(key)
            if entry is None:
                table[key] = hold
            elif isinstance(entry, Hold):
                table[key] = {entry.session: entry, session: hold}
            else:
                entry[session] = hold
            session.shared[key] = hold
            holds.append(hold)
        engine.shared_holders += len(holds)
        self._leases(record, holds)

    def _waiters(self, record: Record) -> None:
        engine, now = self.engine, self.now
        for row in record["rows"]:
            *fields, order = row
            serial, owner, keys, shared, limit, ttl, waited, left, taken, missing, count, state = (
                fields
            )
            session = self.sessions[owner]
            waiter = Waiter(
                session,
                tuple(raw(k) for k in keys),
                shared=shared,
                limit=limit,
                ttl=ttl,
                since=now - waited,
            )
            waiter.serial = serial
            waiter.taken = [raw(k) for k in taken]
            waiter.missing = missing
            waiter.count = count
            waiter.state = state
            if state == WAITING:
                session.waiters.add(waiter)
                engine.waiting += 1
                if left is not None:
                    waiter.deadline = now + left
                    self.deadlines.append((order, waiter.deadline, waiter))
            self.waiters.append(waiter)

    def _queues(self, record: Record) -> None:
        engine = self.engine
        for table, key, refs in record["rows"]:
            queues = engine._xqueues if table == "x" else engine._squeues
            queue = queues.setdefault(raw(key), OrderedDict())
            for ref in refs:
                queue[self.waiters[ref]] = None

    def _ending(self, record: Record) -> None:
        for owner, why in record["rows"]:
            session = self.sessions[owner]
            session.ending = True
            self.engine._ending.append((session, why))

    def _engine_tail(self, record: Record) -> None:
        self.engine._arrivals = itertools.count(record["next_arrival"])
        # Every deadline, in the order the old process set them (_deadline_order).
        self.deadlines.sort(key=lambda entry: math.inf if entry[0] is None else entry[0])
        for _, deadline, target in self.deadlines:
            if isinstance(target, Hold):
                self.engine.set_lease(target, deadline)
            else:
                self.engine.schedule(deadline, target)
        self.deadlines = []
        if self.engine._ending and self.engine.on_new_deadline is not None:
            self.engine.on_new_deadline()

    # ------------------------------------------------------------------ the end

    def connections(self, transports: dict[int, Transport]) -> list[Parked]:
        """The connections to serve on, one per socket in ``transports`` (keyed by
        the fd index of the state); the sessions of connections whose socket could
        not move are disconnected now, by their usual rules."""
        if not self.ended:
            raise StateError("the state ended early")
        engine = self.engine
        served, gone = rebuild_connections(
            self.service,
            self.records,
            transports,
            self.sessions,
            lambda ref: engine.later_for(self.waiters[ref]),
        )
        for session in gone:
            engine.disconnect(session, self.now)
        return served

    def counts(self) -> tuple[int, int]:
        engine = self.engine
        return len(engine.sessions), len(engine.exclusive) + engine.shared_holders
