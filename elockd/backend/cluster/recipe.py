"""The lock recipe: how a request takes and frees locks in etcd's queues.

The counterpart of etcd's ``concurrency/mutex.go``, for exclusive, shared and
multi-key locks. A request enters every queue it asks for in one transaction,
its entries named by its session's tag and bound to the node's lease
(:mod:`.lease`); it holds when the grant rule
(:mod:`.mirror`) says so at the revision of that transaction, and otherwise waits
until the node's mirror of the queues reaches a revision where it does. A try
(``g``, ``lock K`` without a wait) enters only if the queue is empty, in the same
one transaction. A shared grant with a limit is then marked held in etcd, so that
every node counts the same holders. Frees are guarded by the entry's revision and
the session record: only the entry this request created, only while this node
still owns the session.

It asks :mod:`.records` for a session's tag, the guard and guarded deletes,
:mod:`.lease` for the node's lease and whether it is still within its deadline,
and :mod:`.tokens` for its new entries' ranks, and writes grants and frees into
the node's books (:mod:`.ledger`). It never ends a session itself and calls etcd
(through :mod:`.calls`) only for a request that waits for the answer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.etcd.client import (
    KeyValue,
    compare_create,
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
    encode_entry_value,
    entry_value,
    parse_entry_value,
)
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import ClusterHold, ClusterSession, ClusterWait, Ledger
from elockd.backend.cluster.mirror import (
    GRANTED,
    LOST,
    ClusterWaiter,
    QueueMirror,
    granted_kvs,
    holders_after_handover,
    may_grant_shared,
    shared_rule_input,
)
from elockd.backend.cluster.records import SessionRecords
from elockd.backend.cluster.tokens import RankCounter, rank_of
from elockd.backend.interface import BackendUnavailable, Grant, Holders, QueueFull
from elockd.engine.sessions import Session
from elockd.engine.watchers import RELEASED

log = logging.getLogger("elockd.cluster")

#: Guarded puts per txn: etcd's default --max-txn-ops is 128.
PUTS_PER_TXN = 64


class LockRecipe:
    """Acquire, release and renew, and the reads ``i``/``d``/``info`` make, for this
    node's sessions: built on the node's lease and the sessions' records, as etcd's
    Mutex on its Session."""

    def __init__(
        self,
        calls: EtcdCalls,
        ledger: Ledger,
        layout: Layout,
        mirror: QueueMirror,
        lease: NodeLease,
        records: SessionRecords,
        max_waiters: int,
    ) -> None:
        self.calls, self.ledger, self.layout, self.mirror = calls, ledger, layout, mirror
        self.lease, self.records = lease, records
        self.max_waiters = max_waiters
        self.ranks = RankCounter()

    # ---------------------------------------------------------------- acquire

    async def acquire(
        self,
        session: ClusterSession,
        kind: bytes,
        keys: Sequence[bytes],
        *,
        limit: int,
        ttl: float | None,
        wait: float,
    ) -> Grant:
        """Take ``keys`` all or nothing (several only for exclusive ``mlock``).

        ``limit``: 1 for exclusive, N for shared with a limit, 0 for shared without
        one. ``wait`` 0 tries once; otherwise the request queues FIFO for at most
        ``wait`` seconds.
        """
        table = session.shared if kind == SHARED else session.exclusive
        if session.tag:
            self.lease.confirm(session)  # what it holds is confirmed below
        missing = list(dict.fromkeys(k for k in keys if k not in table))
        now = trio.current_time()
        for key in keys:
            own = table.get(key)
            if own is not None and ttl is not None:
                assert isinstance(own, ClusterHold)
                own.ttl = ttl
                self.ledger.set_lease(own, now + ttl)
        if not missing:
            count = await self._holders(keys[0]) if kind == SHARED else 0
            return Grant(True, count)
        self.ledger.check_hold_room(session, len(missing))
        if wait and any(self._waiting(kind, key) >= self.max_waiters for key in missing):
            raise QueueFull
        tag = await self.records.ensure_record(session)
        entries = [self.layout.entry(kind, k, tag) for k in missing]
        await self._free_own_strays(session, entries)
        # From here until the request ends, its entries are not strays, whatever
        # state the txns leave them in (see the node's sweep); after it, they are.
        session.pending.update(entries)
        try:
            return await self._request(session, kind, missing, entries, limit, ttl, wait)
        finally:
            if self.ledger.suspended_wait(session) is None:
                # Unless a hand-over keeps the wait: its entries stay this session's.
                session.pending.difference_update(entries)

    async def _free_own_strays(self, session: ClusterSession, entries: list[bytes]) -> None:
        """Delete this session's own entries at the keys a new request is about to
        create, that no hold and no request of it owns: left by a release etcd did
        not confirm (the hold is gone here, the entry may not be). The sweep would
        free them soon after etcd answers again; until then the new entry could not
        be created and the request would be refused for a lock its client no longer
        holds."""
        strays = [
            (etcd_key, entry.revision)
            for etcd_key in entries
            if etcd_key not in session.pending and (entry := self.mirror.entry(etcd_key))
        ]
        if strays and not await self.records.delete_entries(session, strays):
            raise BackendUnavailable("session taken over by another node")

    def _waiting(self, kind: bytes, key: bytes) -> int:
        """Requests waiting for ``key`` now (``--max-waiters`` counts these, cluster
        wide): every entry of its queue but those that hold, and this node's own
        waiting requests that etcd has answered and the mirror does not show yet
        (a node reads its own writes; other nodes' come with the watch)."""
        queue_id = (kind, key)
        unseen = self.mirror.unseen_waiting(queue_id)
        queue = self.mirror.queues.get(queue_id)
        if queue is None:
            return unseen
        return unseen + (queue.waiting() if kind == SHARED else len(queue.revisions) - 1)

    async def _request(
        self,
        session: ClusterSession,
        kind: bytes,
        keys: list[bytes],
        entries: list[bytes],
        limit: int,
        ttl: float | None,
        wait: float,
    ) -> Grant:
        now = trio.current_time()
        # Before the ranks: a request refused after taking them would leave a gap
        # in the count the batcher keeps tokens unique by (see .tokens).
        lease = self.lease.current()
        ranks, ranks_taken = self.ranks.take(keys)
        owner, peer = session.owner, session.peer
        at = time.time()  # what ls ages the hold from, on every node
        values = [entry_value(limit, ttl, owner, rank=ranks[k], peer=peer, at=at) for k in keys]
        # Anything of ours created at or before this revision is not this request's:
        # a stray the sweep may be deleting right now (see the node's sweep).
        start = self.mirror.revision
        if kind == EXCLUSIVE and not wait:
            return await self._try_exclusive(
                session, keys, entries, values, lease, ttl, start, ranks, ranks_taken
            )
        revision, holds_now, holders = await self._enqueue(
            session, kind, keys, entries, values, lease, limit, start, ranks_taken
        )
        if holds_now and kind == SHARED and limit:
            holds_now = await self._mark_held(entries[0], revision, limit, ttl, session)
        if holds_now and self._revoked(entries, revision):
            holds_now = False  # the wait (or the refusal) below takes its entries out
        if holds_now:
            grant = self._granted(session, kind, keys, revision, ttl, now, ranks, waited=False)
            if holders is not None:
                # This node's mirror may not have reached the grant yet: the reply
                # counts the holders etcd had at the grant's own revision.
                grant.count = holders
            return grant
        if not wait:
            await self.records.delete_entries(session, [(e, revision) for e in entries])
            return Grant(False, await self._holders(keys[0]))
        queued = trio.current_time()
        state = ClusterWait(
            session, kind, keys, entries, revision, limit, ttl, queued + wait, queued
        )
        return await self._wait_for(state)  # acquire keeps its entries pending

    async def _try_exclusive(
        self,
        session: ClusterSession,
        keys: list[bytes],
        entries: list[bytes],
        values: list[bytes],
        lease: int,
        ttl: float | None,
        start: int,
        ranks: dict[bytes, int],
        ranks_taken: int,
    ) -> Grant:
        """One txn: if every key's queue is empty, enter them all."""
        prefixes = [self.layout.queue_prefix(EXCLUSIVE, k) for k in keys]
        result = await self.calls.txn(
            [compare_create(p, "==", 0, prefix_end(p)) for p in prefixes],
            [put_op(e, v, lease) for e, v in zip(entries, values, strict=True)],
            [range_op(p, prefix_end(p), sort_by_create=True, limit=1) for p in prefixes],
            ranks=ranks_taken,
        )
        now = trio.current_time()
        heads = (
            []
            if result.succeeded
            else [result.kvs(i)[0] if result.kvs(i) else None for i in range(len(keys))]
        )
        if result.succeeded:
            revision = result.revision
        elif all(
            h is not None and h.key == e and h.create_revision > start
            for h, e in zip(heads, entries, strict=True)
        ):
            # An earlier attempt of this very txn committed before its answer was
            # lost (the client retried): the entries are ours and at the head.
            revision = heads[0].create_revision if heads[0] is not None else 0
        else:
            blocked = [
                k
                for k, h, e in zip(keys, heads, entries, strict=True)
                if h is not None and h.key != e
            ]
            return Grant(False, blocked=blocked)
        if self._revoked(entries, revision):
            await self.records.delete_entries(session, [(e, revision) for e in entries])
            return Grant(False, blocked=list(keys))
        return self._granted(session, EXCLUSIVE, keys, revision, ttl, now, ranks, waited=False)

    async def _enqueue(
        self,
        session: ClusterSession,
        kind: bytes,
        keys: list[bytes],
        entries: list[bytes],
        values: list[bytes],
        lease: int,
        limit: int,
        start: int,
        ranks_taken: int,
    ) -> tuple[int, bool, int | None]:
        """Enter every queue in one txn: (its revision, whether the new entries hold
        every lock at that revision, and for a shared lock its holders then; None
        when unknown)."""
        prefixes = [self.layout.queue_prefix(kind, k) for k in keys]
        shared = kind == SHARED  # the shared rule needs every entry's limit
        result = await self.calls.txn(
            [compare_create(e, "==", 0) for e in entries],
            [put_op(e, v, lease) for e, v in zip(entries, values, strict=True)]
            + [
                range_op(p, prefix_end(p), count_only=not shared, sort_by_create=shared)
                for p in prefixes
            ],
            [range_op(e) for e in entries],
            ranks=ranks_taken,
        )
        if result.succeeded:
            revision = result.revision
            if not shared:
                # Exclusive: ours holds when it is the only entry of every queue.
                counts = [result.count(len(entries) + i) for i in range(len(keys))]
                return revision, all(c == 1 for c in counts), None
            queue = result.kvs(len(entries))
            holding = len(granted_kvs(queue))  # ours included when it has no limit
            if limit == 0:
                return revision, True, holding
            granted = may_grant_shared(shared_rule_input(queue), revision, limit)
            return revision, granted, holding + 1
        found = [result.kvs(i) for i in range(len(entries))]
        revisions = {kvs[0].create_revision for kvs in found if kvs}
        if all(found) and len(revisions) == 1 and revisions.pop() > start:
            # A retried txn whose first attempt committed: use that revision, and
            # let the mirror judge it (the wait path, or a refusal for a try).
            return found[0][0].create_revision, False, None
        raise BackendUnavailable("an entry of this session is already queued")

    async def wait_for(self, state: ClusterWait) -> Grant:
        """Resume the wait of a request a hand-over stopped, here or on a predecessor
        (its entries kept their place in the queues meanwhile): :meth:`_wait_for`,
        with its entries kept from the sweep as :meth:`acquire` keeps a new
        request's."""
        # Not strays to the sweep until the request has ended (a shared grant is
        # marked held after the wait), or while a hand-over keeps the wait.
        state.session.pending.update(state.entries)
        try:
            return await self._wait_for(state)
        finally:
            if not state.suspended:
                state.session.pending.difference_update(state.entries)

    async def _wait_for(self, state: ClusterWait) -> Grant:
        """Wait until the mirror grants ``state``'s entries, or its deadline.

        While a hand-over copies the books (``calls.frozen``) the outcome waits: a
        grant or a timeout is whoever serves the connection next's to give. If this
        task ends meanwhile, the wait is kept, suspended, entries and all."""
        ledger, calls = self.ledger, self.calls
        session, kind, keys, entries = state.session, state.kind, state.keys, state.entries
        revision, limit, ttl = state.revision, state.limit, state.ttl
        waiter = ClusterWaiter([(kind, k) for k in keys], limit)
        waiter.revision = revision
        woken = trio.Event()
        waiter.wake = woken.set
        state.suspended = False
        ledger.waits[session.id] = state
        ledger.local_waiting += 1
        self.mirror.add_waiter(waiter)
        try:
            with calls.resting():
                while True:
                    with trio.move_on_at(state.deadline):
                        await woken.wait()
                    if not calls.frozen:
                        break
                    await calls.thawed()
            if waiter.state == GRANTED and not self._still_ours(session, entries, revision):
                waiter.state = LOST
        finally:
            ledger.local_waiting -= 1
            self.mirror.remove_waiter(waiter)
            kept = calls.frozen or calls.handed_over
            if kept:
                state.suspended = True  # entries, place and deadline move as they are
            elif ledger.waits.get(session.id) is state:
                del ledger.waits[session.id]
            now = trio.current_time()
            if ledger.on_wait_end is not None and not kept:
                ledger.on_wait_end(kind == SHARED, now - state.since)
            if waiter.state != GRANTED and not kept:
                # Timed out, lost, or the peer left: take our entries out of the
                # queues (also when this task is being cancelled). If etcd cannot
                # be reached now, the stray sweep deletes them later.
                with trio.move_on_after(calls.deadline + 1) as scope:
                    scope.shield = True
                    with contextlib.suppress(BackendUnavailable):
                        await self.records.delete_entries(session, [(e, revision) for e in entries])
        if waiter.state == GRANTED and kind == SHARED:
            with trio.CancelScope(shield=True):  # an unmarked grant would block the queue
                marked = await self._mark_held(entries[0], revision, limit, ttl, session)
            # The mark awaited etcd: a kill may have marked (and this node deleted)
            # the entry meanwhile, as for a grant from a txn's answer.
            if not marked or not self._still_ours(session, entries, revision):
                waiter.state = LOST
        if waiter.state == GRANTED:
            ranks = {
                key: rank_of(self.mirror.entry(entry))
                for key, entry in zip(keys, entries, strict=True)
            }
            return self._granted(session, kind, keys, revision, ttl, now, ranks, waited=True)
        if session.lost:
            raise BackendUnavailable("session lost: this node's etcd lease ran out")
        ledger.timeouts += 1
        if kind == SHARED:
            return Grant(False, await self._holders(keys[0]))
        return Grant(False, blocked=[k for k in keys if self._held_by_other(session, k)])

    def _check_token_order(self, keys: list[bytes], revision: int) -> None:
        """The tripwire under the grant rule: a key's fencing tokens never go back.
        A grant below a hold the mirror has seen come and go is refused, loudly."""
        key = self.mirror.granted_after(keys, revision)
        if key is not None:
            held = self.mirror.queues[(EXCLUSIVE, key)].held_up_to
            log.error(
                "refused a grant of %r at revision %d: revision %d held it already "
                "(its fencing token would go back)",
                key[:200],
                revision,
                held,
            )
            raise BackendUnavailable("refused a grant whose fencing token would go back")

    def _still_ours(self, session: ClusterSession, entries: list[bytes], revision: int) -> bool:
        """A grant the mirror gave: is each entry still the one this request's own
        txn created, on the node's current lease? The mirror shows etcd as of its
        revision, which may trail etcd (a slow or replayed watch); the lease being
        within its local deadline (checked by :meth:`_granted`) is what proves etcd
        has not expired the entries since. An entry an operator's ``kill`` marked
        while the request was being woken is not granted: its node (this one)
        acknowledges the kill by deleting it."""
        self.lease.check_expiry()
        if session.lost or not self.lease.id or self.lease.past_deadline():
            return False
        for etcd_key in entries:
            found = self.mirror.entry(etcd_key)
            if found is None or found.revision != revision or found.lease != self.lease.id:
                return False
            if found.killed:
                return False
        return True

    def _revoked(self, entries: list[bytes], revision: int) -> bool:
        """Did an operator's ``kill`` mark an entry of this request before its grant
        was given (the node's watch brought the mark before the txn's answer was
        acted on)? This node acknowledges the kill by deleting the entry, after
        which another node may grant the key: the grant is not given. Nor is it when
        the mirror, past the request's revision, no longer has the entry: the
        acknowledgement may already have deleted it while the txn's answer was on
        its way (a slow reply), and the key may be someone else's by now."""
        reached = self.mirror.revision >= revision
        for etcd_key in entries:
            found = self.mirror.entry(etcd_key)
            if found is None or found.revision != revision:
                if reached:
                    return True
            elif found.killed:
                return True
        return False

    def _held_by_other(self, session: ClusterSession, key: bytes) -> bool:
        queue = self.mirror.queues.get((EXCLUSIVE, key))
        if queue is None or not queue.revisions:
            return False
        return queue.entries[queue.revisions[0]].tag != session.tag

    def _granted(
        self,
        session: ClusterSession,
        kind: bytes,
        keys: list[bytes],
        revision: int,
        ttl: float | None,
        now: float,
        ranks: dict[bytes, int],
        *,
        waited: bool,
    ) -> Grant:
        # The moment of the grant: only under a lease within its local deadline,
        # and never with a token below one this node saw hold the lock before.
        self.lease.confirm(session)
        if kind == EXCLUSIVE:
            self._check_token_order(keys, revision)
        for key in keys:
            hold = self.ledger.record_hold(session, kind, key, revision, now, ranks[key])
            if ttl is not None:
                hold.ttl = ttl
                self.ledger.set_lease(hold, now + ttl)
        if kind == SHARED:
            # Ours counts even where the mirror has not seen its mark yet.
            queue = self.mirror.queues.get((SHARED, keys[0]))
            others = [e for e in queue.granted() if e.revision != revision] if queue else []
            return Grant(True, len(others) + 1)
        return Grant(True)

    async def _mark_held(
        self, entry: bytes, revision: int, limit: int, ttl: float | None, session: ClusterSession
    ) -> bool:
        """Record in etcd that a shared entry with a limit now holds (see
        :mod:`.mirror`): False when the entry is gone (the session was lost) or the
        session is another node's now (the put would move the entry back here)."""
        value = entry_value(limit, ttl, session.owner, held=True, peer=session.peer, at=time.time())
        self.lease.confirm(session)
        lease = self.lease.current()
        result = await self.calls.txn(
            [compare_create(entry, "==", revision), self.records.record_guard(session)],
            [put_op(entry, value, lease)],
        )
        return result.succeeded

    # ---------------------------------------------------------------- release

    async def release(self, session: ClusterSession, kind: bytes, key: bytes) -> Grant:
        """Free this session's hold: (was it held, holders left for shared). A hold
        whose entry is already gone (a retried delete that committed the first
        time, or a lost session) counts as released: the lock is free of it."""
        table = session.shared if kind == SHARED else session.exclusive
        hold = table.get(key)
        if hold is None:
            return Grant(False)
        assert isinstance(hold, ClusterHold)
        entry = self.records.entry_key(hold)
        # A shared release answers with the holders left; an exclusive one reads
        # nothing (less work for etcd on the busiest path).
        reads = []
        if kind == SHARED:
            prefix = self.layout.queue_prefix(kind, key)
            reads.append(range_op(prefix, prefix_end(prefix), sort_by_create=True))
        # Let go here first: if etcd does not answer, the stray sweep frees the entry
        # once it does (the client was asked to release, not to keep holding).
        self.ledger.drop(hold, trio.current_time(), RELEASED)
        result = await self.calls.txn(
            [self.records.record_guard(session)],
            [
                txn_op([compare_create(entry, "==", hold.revision)], [delete_op(entry)]),
                *reads,
            ],
            reads,
        )
        if not result.succeeded:
            # Another node took the session over (its watch event follows); what is
            # left, if anything, is the stray sweep's.
            return Grant(False)
        return Grant(True, holders_after_handover(result.kvs(1)) if reads else 0)

    async def release_all(self, session: ClusterSession) -> None:
        """Free every hold; if etcd refuses, the holds are gone here anyway and the
        stray sweep frees their entries once etcd answers."""
        holds = self.ledger.holds(session)
        entries = self.records.entries(holds)
        now = trio.current_time()
        for hold in holds:
            self.ledger.drop(hold, now, RELEASED)
        await self.records.delete_entries(session, entries)

    def renew(self, session: Session, key: bytes, ttl: float) -> bool:
        hold = session.exclusive.get(key) or session.shared.get(key)
        if hold is None:
            return False
        assert isinstance(hold, ClusterHold)
        hold.ttl = ttl
        self.ledger.set_lease(hold, trio.current_time() + ttl)
        return True

    async def rename(self, session: ClusterSession, name: bytes | None) -> None:
        """``iam``: the session's name, shown for its holds by ``d``, ``sd`` and
        ``info`` on every node. Each entry of the session carries its owner, so they
        are written again with the new one (each guarded by its create revision, so
        a freed one stays freed); a session that holds nothing writes nothing.

        The entries are those of the session's holds in this node's books, read
        from etcd: the mirror may not have reached a hold granted a moment ago (a
        try answers from its txn), and that entry would keep the old owner."""
        session.name = name
        # Its holds and the entries of its requests still in flight (a wait).
        keys = [self.records.entry_key(hold) for hold in self.ledger.holds(session)]
        keys += sorted(session.pending - set(keys))
        lease = self.lease.id
        for start in range(0, len(keys), PUTS_PER_TXN):
            batch = keys[start : start + PUTS_PER_TXN]
            read = await self.calls.txn([], [range_op(etcd_key) for etcd_key in batch])
            puts = []
            for index, etcd_key in enumerate(batch):
                found = read.kvs(index)
                if not found or found[0].lease != lease:
                    continue  # freed meanwhile, or moved to another node
                entry = parse_entry_value(found[0].value)
                if entry.killed:
                    continue  # revoked: its acknowledgement deletes it
                value = encode_entry_value(entry, owner=session.owner, peer=session.peer)
                put = put_op(etcd_key, value, lease)
                revision = found[0].create_revision
                puts.append(txn_op([compare_create(etcd_key, "==", revision)], [put]))
            if puts:
                await self.calls.txn([self.records.record_guard(session)], puts)

    # ------------------------------------------------------------------ reads

    async def queue(self, kind: bytes, key: bytes | None) -> list[tuple[bytes, list[KeyValue]]]:
        """A linearizable read of one queue (or every queue of a table), oldest first."""
        prefix = self.layout.queues + kind + b"/"
        if key is not None:
            prefix = self.layout.queue_prefix(kind, key)
        _, kvs, _ = await self.calls.get(prefix, prefix_end(prefix), sort_by_create=True)
        queues: dict[bytes, list[KeyValue]] = {}
        for kv in kvs:
            name = self.layout.parse_entry(kv.key)
            if name is not None:
                queues.setdefault(name.key, []).append(kv)
        return sorted(queues.items())

    async def _holders(self, key: bytes) -> int:
        queues = await self.queue(SHARED, key)
        return len(granted_kvs(queues[0][1])) if queues else 0

    async def holders(self, kind: bytes, key: bytes | None) -> Holders:
        """(lock name, owner, address) of every hold in a table, or of one key, names
        in byte order: read with one range read, and turned into rows as the caller
        goes (a dump streams)."""
        queues = await self.queue(kind, key)

        def rows() -> Holders:
            for name, kvs in queues:
                held = list(granted_kvs(kvs)) if kind == SHARED else kvs[:1]
                for kv in held:
                    value = parse_entry_value(kv.value)
                    yield name, value.owner, value.peer

        return rows()

    async def describe(self, key: bytes) -> tuple[KeyValue | None, int, int]:
        """``info``: the exclusive head entry, shared holders, requests waiting."""
        exclusive = await self.queue(EXCLUSIVE, key)
        shared = await self.queue(SHARED, key)
        head = exclusive[0][1][0] if exclusive else None
        waiting_exclusive = len(exclusive[0][1]) - 1 if exclusive else 0
        holders = len(granted_kvs(shared[0][1])) if shared else 0
        waiting_shared = len(shared[0][1]) - holders if shared else 0
        return head, holders, waiting_exclusive + waiting_shared
