"""The in-memory engine's tables as a hand-over moves them (docs/upgrade.md).

:class:`MemoryDump` walks the engine's tables and yields JSON-ready records a batch
at a time, so the state is never built whole a second time; :class:`MemoryRestore`
takes them in, in the same order, and rebuilds the tables in a fresh engine. The
hand-over (:mod:`elockd.handover.records`) adds the service's counters and the
parked connections around these records and never reads the engine itself: this
module is the engine's own, the one place outside :mod:`elockd.engine.locks` that
knows its queues and counters.

Order is kept where the protocol shows it: the tables' key order (``d``), a shared
key's holders, every queue (FIFO grants), the arrival serials that keep ``mlock``
deadlock-free, and the order deadlines were set, which decides what runs first when
two fall due at the same instant: a wait and the lease it waits for ending together
time the waiter out, or grant it the key, by which came first; two leases ending
together hand their keys to their waiters, and fencing tokens, in that order. The
successor sets its deadlines again in this order, so the same one runs first.

The throttle table (:mod:`elockd.engine.throttles`) moves too: each key's TAT as
time left, and each key's line of waiters in order, with their rate, time waited
and time left, and the head's turn (when the rule admits it), with the order of
each in the deadline heap like every other deadline. A state of a predecessor
without throttles has no throttle records, and restores as it did.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from elockd.backend.interface import Grant, Later
from elockd.backend.state import (
    SESSION_FIELDS,
    Record,
    RecordReader,
    StateError,
    batches,
    raw,
    restored_session,
    session_row,
    text,
    time_left,
)
from elockd.engine.gcra import Rate, Verdict
from elockd.engine.locks import LockEngine
from elockd.engine.sessions import WAITING, Hold, Session, Waiter
from elockd.engine.throttles import ThrottleWaiter, lapse_time

#: The reply-later of a waiting request, from the backend (its ``later_for``): passed
#: in, since the backend builds its dump and restore from this module.
LaterFor = Callable[[Waiter], Later[Grant]]
#: The same for a throttle request waiting in its key's line (``throttle_later``).
ThrottleLaterFor = Callable[[ThrottleWaiter], Later[Verdict]]

#: Holds per record (column by column, see _holds).
HOLDS_BATCH = 5000


Deadlined = Hold | Session | Waiter | ThrottleWaiter


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


class MemoryDump:
    """The engine's records, in the order :class:`MemoryRestore` reads them."""

    def __init__(
        self, engine: LockEngine, now: float, pending: Sequence[tuple[Session, Any]]
    ) -> None:
        self.engine = engine
        self.now = now
        self.pending = pending
        self.places: dict[Session, int] = {}
        # Lock waiters first, then throttle waiters: one numbering for both.
        self.refs: dict[Waiter | ThrottleWaiter, int] = {}

    def pending_ref(self, later: Any, session: Session) -> int:
        return self.refs[later.waiter]

    def records(self) -> Iterator[Record]:
        engine, now, index = self.engine, self.now, self.places
        yield {
            "t": "engine",
            "next_token": engine._next_token,
            "orphans": engine.orphans,
            "shared_orphans": engine.shared_orphans,
            "expired": engine.expired,
            "timeouts": engine.timeouts,
            "admitted": engine.admitted,
            "throttled": engine.throttled,
            "killed": engine.killed,
        }
        # The last field of each row with a deadline; the successor sorts by it,
        # after the pause's critical part.
        order = engine._deadlines.set_order()

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
            later.waiter for _, later in self.pending if isinstance(later.waiter, Waiter)
        )
        refs = self.refs
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
        yield from self._throttles(order)
        # The next arrival serial (taking one from the counter costs nothing: serials
        # only need to grow).
        yield {"t": "engine_tail", "next_arrival": next(engine._arrivals)}

    def _throttles(self, order: dict[Any, int]) -> Iterator[Record]:
        """The throttle keys with state (a key whose TAT has passed and that nobody
        waits on is the same as no key: it is left out), a column per field as
        holds are; then every waiter, line by line in order, and the throttle
        requests a parked connection still has to answer that are done already."""
        throttles, now, refs, index = self.engine.throttles, self.now, self.refs, self.places
        live = (
            (key, tat) for key, tat in throttles.tats.items() if tat > now or key in throttles.lines
        )
        while chunk := list(itertools.islice(live, HOLDS_BATCH)):
            yield {
                "t": "throttle_keys",
                "keys": b"\n".join([key for key, _ in chunk]).decode("latin-1"),
                "tats": [tat - now for _, tat in chunk],
            }
        done = [
            later.waiter
            for _, later in self.pending
            if isinstance(later.waiter, ThrottleWaiter) and not later.waiter.waiting
        ]
        waiters = [*throttles.waiters(), *done]
        for waiter in waiters:
            refs[waiter] = len(refs)
        turns = self._turns() if throttles.lines else {}
        yield from batches(
            "throttle_waiters",
            (
                [
                    index[w.session],
                    text(w.key),
                    *w.rate,
                    now - w.since,
                    w.state,
                    None if w.verdict is None else list(w.verdict),
                    # While it waits: its timeout, and its turn if it leads its line,
                    # each as [time left, deadline order].
                    [time_left(w.deadline, now), order.get(w)] if w.waiting else None,
                    [w.admit - now, turns.get(w)] if w.waiting and w.admit != math.inf else None,
                ]
                for w in waiters
            ),
        )

    def _turns(self) -> dict[ThrottleWaiter, int]:
        """Each line head's turn, by the order its deadline-heap entry was set in
        (its timeout's entry came first: :meth:`Deadlines.set_order` names that one).
        A turn and a wait of the same line that fall on one instant run in this
        order, which decides whether the waiter is admitted with the head or times
        out just before (the turn is set again each time a new head leads)."""
        turns: dict[ThrottleWaiter, int] = {}
        for deadline, tiebreak, target in self.engine._deadlines._heap:
            if (
                isinstance(target, ThrottleWaiter)
                and target.waiting
                and deadline == target.admit
                and tiebreak < turns.get(target, tiebreak + 1)
            ):
                turns[target] = tiebreak
        return turns


class MemoryRestore(RecordReader):
    """Rebuilds the tables into a fresh engine, record by record (:meth:`feed`)."""

    def __init__(
        self,
        engine: LockEngine,
        now: float,
        later_for: LaterFor,
        throttle_later: ThrottleLaterFor,
    ) -> None:
        if engine.sessions:
            raise StateError("the backend already has sessions")
        self.now = now
        self.engine = engine
        self.later_for = later_for
        self.throttle_later = throttle_later
        self.sessions: list[Session] = []
        self.waiters: list[Waiter] = []
        self.throttle_waiters: list[ThrottleWaiter] = []
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
        # None in a state from before throttles.
        engine.admitted = record.get("admitted", 0)
        engine.throttled = record.get("throttled", 0)
        engine.killed = record.get("killed", 0)  # None in a state from before kill

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

    def _throttle_keys(self, record: Record) -> None:
        now, throttles = self.now, self.engine.throttles
        keys, (lefts,) = self._columns(record, "tats")
        for key, left in zip(keys, lefts, strict=True):
            throttles.tats[key] = now + left
            throttles._lapses.append((lapse_time(now + left), key))  # a heap at the end

    def _throttle_waiters(self, record: Record) -> None:
        now, throttles = self.now, self.engine.throttles
        for row in record["rows"]:
            owner, key, calls, period, burst, cost, waited, state, verdict, timeout, turn = row
            session = self.sessions[owner]
            rate = Rate(calls, period, burst, cost)
            waiter = ThrottleWaiter(session, raw(key), rate, now - waited)
            waiter.state = state
            if verdict is not None:
                waiter.verdict = Verdict(*verdict)
            if state == WAITING:
                throttles.lines.setdefault(waiter.key, OrderedDict())[waiter] = None
                throttles.by_session.setdefault(session, {})[waiter] = None
                throttles.waiting += 1
                left, order = timeout
                if left is not None:
                    waiter.deadline = now + left
                    self.deadlines.append((order, waiter.deadline, waiter))
                if turn is not None:
                    left, order = turn
                    waiter.admit = now + left
                    self.deadlines.append((order, waiter.admit, waiter))
            self.throttle_waiters.append(waiter)

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
        # The key index is built by the first `ls`, not inside the pause: sorting a
        # million keys would add most of a second to it (elockd.engine.keyindex).
        self.engine.index.rebuild = True
        heapq.heapify(self.engine.throttles._lapses)
        if self.engine._ending and self.engine.on_new_deadline is not None:
            self.engine.on_new_deadline()

    # ------------------------------------------------------------------ the end

    def pending(self, ref: int) -> Any:
        if ref >= len(self.waiters):  # throttle waiters are numbered after lock waiters
            return self.throttle_later(self.throttle_waiters[ref - len(self.waiters)])
        return self.later_for(self.waiters[ref])

    def finish(self, gone: list[Session]) -> None:
        for session in gone:
            self.engine.disconnect(session, self.now)

    def counts(self) -> tuple[int, int]:
        engine = self.engine
        return len(engine.sessions), len(engine.exclusive) + engine.shared_holders
