"""How a session of a cluster node ends, by the same rules as the in-memory engine.

Plain holds follow the session's grace time, holds with ``ttl=`` outlive the
connection until they expire (this node runs both timers), and a session that holds
nothing any more is forgotten: its entries and then its record are deleted, all
guarded by the record (:mod:`.records`), so only while the session is still ours.

A session can also end without this node freeing anything: it is *lost* when etcd
no longer has the node's lease (:mod:`.lease` says when), and *moved* when another
node claimed it with ``conn_id`` (:mod:`.records` notices). Those two are
:class:`SessionLoss`, which needs nothing of etcd and so comes first in the
wiring: the lease and the records are given its methods.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.etcd.client import compare_create, delete_op
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import ClusterHold, ClusterSession, Ledger, ThrottleWait
from elockd.backend.cluster.mirror import QueueMirror
from elockd.backend.cluster.records import SessionRecords
from elockd.engine.bookkeeping import ENDED_DISCONNECTED, ENDED_GRACE_EXPIRED
from elockd.engine.sessions import Session
from elockd.engine.watchers import EXPIRED, ORPHANED
from elockd.observe.logs import shown
from elockd.observe.logthrottle import LogThrottle

log = logging.getLogger("elockd.cluster")
#: Sessions are lost by the thousand when etcd fails, and a client can have its
#: sessions taken over as fast as it connects: one line each per 10 s, with a count.
#: A session is named by its peer and tag, never by its id (a bearer secret).
lost_log = LogThrottle(log, logging.WARNING, 10.0)
moved_log = LogThrottle(log, logging.WARNING, 10.0)


class SessionLoss:
    """Sessions this node lets go of without freeing anything in etcd: lost with
    the node's lease, or moved to another node. Not while a hand-over copies the
    books (``calls.frozen``): whoever serves on finds out (its keepalive, etcd's
    "lease not found", its recheck of the records)."""

    def __init__(self, calls: EtcdCalls, ledger: Ledger, session_ttl: int) -> None:
        self.calls = calls
        self.ledger = ledger
        self.session_ttl = session_ttl

    def lose_all(self, why: str) -> None:
        """Every session that wrote to etcd is lost (see :meth:`lose`)."""
        for session in list(self.ledger.sessions.values()):
            if session.tag:
                self.lose(session, why)

    def lose(self, session: ClusterSession, why: str) -> None:
        """etcd no longer has this session: everything it held is gone already."""
        if session.lost or self.calls.frozen:
            return
        session.lost = True
        self.ledger.sessions_lost += 1
        lost_log(
            "session of %s (tag %d) lost: %s; closing its connection",
            shown(session.peer),
            session.tag,
            why,
        )
        now = trio.current_time()
        # Its grace time and a wait a hand-over stopped end with it (counted no more).
        self.ledger.stop_grace(session)
        stopped = self.ledger.suspended_wait(session)
        if stopped is not None:
            del self.ledger.waits[session.id]
        for hold in self.ledger.holds(session):
            self.ledger.drop(hold, now, ORPHANED)  # etcd frees them with the lease
        if session.abort is not None:
            session.abort()
        if not session.connected:
            self.ledger.let_go(session)

    def moved(self, session: ClusterSession, why: str) -> None:
        """Another node took the session over (``conn_id`` there): let go of it here
        without freeing anything, and end its connection here if it has one."""
        if session.lost or self.calls.frozen:
            return
        session.lost = True  # for this node: nothing more may be done with it
        moved_log(
            "session of %s (tag %d) taken over elsewhere (%s)",
            shown(session.peer),
            session.tag,
            why,
        )
        if session.tag:
            # Its entries are the new node's to move onto its lease: the sweep here
            # leaves them alone for a session TTL (longer than any takeover).
            self.ledger.moved_tags[session.tag] = trio.current_time() + self.session_ttl
        self.ledger.stop_grace(session)
        for hold in self.ledger.holds(session):
            self.ledger.untrack(hold)
        if session.abort is not None:
            session.abort()
        self.ledger.let_go(session)


class SessionEnds:
    """A session's ends on this node: its connection gone, its grace over, a
    ``ttl=`` hold expired, and the session forgotten once it holds nothing."""

    def __init__(
        self,
        calls: EtcdCalls,
        ledger: Ledger,
        lease: NodeLease,
        records: SessionRecords,
        mirror: QueueMirror,
    ) -> None:
        self.calls = calls
        self.ledger = ledger
        self.lease = lease
        self.records = records
        self.mirror = mirror

    def disconnect(self, session: Session, now: float) -> None:
        """The connection is gone: plain holds go now (grace 0) or when the grace time
        ends; holds with a lease stay. Once the session holds nothing, its record
        and every entry left are deleted."""
        assert isinstance(session, ClusterSession)
        session.connected = False
        session.abort = None
        records = self.records
        stopped = self.ledger.suspended_wait(session)
        if isinstance(stopped, ThrottleWait):
            # A throttle wait a failed hand-over kept: out of its line, nothing else.
            del self.ledger.waits[session.id]
            entry, revision = stopped.etcd_key, stopped.revision
            self.calls.spawn(
                lambda: self.calls.txn([compare_create(entry, "==", revision)], [delete_op(entry)]),
                "end a throttle wait",
            )
        elif stopped is not None:
            # A wait a failed hand-over kept, whose client left before asking again.
            del self.ledger.waits[session.id]
            session.pending.difference_update(stopped.entries)
            entries = [(e, stopped.revision) for e in stopped.entries]
            self.calls.spawn(lambda: records.delete_entries(session, entries), "end a wait")
        if session.grace > 0 and session.tag and not session.lost:
            self.ledger.start_grace(session, now)
            self.calls.spawn(lambda: records.write_record(session), "session record")
        else:
            self._end_grace(session, now)

    def advance(self, now: float, budget: int | None = None) -> bool:
        """Run every lease and grace end due by ``now`` (the server's timer task).
        Each only starts an etcd call here, so there is no slice to bound."""
        for target in self.ledger.due(now):
            if isinstance(target, ClusterSession):
                self._end_grace(target, now)
            else:
                self._expire(target, now)
        return False

    def _end_grace(self, session: ClusterSession, now: float) -> None:
        ledger, records = self.ledger, self.records
        why = ENDED_DISCONNECTED if session.grace_deadline is None else ENDED_GRACE_EXPIRED
        ledger.stop_grace(session)
        plain = [h for h in ledger.holds(session) if h.lease_deadline is None]
        shared = sum(hold.shared for hold in plain)
        ledger.shared_orphans += shared
        ledger.orphans += len(plain) - shared
        entries = records.entries(plain)
        for hold in plain:
            ledger.drop(hold, now, ORPHANED)
        if plain and ledger.on_session_end is not None:
            ledger.on_session_end(session, len(plain) - shared, shared, why)
        if session.tag and not session.lost and not session.is_empty():
            # Leases live on: free only the plain holds, keep the session for conn_id.

            async def free_orphans() -> None:
                # In this order: the record write moves the guard the deletes carry.
                await records.delete_entries(session, entries)
                await records.write_record(session)

            self.calls.spawn(free_orphans, "free orphaned holds")
            return
        self.forget(session, entries)

    def _expire(self, hold: ClusterHold, now: float) -> None:
        """A ``ttl=`` lease ran out: this node frees it (guarded by its revision)."""
        session = hold.session
        assert isinstance(session, ClusterSession)
        self.ledger.expired += 1
        entries = self.records.entries([hold])
        self.ledger.drop(hold, now, EXPIRED)
        if not session.connected and session.grace_deadline is None and session.is_empty():
            self.forget(session, entries)
        else:
            self.calls.spawn(
                lambda: self.records.delete_entries(session, entries), "expire a lease"
            )

    def forget(self, session: ClusterSession, freed: Sequence[tuple[bytes, int]] = ()) -> None:
        """The session is over: delete its entries (``freed``, and any other of its
        entries on this node's lease) and then its record, all guarded by the
        record (only while it is still ours)."""
        self.ledger.let_go(session)
        tag = session.tag
        session.tag = 0  # no record write from now on
        lease = self.lease.id
        if not tag or session.lost or not lease:
            return
        entries = dict(freed)
        entries.update(self.mirror.entries_on(tag, lease))

        async def end() -> None:
            async with session.record_lock:  # after a record write under way
                pass
            if session.record_revision:  # else never written: nothing of it is in etcd
                await self.records.delete_entries(session, list(entries.items()), with_record=True)

        self.calls.spawn(end, "end a session")
