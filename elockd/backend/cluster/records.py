"""Session records: which node serves a session, proven in etcd.

A session that takes a lock gets a random *tag*, which names it in its entries'
keys, and a record (``<root>s/<hash of id>``, see
:class:`~elockd.backend.cluster.layout.SessionRecord`) that names the node serving
it and its tag, on the node's lease (:mod:`.lease`). Every write that frees
something of a session compares the record's revision with this node's last write
of it (:meth:`SessionRecords.record_guard`): a node that lost a session to a
``conn_id`` elsewhere, through a pause or a late timer, frees nothing. So the
guarded deletes of a session's entries live here too, with the guard they carry.

A record another node has written since ours means that node took the session
over: this module notices (the mirror's watch, or a recheck after it was behind)
and hands the session to ``moved`` (:class:`.ends.SessionLoss`), which lets it go.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

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
    Layout,
    SessionRecord,
    encode_record,
    parse_record,
)
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import ClusterHold, ClusterSession, Ledger
from elockd.backend.interface import BackendUnavailable

#: Guarded deletes per txn: etcd's default --max-txn-ops is 128.
DELETES_PER_TXN = 64


class SessionRecords:
    """This node's claim on its sessions in etcd: their tags and records, the guard
    every free carries, and the guarded deletes of their entries. ``moved`` is told
    of a session another node has claimed."""

    def __init__(
        self,
        calls: EtcdCalls,
        ledger: Ledger,
        layout: Layout,
        lease: NodeLease,
        node_id: str,
        moved: Callable[[ClusterSession, str], None],
    ) -> None:
        self.calls = calls
        self.ledger = ledger
        self.layout = layout
        self.lease = lease
        self.node_id = node_id
        self._moved = moved

    # ----------------------------------------------------------------- record

    async def ensure_record(self, session: ClusterSession) -> int:
        """The session's tag, given (and its record written) on first use."""
        if session.lost:
            raise BackendUnavailable("session lost")
        await self.lease.wait_for_lease()  # fails closed, before a tag or record, without one
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

    def record_value(self, session: ClusterSession, *, connected: bool) -> bytes:
        """The session's record as this node writes it."""
        grace_ms = round(session.grace * 1000)
        return encode_record(SessionRecord(self.node_id, connected, grace_ms, session.tag))

    async def write_record(self, session: ClusterSession, *, connected: bool | None = None) -> bool:
        """Write the session's record, guarded by our last write of it: False when
        another node has claimed the session meanwhile (it is then let go here)."""
        async with session.record_lock:  # one write at a time, each on the last one
            for _ in range(3):
                if not session.tag or session.lost or not self.lease.id:
                    return False  # ended or lost meanwhile
                lease = self.lease.id
                record_key = self.layout.session_record(session.id)
                # Unless told, the state at the time of the write: writes queued
                # behind each other then end on the session's latest state.
                now_connected = session.connected if connected is None else connected
                value = self.record_value(session, connected=now_connected)
                guard = (
                    compare_mod(record_key, "==", session.record_revision)
                    if session.record_revision
                    else compare_create(record_key, "==", 0)
                )
                put = put_op(record_key, value, lease)
                result = await self.calls.txn([guard], [put], [range_op(record_key)])
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
            self._moved(session, "its record changed")
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
        no longer has (strays on its lease, see the node's sweep) or a ``kill``'s
        entries whose holds it dropped (their acknowledgement, :mod:`.operators`),
        each only while
        it still hangs on this node's lease: another node that took the session over
        by ``conn_id`` may have moved it onto its own, keeping its create revision,
        and holds it now. ``with_record``:
        the session's record goes too, with the last batch, so that if a txn fails
        midway the record and its guard stay and the sweep frees the rest. False
        once the guard fails: the session is another node's now, and so is the rest."""
        lease = self.lease.id

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
            result = await self.calls.txn(guard, batch)
            if not result.succeeded:
                return False
        return True

    # -------------------------------------------------- claimed by another node

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
            self._moved(session, f"node {parse_record(event.kv.value).node} claimed it")

    async def recheck_records(self) -> None:
        """After the mirror was reloaded: the session-record changes the watch
        missed, so a session another node claimed meanwhile is let go here (see
        :meth:`record_changed`). Its callers have their own rule for etcd not
        answering (start-up retries, the watch's reload loop, a background job
        counts it), so etcd's errors come out as they are."""
        sessions = self.layout.sessions
        _, records, _ = await self.calls.unmapped.get(sessions, prefix_end(sessions))
        for record in records:
            session = self._claimed_elsewhere(record)
            if session is not None:
                self._moved(session, "claimed by another node while the watch was behind")
