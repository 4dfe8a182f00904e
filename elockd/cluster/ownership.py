"""Session ownership: which node serves a session, proven in etcd, and how it ends.

The counterpart of etcd's ``concurrency/session.go``. A session that takes a lock
gets one etcd lease (``--session-ttl``); every queue entry it creates is bound to
that lease, so one revoke frees everything it had, and a dead node's sessions are
freed by etcd when their leases run out. Its record (``<root>s/<hash of id>``, see
:class:`~elockd.cluster.layout.SessionRecord`) names the node that serves it. Every
write that frees something of a session compares the record's revision with this
node's last write of it (:meth:`SessionOwnership.record_guard`): a node that lost a
session to a ``conn_id`` elsewhere, through a pause or a late timer, frees nothing.

Here too is how a session ends, by the same rules as the in-memory engine: plain
holds follow the session's grace time, holds with ``ttl=`` outlive the connection
until they expire (this node runs both timers), and ``conn_id ID`` takes over a
session that lives on without a connection, on this node or, once its node is
gone, on another. Kept apart from the lock recipe (:mod:`.recipe`), which only asks
for a session's lease and guard, and from the node's loops (:mod:`.node`), which
only tell it when a session was lost or moved.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import trio

from elockd.backend import ENDED_DISCONNECTED, ENDED_GRACE_EXPIRED, BackendUnavailable
from elockd.cluster.calls import EtcdCalls
from elockd.cluster.etcd_client import (
    EtcdError,
    EtcdUnavailable,
    Event,
    KeyValue,
    compare_create,
    compare_mod,
    delete_op,
    prefix_end,
    put_op,
    range_op,
    txn_op,
)
from elockd.cluster.layout import (
    EXCLUSIVE,
    SHARED,
    Layout,
    SessionRecord,
    encode_record,
    parse_entry_value,
    parse_record,
)
from elockd.cluster.ledger import ClusterHold, ClusterSession, Ledger
from elockd.cluster.mirror import granted_kvs
from elockd.sessions import Session

log = logging.getLogger("elockd.cluster")

#: Guarded deletes per txn: etcd's default --max-txn-ops is 128.
DELETES_PER_TXN = 64


class SessionOwnership:
    """This node's claim on its sessions in etcd: their leases and records, their
    ends (disconnect, grace, ``ttl=`` expiry, loss, a move to another node), and
    their takeover with ``conn_id``."""

    def __init__(
        self, calls: EtcdCalls, ledger: Ledger, layout: Layout, node_id: str, session_ttl: int
    ) -> None:
        self.calls = calls
        self.client = calls.client
        self.ledger = ledger
        self.layout = layout
        self.node_id = node_id
        self.session_ttl = session_ttl
        self._taking: set[str] = set()  # session ids a conn_id is taking over now
        self._revoking: set[int] = set()  # leases of ended sessions not revoked yet

    def open_session(self, session_id: str, peer: bytes) -> ClusterSession:
        session = ClusterSession(session_id, peer)
        self.ledger.sessions[session_id] = session
        return session

    # ------------------------------------------------------- lease and record

    async def ensure_lease(self, session: ClusterSession) -> int:
        """The session's etcd lease, granted (and its record written) on first use."""
        if session.lost:
            raise BackendUnavailable("session lost")
        if not session.lease:
            sent = trio.current_time()
            lease, ttl = await self.calls.etcd(self.client.lease_grant(self.session_ttl))
            session.lease = lease
            session.expires_at = sent + ttl
            self.ledger.by_lease[lease] = session
        # Also after a write whose answer was lost: every free is guarded by the
        # record's revision, so it must be known before anything is taken.
        if not session.record_revision and not await self.write_record(session, connected=True):
            raise BackendUnavailable("session taken over by another node")
        return session.lease

    def record_guard(self, session: ClusterSession) -> dict[str, Any]:
        """A compare that holds only while this node still owns the session: every
        write that frees something of a session carries it, so a node that lost a
        session to a ``conn_id`` elsewhere (a pause, a late timer) frees nothing."""
        return compare_mod(self.layout.session_record(session.id), "==", session.record_revision)

    def _record_value(self, session: ClusterSession, *, connected: bool) -> bytes:
        return encode_record(SessionRecord(self.node_id, connected, round(session.grace * 1000)))

    async def write_record(self, session: ClusterSession, *, connected: bool | None = None) -> bool:
        """Write the session's record, guarded by our last write of it: False when
        another node has claimed the session meanwhile (it is then let go here)."""
        async with session.record_lock:  # one write at a time, each on the last one
            for _ in range(3):
                if not session.lease or session.lost:
                    return False  # ended meanwhile: a record without its lease would stay
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
                put = put_op(record_key, value, session.lease)
                result = await self.calls.etcd(
                    self.client.txn([guard], [put], [range_op(record_key)]), session
                )
                if result.succeeded:
                    session.record_revision = result.revision
                    return True
                found = result.kvs(0)
                if not found or found[0].lease != session.lease:
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
        return self.layout.entry(SHARED if hold.shared else EXCLUSIVE, hold.key, session.lease)

    def entries(self, holds: Sequence[ClusterHold]) -> list[tuple[bytes, int]]:
        """(etcd key, create revision) of each hold's entry: what a guarded delete takes."""
        return [(self.entry_key(h), h.revision) for h in holds]

    async def delete_entries(
        self, session: ClusterSession, entries: Sequence[tuple[bytes, int]]
    ) -> None:
        """Delete entries of this session, each only if it is still the one created
        at its revision (the session itself may have re-created the key since), and
        all only while this node still owns the session."""
        deletes = [
            txn_op([compare_create(key, "==", revision)], [delete_op(key)])
            for key, revision in entries
        ]
        # etcd allows 128 operations per txn (--max-txn-ops) by default.
        for start in range(0, len(deletes), DELETES_PER_TXN):
            batch = deletes[start : start + DELETES_PER_TXN]
            await self.calls.etcd(self.client.txn([self.record_guard(session)], batch), session)

    # ------------------------------------------------------------------- ends

    def disconnect(self, session: Session, now: float) -> None:
        """The connection is gone: plain holds go now (grace 0) or when the grace time
        ends; holds with a lease stay. The session's etcd lease is revoked once it
        holds nothing, which frees every entry in one step."""
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
        if session.grace > 0 and session.lease and not session.lost:
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
        for hold in plain:
            ledger.drop(hold, now)
        if plain and ledger.on_session_end is not None:
            ledger.on_session_end(session, len(plain) - shared, shared, why)
        if session.lease and not session.lost and not session.is_empty():
            # Leases live on: free only the plain holds, keep the session for conn_id.
            entries = self.entries(plain)

            async def free_orphans() -> None:
                # In this order: the record write moves the guard the deletes carry.
                await self.delete_entries(session, entries)
                await self.write_record(session)

            self.calls.spawn(free_orphans, "free orphaned holds")
            return
        self._forget(session)

    def _expire(self, hold: ClusterHold, now: float) -> None:
        """A ``ttl=`` lease ran out: this node frees it (guarded by its revision)."""
        session = hold.session
        assert isinstance(session, ClusterSession)
        self.ledger.expired += 1
        entries = self.entries([hold])
        self.ledger.drop(hold, now)
        self.calls.spawn(lambda: self.delete_entries(session, entries), "expire a lease")
        if not session.connected and session.grace_deadline is None and session.is_empty():
            self._forget(session)

    def _forget(self, session: ClusterSession) -> None:
        """The session is over: delete its record (guarded: only while it is still
        ours), then revoke its lease, which takes every entry with it."""
        self.ledger.let_go(session)
        lease = session.lease
        session.lease = 0
        if not lease or session.lost:
            return
        record_key = self.layout.session_record(session.id)
        record_revision = session.record_revision
        self._revoking.add(lease)

        async def end() -> None:
            result = await self.client.txn(
                [compare_mod(record_key, "==", record_revision)], [delete_op(record_key)]
            )
            if not result.succeeded:
                _, found, _ = await self.client.get(record_key)
                if found and found[0].mod_revision != session.record_revision:
                    self._revoking.discard(lease)
                    return  # written since, by another node (or a new owner here)
            await self.client.lease_revoke(lease)
            self._revoking.discard(lease)

        self.calls.spawn(end, "end a session")

    def lose(self, session: ClusterSession, why: str) -> None:
        """etcd no longer has this session: everything it held is gone already.
        Not while a hand-over copies the books: whoever serves on finds out (its
        keepalive, or etcd's "lease not found")."""
        if session.lost or self.calls.frozen:
            return
        session.lost = True
        self.ledger.sessions_lost += 1
        log.warning("session %s lost: %s; closing its connection", session.id[:8], why)
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
        log.warning("session %s taken over elsewhere (%s)", session.id[:8], why)
        self.ledger.stop_grace(session)
        for hold in self.ledger.holds(session):
            self.ledger.untrack(hold)
        if session.abort is not None:
            session.abort()
        self.ledger.let_go(session)

    def record_changed(self, event: Event) -> None:
        """A session record claimed by another node (``conn_id`` there): the
        mirror's hook for every watched key outside the queues."""
        kv = event.kv
        if event.type == "DELETE" or not kv.key.startswith(self.layout.sessions):
            return
        session = self.ledger.by_lease.get(kv.lease)
        if session is None or kv.mod_revision <= session.record_revision:
            return
        node = parse_record(kv.value).node
        if node != self.node_id:
            self.moved(session, f"node {node} claimed it")

    async def recheck_records(self) -> None:
        """After the mirror was reloaded: the session-record changes the watch
        missed, so a session another node claimed meanwhile is let go here (see
        :meth:`record_changed`)."""
        sessions = self.layout.sessions
        _, records, _ = await self.client.get(sessions, prefix_end(sessions))
        for record in records:
            session = self.ledger.by_lease.get(record.lease)
            if (
                session is not None
                and record.mod_revision > session.record_revision
                and parse_record(record.value).node != self.node_id
            ):
                self.moved(session, "claimed by another node while the watch was behind")

    async def end_all(self) -> None:
        """The node is leaving: revoke every session's lease, so their locks go at
        once rather than after the session TTL, and the leases of sessions that
        ended but were not revoked yet."""
        async with trio.open_nursery() as ends:
            for session in self.ledger.sessions.values():
                if session.lease and not session.lost:
                    ends.start_soon(self._end_at_shutdown, session)
            for lease in list(self._revoking):
                ends.start_soon(self.calls.revoke_quietly, lease)

    async def _end_at_shutdown(self, session: ClusterSession) -> None:
        """Revoke a session's lease, unless another node has just claimed it."""
        record_key = self.layout.session_record(session.id)
        with contextlib.suppress(EtcdUnavailable, EtcdError):
            result = await self.client.txn(
                [compare_mod(record_key, "==", session.record_revision)], [delete_op(record_key)]
            )
            if result.succeeded:
                await self.client.lease_revoke(session.lease)

    # --------------------------------------------------------------- takeover

    async def take_over(self, session_id: str, current: ClusterSession) -> ClusterSession | None:
        """``conn_id ID``: a disconnected session of this node, or one whose node
        is gone (its heartbeat expired) while the session's lease still lives."""
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
            if local.connected or local.lost or not local.lease:
                return None
            # etcd first: if the record cannot be written, nothing changed here.
            if not await self.write_record(local, connected=True):
                return None
            if local.lost or not local.lease or self.ledger.sessions.get(session_id) is not local:
                return None  # its grace or last lease ended while the record was written
            self._adopt_local(local, current)
            return local
        return await self._take_over_from_dead_node(session_id, current)

    async def _take_over_from_dead_node(
        self, session_id: str, current: ClusterSession
    ) -> ClusterSession | None:
        etcd = self.calls.etcd
        record_key = self.layout.session_record(session_id)
        _, kvs, _ = await etcd(self.client.get(record_key))
        if not kvs:
            return None
        record = kvs[0]
        state = parse_record(record.value)
        if state.connected:
            _, alive, _ = await etcd(self.client.get(self.layout.node(state.node)))
            if alive:
                return None
        session = ClusterSession(session_id, current.peer)
        session.name = current.name
        session.lease = record.lease
        session.grace = state.grace_ms / 1000
        value = self._record_value(session, connected=True)
        claimed = await etcd(
            self.client.txn(
                [compare_mod(record_key, "==", record.mod_revision)],
                [put_op(record_key, value, record.lease)],
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
        # Its old node no longer keeps the lease alive: refresh it before anything.
        sent = trio.current_time()
        remaining = await etcd(self.client.lease_keepalive(record.lease))
        if remaining == 0:
            return None
        session.expires_at = sent + remaining
        # Adopt before the session is known here: until it holds its holds, the
        # stray sweep must not see its entries. If adopting fails, nobody keeps its
        # lease alive and etcd frees everything after the TTL.
        try:
            await self._adopt_entries(session)
            # Nobody kept the lease alive while adopting: if it ran out meanwhile,
            # etcd freed the entries just read. A live lease proves they are intact.
            sent = trio.current_time()
            remaining = await etcd(self.client.lease_keepalive(record.lease))
        except BackendUnavailable:
            # Let a later conn_id (here or elsewhere) try again.
            self.calls.spawn(lambda: self.write_record(session, connected=False), "session record")
            raise
        if remaining == 0 or session_id in self.ledger.sessions:
            return None
        session.expires_at = sent + remaining
        self.ledger.sessions[session_id] = session
        self.ledger.by_lease[session.lease] = session
        self._forget_empty(current)
        return session

    def _adopt_local(self, target: ClusterSession, current: ClusterSession) -> None:
        self.ledger.adopt(target, current)
        self._forget_empty(current)

    def _forget_empty(self, session: ClusterSession) -> None:
        session.connected = False
        self._forget(session)

    async def _adopt_entries(self, session: ClusterSession) -> None:
        """Rebuild the holds of a session taken over from a dead node. A request's
        entries (one revision; several keys for ``mlock``) become holds when they
        hold every lock they are in (a ``ttl`` restarts in full); others are left
        to the stray sweep (:mod:`.node`), since their requests died with the old
        connection."""
        names = await self.calls.etcd(self.client.lease_keys(session.lease), session)
        if names is None:
            raise BackendUnavailable("session lease gone")
        requests: dict[int, list[tuple[bytes, KeyValue]]] = {}
        for etcd_key in names:
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
            entries = requests.setdefault(mine.create_revision, [])
            entries.append((name.key if holding else b"", mine))
        now = trio.current_time()
        for revision, entries in requests.items():
            if any(not key for key, _ in entries):
                continue  # a request that did not hold all its keys: a stray
            for key, kv in entries:
                name = self.layout.parse_entry(kv.key)
                assert name is not None
                value = parse_entry_value(kv.value)  # its rank keeps its token the same
                hold = self.ledger.record_hold(session, name.kind, key, revision, now, value.rank)
                ttl = value.ttl
                if ttl is not None:
                    hold.ttl = ttl
                    self.ledger.set_lease(hold, now + ttl)
