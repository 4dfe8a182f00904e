"""Session ownership: which node serves a session, proven in etcd, and how it ends.

The counterpart of etcd's ``concurrency/session.go``, with one etcd lease per node
rather than per session (as etcd's own lock service shares one among a session's
locks): keepalives grow with nodes, not sessions. A session that takes a lock gets
a random *tag*, which names it in its entries' keys, and a record
(``<root>s/<hash of id>``, see :class:`~elockd.backend.cluster.layout.SessionRecord`) that
names the node serving it and its tag. Its record and entries hang on that node's
lease (``--session-ttl``), so a dead node's sessions are freed by etcd when its lease
runs out. Every write that frees something of a session compares the record's
revision with this node's last write of it (:meth:`SessionOwnership.record_guard`):
a node that lost a session to a ``conn_id`` elsewhere, through a pause or a late
timer, frees nothing.

Here too is how a session ends, by the same rules as the in-memory engine: plain
holds follow the session's grace time, holds with ``ttl=`` outlive the connection
until they expire (this node runs both timers), and ``conn_id ID`` takes over a
session that lives on without a connection, on this node or, once its node is
gone, on another, which moves the session's entries onto its own lease in guarded
transactions (a claim of the record, then the entries in batches). Kept apart from
the lock recipe (:mod:`.recipe`), which only asks for a session's tag, the node's
lease and the guard, and from the node's loops (:mod:`.node`), which keep the
lease alive and tell it when a session was lost or moved.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Sequence
from typing import Any

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.etcd.client import (
    Event,
    KeyValue,
    compare_create,
    compare_lease,
    compare_mod,
    delete_op,
    prefix_end,
    put_op,
    range_op,
    txn_op,
)
from elockd.backend.cluster.layout import (
    EXCLUSIVE,
    SHARED,
    EntryName,
    Layout,
    SessionRecord,
    encode_record,
    parse_entry_value,
    parse_record,
)
from elockd.backend.cluster.ledger import ClusterHold, ClusterSession, Ledger
from elockd.backend.cluster.mirror import ClusterWaiter, QueueMirror, granted_kvs
from elockd.backend.interface import ENDED_DISCONNECTED, ENDED_GRACE_EXPIRED, BackendUnavailable
from elockd.engine.sessions import Session
from elockd.observe.logs import shown
from elockd.observe.logthrottle import LogThrottle

log = logging.getLogger("elockd.cluster")
#: Sessions are lost by the thousand when etcd fails, and a client can have its
#: sessions taken over as fast as it connects: one line each per 10 s, with a count.
#: A session is named by its peer and tag, never by its id (a bearer secret).
lost_log = LogThrottle(log, logging.WARNING, 10.0)
moved_log = LogThrottle(log, logging.WARNING, 10.0)

#: Guarded deletes per txn: etcd's default --max-txn-ops is 128.
DELETES_PER_TXN = 64
#: Seconds before etcd could expire the node's lease at the earliest that the node
#: stops confirming anything held under it (see :func:`lease_deadline`).
LEASE_MARGIN = 0.5
#: How far this host's clock may run slow against the etcd leader's, as a fraction
#: of the time measured (an NTP-disciplined clock is off by parts per million; a
#: VM's clock that jumps or drifts by this much is broken anyway).
CLOCK_RATE_ERROR = 0.02


def lease_deadline(sent: float, ttl: float) -> float:
    """When the node stops confirming holds under a lease whose last keepalive (or
    grant) was *sent* at ``sent`` and answered with ``ttl`` seconds.

    Why this is ahead of any moment another node could be granted those locks:
    etcd's leader restarts a lease's TTL when it applies the keepalive, which is
    after we sent it, so etcd cannot expire the lease before ``sent + ttl`` as
    measured on the leader's clock (a leader change only resets the TTL to the
    full value, later still; etcd checks for expired leases every 0.5 s, which
    only makes its expiry later). Another node's grant follows that expiry. This
    node's clock may run slower than the leader's by ``CLOCK_RATE_ERROR`` of the
    TTL, and acting on the deadline takes time: the timer fires in a busy event
    loop, connections are closed, and a reply already written reaches its client
    one trip later. ``LEASE_MARGIN`` covers that. So nothing this node confirms
    after the deadline, and nothing it confirmed before, overlaps a grant made
    elsewhere after etcd's expiry, as long as the loop lags less than the margin
    (docs/cluster.md, "What is guaranteed")."""
    return sent + ttl * (1 - CLOCK_RATE_ERROR) - LEASE_MARGIN


#: Entries moved per txn by a takeover: a compare and a put each, and the guard.
MOVES_PER_TXN = 40


class SessionOwnership:
    """This node's claim on its sessions in etcd: the node's lease their keys hang
    on, their records, their ends (disconnect, grace, ``ttl=`` expiry, loss, a move
    to another node), and their takeover with ``conn_id``."""

    def __init__(
        self,
        calls: EtcdCalls,
        ledger: Ledger,
        layout: Layout,
        mirror: QueueMirror,
        node_id: str,
        session_ttl: int,
    ) -> None:
        self.calls = calls
        self.client = calls.client
        self.ledger = ledger
        self.layout = layout
        self.mirror = mirror
        self.node_id = node_id
        self.session_ttl = session_ttl
        #: The etcd lease every record and entry of this node's sessions hangs on
        #: (0 until the node has joined, and after etcd let it run out until the
        #: node has a new one), and the local deadline (:func:`lease_deadline`)
        #: after which the node confirms nothing held under it.
        self.lease = 0
        self.lease_deadline = math.inf
        #: Set while the node has a lease: a request waits on it while the node
        #: gets a new one (see :meth:`wait_for_lease`).
        self._lease_ready = trio.Event()
        #: Set (and replaced) whenever the lease or its deadline changes: the
        #: node's deadline timer sleeps on it (see :meth:`enforce_deadline`).
        self._deadline_moved = trio.Event()
        self._taking: set[str] = set()  # session ids a conn_id is taking over now

    def open_session(self, session_id: str, peer: bytes) -> ClusterSession:
        session = ClusterSession(session_id, peer)
        self.ledger.sessions[session_id] = session
        return session

    # ------------------------------------------------------- lease and record

    def current_lease(self) -> int:
        """The node's lease, for a write: never 0, which would make a key that
        outlives the node."""
        if not self.lease:
            raise BackendUnavailable("this node has no etcd lease (etcd let it run out)")
        return self.lease

    def renewed(self, lease: int, sent: float, ttl: float) -> None:
        """etcd confirmed ``lease`` (granted, or kept alive) for ``ttl`` seconds in
        answer to a call sent at ``sent``."""
        self.set_lease(lease, lease_deadline(sent, ttl))

    def set_lease(self, lease: int, deadline: float) -> None:
        """The node's lease (new, renewed, or a predecessor's) and its local
        deadline; 0 and infinity for none."""
        self.lease = lease
        self.lease_deadline = deadline
        if lease:
            self._lease_ready.set()
        elif self._lease_ready.is_set():
            self._lease_ready = trio.Event()
        self._deadline_moved.set()
        self._deadline_moved = trio.Event()

    async def enforce_deadline(self) -> None:
        """The node's deadline timer: the moment the lease passes its local
        deadline, every session under it is lost (connections closed, logged), not
        at the next keepalive round, which may be stuck in a call to etcd for up to
        ``--etcd-timeout``. Runs until cancelled."""
        while True:
            with trio.move_on_at(self.lease_deadline):
                await self._deadline_moved.wait()
                continue
            self.check_expiry()
            if self.calls.frozen and self.lease:
                # A hand-over copies the books and keeps them as they are; the
                # successor checks the lease before it serves on.
                await self.calls.thawed()

    def confirm(self, session: ClusterSession) -> None:
        """Before anything held under the node's lease is confirmed to a client (a
        grant, ``token``, ``renew``, a lock already held): the lease is within its
        local deadline and the session was not lost. BackendUnavailable else."""
        self.check_expiry()
        if session.lost:
            raise BackendUnavailable("session lost: this node's etcd lease ran out")

    async def wait_for_lease(self) -> None:
        """Return once the node has a lease, waiting up to the etcd deadline while
        it gets a new one: a node that finds its lease gone (after a pause, or an
        outage) asks for a new one at once, and a request that comes meanwhile is
        served once it has it, not refused for a gap of one etcd round trip.
        BackendUnavailable if etcd does not give one within the deadline."""
        self.check_expiry()
        if not self.lease:
            with trio.move_on_after(self.client.deadline):
                await self._lease_ready.wait()
        self.current_lease()

    def check_expiry(self) -> None:
        """If the lease has passed its local deadline (no keepalive answered in time:
        a pause, an outage, a partition), etcd may expire it at any moment and
        another node grant its locks: the sessions' holds are no longer this node's
        to promise. Fail closed, and get a new lease."""
        if trio.current_time() >= self.lease_deadline:
            self.lease_gone("etcd was not reached in time to keep the node's lease")

    def lease_gone(self, why: str) -> None:
        """etcd no longer has the node's lease, or may not: every session that wrote
        anything there is lost, and the node wants a new lease at once. Not while a
        hand-over copies the books: whoever serves on finds out at its first
        keepalive."""
        if self.calls.frozen or not self.lease:
            return
        old = self.lease
        self.set_lease(0, math.inf)
        self.lose_all(why)
        self.calls.keeper_wanted.set()  # a new lease at once

        # If etcd still has it (its keepalives got through, but their answers came
        # late), its entries would block their queues until etcd expires it: revoke
        # it, if etcd answers. Not before the lost sessions' connections had the
        # margin to close: a revoke lets other nodes grant their locks at once, and
        # lose() only cancels each connection's task, which closes it when it runs.
        async def revoke_later() -> None:
            await trio.sleep(LEASE_MARGIN)
            await self.calls.revoke_quietly(old)

        self.calls.spawn(revoke_later, "revoke a lapsed lease")

    def lose_all(self, why: str) -> None:
        """Every session that wrote to etcd is lost (see :meth:`lose`)."""
        for session in list(self.ledger.sessions.values()):
            if session.tag:
                self.lose(session, why)

    async def ensure_record(self, session: ClusterSession) -> int:
        """The session's tag, given (and its record written) on first use."""
        if session.lost:
            raise BackendUnavailable("session lost")
        await self.wait_for_lease()  # fails closed, before a tag or record, without one
        if not session.tag:
            session.tag = self._new_tag()
            self.ledger.by_tag[session.tag] = session
        # Also after a write whose answer was lost: every free is guarded by the
        # record's revision, so it must be known before anything is taken.
        if not session.record_revision and not await self.write_record(session, connected=True):
            raise BackendUnavailable("session taken over by another node")
        return session.tag

    def _new_tag(self) -> int:
        """A random tag, unique among this node's sessions. Tags of sessions on other
        nodes never meet this node's in a key that matters: each entry key also
        carries the lock, and a collision across nodes (1 in 2**63 per pair) would
        need both sessions in one queue."""
        while True:
            tag = secrets.randbits(63)
            if tag and tag not in self.ledger.by_tag:
                return tag

    def record_guard(self, session: ClusterSession) -> dict[str, Any]:
        """A compare that holds only while this node still owns the session: every
        write that frees something of a session carries it, so a node that lost a
        session to a ``conn_id`` elsewhere (a pause, a late timer) frees nothing."""
        return compare_mod(self.layout.session_record(session.id), "==", session.record_revision)

    def _record_value(self, session: ClusterSession, *, connected: bool) -> bytes:
        grace_ms = round(session.grace * 1000)
        return encode_record(SessionRecord(self.node_id, connected, grace_ms, session.tag))

    async def write_record(self, session: ClusterSession, *, connected: bool | None = None) -> bool:
        """Write the session's record, guarded by our last write of it: False when
        another node has claimed the session meanwhile (it is then let go here)."""
        async with session.record_lock:  # one write at a time, each on the last one
            for _ in range(3):
                if not session.tag or session.lost or not self.lease:
                    return False  # ended or lost meanwhile
                lease = self.lease
                record_key = self.layout.session_record(session.id)
                # Unless told, the state at the time of the write: writes queued
                # behind each other then end on the session's latest state.
                now_connected = session.connected if connected is None else connected
                value = self._record_value(session, connected=now_connected)
                guard = (
                    compare_mod(record_key, "==", session.record_revision)
                    if session.record_revision
                    else compare_create(record_key, "==", 0)
                )
                put = put_op(record_key, value, lease)
                result = await self.calls.etcd(
                    self.client.txn([guard], [put], [range_op(record_key)])
                )
                if result.succeeded:
                    session.record_revision = result.revision
                    return True
                found = result.kvs(0)
                if not found or found[0].lease != lease:
                    break
                if parse_record(found[0].value).node != self.node_id:
                    break  # another node claimed it
                # Ours: a retried write whose first attempt committed, or a write of
                # ours whose answer was lost. Go on from there.
                session.record_revision = found[0].mod_revision
                if found[0].value == value:
                    return True
            self.moved(session, "its record changed")
            return False

    # ---------------------------------------------------------------- entries

    def entry_key(self, hold: ClusterHold) -> bytes:
        session = hold.session
        assert isinstance(session, ClusterSession)
        return self.layout.entry(SHARED if hold.shared else EXCLUSIVE, hold.key, session.tag)

    def entries(self, holds: Sequence[ClusterHold]) -> list[tuple[bytes, int]]:
        """(etcd key, create revision) of each hold's entry: what a guarded delete takes."""
        return [(self.entry_key(h), h.revision) for h in holds]

    async def delete_entries(
        self,
        session: ClusterSession | None,
        entries: Sequence[tuple[bytes, int]],
        *,
        with_record: bool = False,
    ) -> bool:
        """Delete entries, each only if it is still the one created at its revision
        (the session itself may have re-created the key since), and all only while
        this node still owns ``session``; with None, entries of a session this node
        no longer has (strays on its lease, see the node's sweep), each only while
        it still hangs on this node's lease: another node that took the session over
        by ``conn_id`` may have moved it onto its own, keeping its create revision,
        and holds it now. ``with_record``:
        the session's record goes too, with the last batch, so that if a txn fails
        midway the record and its guard stay and the sweep frees the rest. False
        once the guard fails: the session is another node's now, and so is the rest."""
        lease = self.lease

        def compares(key: bytes, revision: int) -> list[dict[str, Any]]:
            if session is not None:
                return [compare_create(key, "==", revision)]
            return [compare_create(key, "==", revision), compare_lease(key, "==", lease)]

        deletes = [txn_op(compares(key, revision), [delete_op(key)]) for key, revision in entries]
        # etcd allows 128 operations per txn (--max-txn-ops) by default.
        batches = [
            deletes[start : start + DELETES_PER_TXN]
            for start in range(0, len(deletes), DELETES_PER_TXN)
        ]
        if with_record:
            assert session is not None
            batches = batches or [[]]
            batches[-1].append(delete_op(self.layout.session_record(session.id)))
        for batch in batches:
            guard = [] if session is None else [self.record_guard(session)]
            result = await self.calls.etcd(self.client.txn(guard, batch))
            if not result.succeeded:
                return False
        return True

    # ------------------------------------------------------------------- ends

    def disconnect(self, session: Session, now: float) -> None:
        """The connection is gone: plain holds go now (grace 0) or when the grace time
        ends; holds with a lease stay. Once the session holds nothing, its record
        and every entry left are deleted."""
        assert isinstance(session, ClusterSession)
        session.connected = False
        session.abort = None
        stopped = self.ledger.suspended_wait(session)
        if stopped is not None:
            # A wait a failed hand-over kept, whose client left before asking again.
            del self.ledger.waits[session.id]
            session.pending.difference_update(stopped.entries)
            entries = [(e, stopped.revision) for e in stopped.entries]
            self.calls.spawn(lambda: self.delete_entries(session, entries), "end a wait")
        if session.grace > 0 and session.tag and not session.lost:
            self.ledger.start_grace(session, now)
            self.calls.spawn(lambda: self.write_record(session), "session record")
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
        ledger = self.ledger
        why = ENDED_DISCONNECTED if session.grace_deadline is None else ENDED_GRACE_EXPIRED
        ledger.stop_grace(session)
        plain = [h for h in ledger.holds(session) if h.lease_deadline is None]
        shared = sum(hold.shared for hold in plain)
        ledger.shared_orphans += shared
        ledger.orphans += len(plain) - shared
        entries = self.entries(plain)
        for hold in plain:
            ledger.drop(hold, now)
        if plain and ledger.on_session_end is not None:
            ledger.on_session_end(session, len(plain) - shared, shared, why)
        if session.tag and not session.lost and not session.is_empty():
            # Leases live on: free only the plain holds, keep the session for conn_id.

            async def free_orphans() -> None:
                # In this order: the record write moves the guard the deletes carry.
                await self.delete_entries(session, entries)
                await self.write_record(session)

            self.calls.spawn(free_orphans, "free orphaned holds")
            return
        self._forget(session, entries)

    def _expire(self, hold: ClusterHold, now: float) -> None:
        """A ``ttl=`` lease ran out: this node frees it (guarded by its revision)."""
        session = hold.session
        assert isinstance(session, ClusterSession)
        self.ledger.expired += 1
        entries = self.entries([hold])
        self.ledger.drop(hold, now)
        if not session.connected and session.grace_deadline is None and session.is_empty():
            self._forget(session, entries)
        else:
            self.calls.spawn(lambda: self.delete_entries(session, entries), "expire a lease")

    def _forget(self, session: ClusterSession, freed: Sequence[tuple[bytes, int]] = ()) -> None:
        """The session is over: delete its entries (``freed``, and any other of its
        entries on this node's lease) and then its record, all guarded by the
        record (only while it is still ours)."""
        self.ledger.let_go(session)
        tag = session.tag
        session.tag = 0  # no record write from now on
        if not tag or session.lost or not self.lease:
            return
        entries = dict(freed)
        entries.update(self.mirror.entries_on(tag, self.lease))

        async def end() -> None:
            async with session.record_lock:  # after a record write under way
                pass
            if session.record_revision:  # else never written: nothing of it is in etcd
                await self.delete_entries(session, list(entries.items()), with_record=True)

        self.calls.spawn(end, "end a session")

    def lose(self, session: ClusterSession, why: str) -> None:
        """etcd no longer has this session: everything it held is gone already.
        Not while a hand-over copies the books: whoever serves on finds out (its
        keepalive, or etcd's "lease not found")."""
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
        for hold in self.ledger.holds(session):
            self.ledger.drop(hold, now)
        if session.abort is not None:
            session.abort()
        if not session.connected:
            self.ledger.let_go(session)

    def moved(self, session: ClusterSession, why: str) -> None:
        """Another node took the session over (``conn_id`` there): let go of it here
        without freeing anything, and end its connection here if it has one. Not
        while a hand-over copies the books: whoever serves on rechecks the records."""
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

    def _claimed_elsewhere(self, record: KeyValue) -> ClusterSession | None:
        """This node's session whose record another node has written since ours."""
        state = parse_record(record.value)
        session = self.ledger.by_tag.get(state.tag) if state.tag else None
        if (
            session is not None
            and record.mod_revision > session.record_revision
            and state.node != self.node_id
        ):
            return session
        return None

    def record_changed(self, event: Event) -> None:
        """A session record claimed by another node (``conn_id`` there): the
        mirror's hook for every watched key outside the queues."""
        if event.type == "DELETE" or not event.kv.key.startswith(self.layout.sessions):
            return
        session = self._claimed_elsewhere(event.kv)
        if session is not None:
            self.moved(session, f"node {parse_record(event.kv.value).node} claimed it")

    async def recheck_records(self) -> None:
        """After the mirror was reloaded: the session-record changes the watch
        missed, so a session another node claimed meanwhile is let go here (see
        :meth:`record_changed`)."""
        sessions = self.layout.sessions
        _, records, _ = await self.client.get(sessions, prefix_end(sessions))
        for record in records:
            session = self._claimed_elsewhere(record)
            if session is not None:
                self.moved(session, "claimed by another node while the watch was behind")

    # --------------------------------------------------------------- takeover

    async def take_over(self, session_id: str, current: ClusterSession) -> ClusterSession | None:
        """``conn_id ID``: a disconnected session of this node, or one whose node
        is gone (its heartbeat expired) while that node's lease still lives."""
        if not current.is_empty() or session_id in self._taking:
            return None  # one takeover of a session at a time on this node
        self._taking.add(session_id)
        try:
            return await self._take_over(session_id, current)
        finally:
            self._taking.discard(session_id)

    async def _take_over(self, session_id: str, current: ClusterSession) -> ClusterSession | None:
        local = self.ledger.sessions.get(session_id)
        if local is not None:
            if local.connected or local.lost or not local.tag:
                return None
            # etcd first: if the record cannot be written, nothing changed here.
            if not await self.write_record(local, connected=True):
                return None
            if local.lost or not local.tag or self.ledger.sessions.get(session_id) is not local:
                return None  # its grace or last lease ended while the record was written
            self._adopt_local(local, current)
            return local
        return await self._take_over_from_dead_node(session_id, current)

    async def _take_over_from_dead_node(
        self, session_id: str, current: ClusterSession
    ) -> ClusterSession | None:
        etcd = self.calls.etcd
        lease = self.current_lease()
        record_key = self.layout.session_record(session_id)
        _, kvs, _ = await etcd(self.client.get(record_key))
        if not kvs:
            return None
        record = kvs[0]
        state = parse_record(record.value)
        if not state.tag or state.tag in self.ledger.by_tag:
            return None  # written by a node with a lease per session; or a tag in use here
        if state.connected:
            _, alive, _ = await etcd(self.client.get(self.layout.node(state.node)))
            if alive:
                return None
        session = ClusterSession(session_id, current.peer)
        session.name = current.name
        session.tag = state.tag
        session.grace = state.grace_ms / 1000
        value = self._record_value(session, connected=True)
        claimed = await etcd(
            self.client.txn(
                [compare_mod(record_key, "==", record.mod_revision)],
                [put_op(record_key, value, lease)],
                [range_op(record_key)],
            )
        )
        if claimed.succeeded:
            session.record_revision = claimed.revision
        else:
            found = claimed.kvs(0)
            if not (found and found[0].value == value):
                return None
            session.record_revision = found[0].mod_revision  # our retried claim
        # Known by its tag before its entries move onto this node's lease, so the
        # stray sweep counts them as a session's. If moving them fails, the old
        # node's lease frees what did not move, and the sweep what did.
        self.ledger.by_tag[session.tag] = session
        try:
            await self._adopt_entries(session, record.lease)
        except BackendUnavailable:
            if self.ledger.by_tag.get(session.tag) is session:
                del self.ledger.by_tag[session.tag]
            # Let a later conn_id (here or elsewhere) try again.
            self.calls.spawn(lambda: self._release_claim(session), "session record")
            raise
        if session_id in self.ledger.sessions:
            return None
        self.ledger.sessions[session_id] = session
        self._forget_empty(current)
        return session

    async def _release_claim(self, session: ClusterSession) -> None:
        """A takeover that failed: its record says nobody is connected, so another
        ``conn_id`` may try (the record stays on this node's lease until then)."""
        record_key = self.layout.session_record(session.id)
        value = self._record_value(session, connected=False)
        await self.calls.etcd(
            self.client.txn(
                [compare_mod(record_key, "==", session.record_revision)],
                [put_op(record_key, value, self.current_lease())],
            )
        )

    def _adopt_local(self, target: ClusterSession, current: ClusterSession) -> None:
        self.ledger.adopt(target, current)
        self._forget_empty(current)

    def _forget_empty(self, session: ClusterSession) -> None:
        session.connected = False
        self._forget(session)

    async def _adopt_entries(self, session: ClusterSession, old_lease: int) -> None:
        """Take over the entries of a session whose node is gone: those of requests
        that hold every lock they are in become holds here (a ``ttl`` restarts in
        full) and move onto this node's lease; the others are deleted, since their
        requests died with the old connection. Each move is guarded by our claim of
        the record and the entry's create revision: if the old node's lease ran out
        meanwhile, etcd has freed the entries, nothing moves, and the takeover fails."""
        await self._mirror_reaches(session.record_revision)
        # Each request's entries (one revision; several keys for mlock), and
        # whether each holds its lock.
        requests: dict[int, list[tuple[EntryName, KeyValue, bool]]] = {}
        for etcd_key, _ in self.mirror.entries_on(session.tag, old_lease):
            name = self.layout.parse_entry(etcd_key)
            if name is None:
                continue
            queue_prefix = self.layout.queue_prefix(name.kind, name.key)
            _, kvs, _ = await self.calls.etcd(
                self.client.get(queue_prefix, prefix_end(queue_prefix), sort_by_create=True)
            )
            position = next((i for i, kv in enumerate(kvs) if kv.key == etcd_key), None)
            if position is None:
                continue
            mine = kvs[position]
            holding = position == 0 if name.kind == EXCLUSIVE else mine in granted_kvs(kvs)
            requests.setdefault(mine.create_revision, []).append((name, mine, holding))
        kept = {r: es for r, es in requests.items() if all(holding for _, _, holding in es)}
        await self._move_entries(
            session,
            [kv for entries in kept.values() for _, kv, _ in entries],
            [kv for r, entries in requests.items() if r not in kept for _, kv, _ in entries],
        )
        now = trio.current_time()
        for revision, entries in kept.items():
            for name, kv, _ in entries:
                value = parse_entry_value(kv.value)  # its rank keeps its token the same
                hold = self.ledger.record_hold(
                    session, name.kind, name.key, revision, now, value.rank
                )
                if value.ttl is not None:
                    hold.ttl = value.ttl
                    self.ledger.set_lease(hold, now + value.ttl)

    async def _move_entries(
        self, session: ClusterSession, kept: list[KeyValue], strays: list[KeyValue]
    ) -> None:
        """Put ``kept`` onto this node's lease (a put keeps an entry's create
        revision, hence its place in its queue and its token) and delete
        ``strays``, in as few guarded txns as etcd allows."""
        lease = self.current_lease()
        guard = self.record_guard(session)
        for start in range(0, max(len(kept), len(strays)), MOVES_PER_TXN):
            moving = kept[start : start + MOVES_PER_TXN]
            gone = strays[start : start + MOVES_PER_TXN]
            result = await self.calls.etcd(
                self.client.txn(
                    [guard] + [compare_create(kv.key, "==", kv.create_revision) for kv in moving],
                    [put_op(kv.key, kv.value, lease) for kv in moving]
                    + [
                        txn_op(
                            [compare_create(kv.key, "==", kv.create_revision)], [delete_op(kv.key)]
                        )
                        for kv in gone
                    ],
                ),
            )
            if not result.succeeded:
                raise BackendUnavailable("the session's entries were freed while moving")

    async def _mirror_reaches(self, revision: int) -> None:
        """Wait until the mirror has seen ``revision``: it then knows every entry
        created before it. A waiter on no queue is what the mirror wakes then."""
        reached = trio.Event()
        waiter = ClusterWaiter([], 0)
        waiter.revision, waiter.wake = revision, reached.set
        self.mirror.add_waiter(waiter)
        try:
            with trio.move_on_after(self.client.deadline):
                await reached.wait()
                return
        finally:
            self.mirror.remove_waiter(waiter)
        raise BackendUnavailable("this node's watch is behind etcd")

    async def end_all(self) -> None:
        """The node is leaving: revoke its lease, so the locks of its sessions go at
        once rather than after the session TTL. A session another node has taken
        over has moved onto that node's lease and is not touched."""
        if self.lease:
            await self.calls.revoke_quietly(self.lease)
