"""``conn_id ID``: taking over a session that lives on without a connection.

On this node, a disconnected session is adopted by the new connection once its
record says so. On another node, once that node is gone (its heartbeat expired)
while its lease still lives, this node claims the session's record in a guarded
transaction and then moves the session's entries onto its own lease in batches,
each guarded by the claim: an entry keeps its create revision, hence its place in
its queue and its fencing token. If the old node's lease runs out meanwhile, etcd
frees what did not move, and the takeover fails closed.
"""

from __future__ import annotations

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.ends import SessionEnds
from elockd.backend.cluster.etcd.client import (
    KeyValue,
    compare_create,
    compare_mod,
    delete_op,
    prefix_end,
    put_op,
    range_op,
    txn_op,
)
from elockd.backend.cluster.layout import (
    EXCLUSIVE,
    EntryName,
    Layout,
    parse_entry_value,
    parse_record,
)
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import ClusterSession, Ledger
from elockd.backend.cluster.mirror import QueueMirror, granted_kvs
from elockd.backend.cluster.operators import mirror_reaches
from elockd.backend.cluster.records import SessionRecords
from elockd.backend.interface import BackendUnavailable

#: Entries moved per txn by a takeover: two compares and a put each, and the guard.
MOVES_PER_TXN = 40


class Takeover:
    """``conn_id``: a session of this node, or of a node that is gone, taken over by
    a new connection."""

    def __init__(
        self,
        calls: EtcdCalls,
        ledger: Ledger,
        layout: Layout,
        mirror: QueueMirror,
        lease: NodeLease,
        records: SessionRecords,
        ends: SessionEnds,
    ) -> None:
        self.calls = calls
        self.ledger = ledger
        self.layout = layout
        self.mirror = mirror
        self.lease = lease
        self.records = records
        self.ends = ends
        self._taking: set[str] = set()  # session ids a conn_id is taking over now

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
            if not await self.records.write_record(local, connected=True):
                return None
            if local.lost or not local.tag or self.ledger.sessions.get(session_id) is not local:
                return None  # its grace or last lease ended while the record was written
            self._adopt_local(local, current)
            return local
        return await self._take_over_from_dead_node(session_id, current)

    async def _take_over_from_dead_node(
        self, session_id: str, current: ClusterSession
    ) -> ClusterSession | None:
        calls = self.calls
        lease = self.lease.current()
        record_key = self.layout.session_record(session_id)
        _, kvs, _ = await calls.get(record_key)
        if not kvs:
            return None
        record = kvs[0]
        state = parse_record(record.value)
        if not state.tag or state.tag in self.ledger.by_tag:
            return None  # written by a node with a lease per session; or a tag in use here
        if state.connected:
            _, alive, _ = await calls.get(self.layout.node(state.node))
            if alive:
                return None
        session = ClusterSession(session_id, current.peer)
        session.name = current.name
        session.tag = state.tag
        session.grace = state.grace_ms / 1000
        value = self.records.record_value(session, connected=True)
        claimed = await calls.txn(
            [compare_mod(record_key, "==", record.mod_revision)],
            [put_op(record_key, value, lease)],
            [range_op(record_key)],
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
        # While they move (several txns for many entries) and until their holds are
        # recorded, the sweep leaves them: moved but not yet held, they would look
        # like strays of this session.
        self.ledger.by_tag[session.tag] = session
        self.ledger.adopting.add(session.tag)
        try:
            await self._adopt_entries(session, record.lease)
        except BackendUnavailable:
            if self.ledger.by_tag.get(session.tag) is session:
                del self.ledger.by_tag[session.tag]
            # Let a later conn_id (here or elsewhere) try again.
            self.calls.spawn(lambda: self._release_claim(session), "session record")
            raise
        finally:
            self.ledger.adopting.discard(session.tag)
        if session_id in self.ledger.sessions:
            return None
        self.ledger.sessions[session_id] = session
        self._forget_empty(current)
        return session

    async def _release_claim(self, session: ClusterSession) -> None:
        """A takeover that failed: its record says nobody is connected, so another
        ``conn_id`` may try (the record stays on this node's lease until then)."""
        record_key = self.layout.session_record(session.id)
        value = self.records.record_value(session, connected=False)
        await self.calls.txn(
            [compare_mod(record_key, "==", session.record_revision)],
            [put_op(record_key, value, self.lease.current())],
        )

    def _adopt_local(self, target: ClusterSession, current: ClusterSession) -> None:
        self.ledger.adopt(target, current)
        self._forget_empty(current)

    def _forget_empty(self, session: ClusterSession) -> None:
        """The connection's own session, empty, once it has taken over another."""
        session.connected = False
        self.ends.forget(session)

    async def _adopt_entries(self, session: ClusterSession, old_lease: int) -> None:
        """Take over the entries of a session whose node is gone: those of requests
        that hold every lock they are in become holds here (a ``ttl`` restarts in
        full) and move onto this node's lease; the others are deleted, since their
        requests died with the old connection. An entry a ``kill`` marked is left
        where it is, never held here: it goes with the old node's lease, by which
        time the old node can no longer confirm it to anyone.
        Each move is guarded by our claim of the record and the entry's create
        revision: if the old node's lease ran out meanwhile, etcd has freed the
        entries, nothing moves, and the takeover fails."""
        await self._mirror_reaches(session.record_revision)
        # Each request's entries (one revision; several keys for mlock), and
        # whether each holds its lock.
        requests: dict[int, list[tuple[EntryName, KeyValue, bool]]] = {}
        for etcd_key, _ in self.mirror.entries_on(session.tag, old_lease):
            name = self.layout.parse_entry(etcd_key)
            if name is None:
                continue
            queue_prefix = self.layout.queue_prefix(name.kind, name.key)
            _, kvs, _ = await self.calls.get(
                queue_prefix, prefix_end(queue_prefix), sort_by_create=True
            )
            position = next((i for i, kv in enumerate(kvs) if kv.key == etcd_key), None)
            if position is None:
                continue
            mine = kvs[position]
            if parse_entry_value(mine.value).killed:
                continue  # revoked by an operator: it goes with the old node's lease
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
        lease = self.lease.current()
        guard = self.records.record_guard(session)
        for start in range(0, max(len(kept), len(strays)), MOVES_PER_TXN):
            moving = kept[start : start + MOVES_PER_TXN]
            gone = strays[start : start + MOVES_PER_TXN]
            # Each moved entry is guarded by its mod revision too: a kill's mark
            # keeps the create revision, and a move of the value read before it
            # would erase the mark (the takeover then fails; the kill stands).
            result = await self.calls.txn(
                [guard]
                + [compare_create(kv.key, "==", kv.create_revision) for kv in moving]
                + [compare_mod(kv.key, "==", kv.mod_revision) for kv in moving],
                [put_op(kv.key, kv.value, lease) for kv in moving]
                + [
                    txn_op([compare_create(kv.key, "==", kv.create_revision)], [delete_op(kv.key)])
                    for kv in gone
                ],
            )
            if not result.succeeded:
                raise BackendUnavailable("the session's entries were freed while moving")

    async def _mirror_reaches(self, revision: int) -> None:
        """Wait until the mirror has seen ``revision``: it then knows every entry
        created before it."""
        await mirror_reaches(self.mirror, revision, self.calls.deadline)
