"""The node's life in the cluster: join, stay current and alive, sweep, leave.

Joining loads the token floor (the first node of a new cluster writes it), starts
the node's heartbeat (a key under a short lease of its own, by which other nodes
judge whether its sessions may be taken over), gets the node's lease that every
session record and entry of the node hangs on (``--session-ttl``), and loads the
mirror of every queue. Then, until cancelled, three loops run side by side: the
watch that keeps the mirror current (and reloads it when etcd has compacted past
it), the heartbeat, and the keepalive of the node's lease (every TTL/3, one call
however many sessions), each round of which starts the sweep of stray entries
(which runs beside the next rounds if it takes that long).
Leaving revokes the node's lease, so its sessions' locks go at once rather than
after the session TTL.

These are the node's own loops; a request never runs them. What they find, a
lease gone or a session claimed elsewhere, they hand to :mod:`.lease` and
:mod:`.records`, which decide what it means for the sessions. Each has its own rule
for etcd not answering (retry at start-up, count a failed round, reload the
mirror), so their calls go through ``calls.unmapped`` (see :mod:`.calls`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.ends import SessionEnds
from elockd.backend.cluster.etcd.client import (
    EtcdError,
    EtcdUnavailable,
    WatchCompacted,
    compare_create,
    prefix_end,
    put_op,
    range_op,
)
from elockd.backend.cluster.layout import Layout
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import ClusterSession, Ledger
from elockd.backend.cluster.mirror import QueueMirror
from elockd.backend.cluster.operators import ClusterOperators
from elockd.backend.cluster.records import SessionRecords
from elockd.backend.interface import BackendUnavailable

log = logging.getLogger("elockd.cluster")

#: Seconds a node waits for etcd to release its sessions when it shuts down.
SHUTDOWN_GRACE = 2.0
#: Seconds at least between two rounds of the node's keepalive and sweep, when
#: etcd did not answer the last (see :meth:`ClusterNode._keep_alive`).
KEEPALIVE_RETRY = 0.5
#: Entries one round of the stray sweep looks at (about 25 ms of the node's thread):
#: a node whose own sessions hold more is swept over several rounds, so the round,
#: which runs between two keepalives, never holds up its clients or its lease.
SWEEP_BUDGET = 20_000


class ClusterNode:
    """One elockd node's membership of the cluster, and the background loops that
    keep its sessions alive: the node's lease (:class:`~.lease.NodeLease`) kept,
    their records (:class:`~.records.SessionRecords`) rechecked, their strays swept."""

    def __init__(
        self,
        calls: EtcdCalls,
        ledger: Ledger,
        layout: Layout,
        mirror: QueueMirror,
        lease: NodeLease,
        records: SessionRecords,
        ends: SessionEnds,
        node_id: str,
    ) -> None:
        self.calls, self.ledger, self.layout, self.mirror = calls, ledger, layout, mirror
        self.lease, self.records, self.ends = lease, records, ends
        self.node_id = node_id
        self.session_ttl = lease.ttl
        self._node_lease = 0
        #: A predecessor's heartbeat lease and the lease its sessions hang on, taken
        #: over with its books (docs/upgrade.md).
        self.adopted_lease = 0
        self.adopted_sessions_lease = 0
        #: Sessions taken over whose connection could not move (TLS): they end by
        #: their usual rules once the node runs, since ending writes to etcd.
        self.ended_at_join: list[ClusterSession] = []
        #: Loops of other parts that run beside the node's own once it has joined
        #: (the throttles' sweep).
        self.loops: list[Callable[[], Awaitable[None]]] = []
        #: ``ls``/``watch``/``kill``: told when the mirror was loaded afresh.
        self.operators: ClusterOperators | None = None
        #: A predecessor's watchers had every event up to this revision: the mirror
        #: is loaded as of it and the watch replays from just after it, so they
        #: miss nothing and get nothing twice (docs/cluster.md).
        self.replay_from = 0
        #: Tags of sessions on the node's lease that the last sweep round had no
        #: budget left for (the next round goes on with them), last first.
        self._sweep_tags: list[int] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join the cluster, then keep leases alive and the mirror current until
        cancelled; on the way out, revoke the node's lease so its sessions' locks go
        at once rather than after the session TTL."""
        await self.calls.until_answered(self._load_token_floor)
        if self.adopted_lease:
            # The predecessor's heartbeat lease, so that its sessions' records still
            # name a live node; a new one if it ran out meanwhile.
            adopted = self.adopted_lease
            self._node_lease = await self.calls.until_answered(
                lambda: self._renew_heartbeat(adopted)
            )
        else:
            self._node_lease = await self.calls.until_answered(self._start_heartbeat)
        adopted_sessions_lease = self.adopted_sessions_lease
        await self.calls.until_answered(lambda: self.lease.adopt(adopted_sessions_lease))
        await self.calls.until_answered(self._load_mirror)
        if self.adopted_lease:
            # Records claimed elsewhere while the predecessor was handing over.
            await self.calls.until_answered(self.records.recheck_records)
        try:
            async with trio.open_nursery() as nursery:
                self.calls.nursery = nursery
                nursery.start_soon(self.calls.run_batches)
                nursery.start_soon(self._watch)
                nursery.start_soon(self._keep_alive)
                nursery.start_soon(self._heartbeat)
                nursery.start_soon(self.lease.enforce_deadline)
                for loop in self.loops:
                    nursery.start_soon(loop)
                for session in self.ended_at_join:
                    self.ends.disconnect(session, trio.current_time())
                self.ended_at_join = []
                log.info("node %s joined at revision %d", self.node_id, self.mirror.revision)
                task_status.started()
        finally:
            self.calls.nursery = None
            # Handed over, the successor runs these sessions and this node's heartbeat.
            if not self.calls.handed_over:
                with trio.move_on_after(SHUTDOWN_GRACE) as cleanup:
                    cleanup.shield = True
                    async with trio.open_nursery() as ends:
                        ends.start_soon(self.lease.revoke)
                        ends.start_soon(self.calls.revoke_quietly, self._node_lease)
                    self.lease.set(0, math.inf)

    # ------------------------------------------------------------------- join

    async def _load_token_floor(self) -> None:
        """The first node of a new cluster records the wall clock in nanoseconds as
        the floor under every token: a cluster rebuilt empty later starts above it."""
        floor_key = self.layout.token_floor
        etcd = self.calls.unmapped
        result = await etcd.txn(
            [compare_create(floor_key, "==", 0)],
            [put_op(floor_key, b"%d" % time.time_ns())],
            [range_op(floor_key)],
        )
        if result.succeeded:
            _, kvs, _ = await etcd.get(floor_key)
        else:
            kvs = result.kvs(0)
        self.ledger.token_floor = int(kvs[0].value) if kvs else 0

    async def _start_heartbeat(self, *, urgent: bool = False) -> int:
        lease, _ = await self.calls.unmapped.lease_grant(self._heartbeat_ttl())
        await self._beat(lease, urgent=urgent)
        return lease

    async def _renew_heartbeat(self, lease: int, *, urgent: bool = False) -> int:
        """Keep the heartbeat ``lease`` alive and write the node's key on it, or
        start a new one if it ran out: the lease the heartbeat goes on with."""
        if await self.calls.unmapped.lease_keepalive(lease) == 0:
            return await self._start_heartbeat(urgent=urgent)
        await self._beat(lease, urgent=urgent)
        return lease

    async def _beat(self, lease: int, *, urgent: bool) -> None:
        pid = b"%d" % os.getpid()
        await self.calls.unmapped.put(self.layout.node(self.node_id), pid, lease, urgent=urgent)

    @property
    def heartbeat_lease(self) -> int:
        return self._node_lease

    async def _load_mirror(self) -> None:
        """The queues and the throttle keys, read at one revision (one txn): the
        current one, or the one a predecessor's watchers had reached when they came
        along (:attr:`replay_from`). Then every hold of the books whose entry is not
        there is dropped (freed while nobody here watched)."""
        at = self.replay_from if self.ledger.watchers.count else 0
        try:
            await self._read_mirror(at)
        except EtcdError as error:
            if not at:
                raise
            log.warning(
                "cannot replay the watch from revision %d (%s): the watchers that "
                "came along are closed",
                at,
                error.message,
            )
            await self._read_mirror(0)
            if self.operators is not None:
                self.operators.overflow_all()
        self.replay_from = 0
        if self.operators is not None:
            self.operators.drop_vanished()

    async def _read_mirror(self, at: int) -> None:
        queues, throttles = self.layout.queues, self.layout.throttles
        result = await self.calls.unmapped.txn(
            [],
            [
                range_op(queues, prefix_end(queues), revision=at),
                range_op(throttles, prefix_end(throttles), revision=at),
            ],
        )
        self.mirror.load(at or result.revision, [*result.kvs(0), *result.kvs(1)])

    # ------------------------------------------------------------------ loops

    async def _watch(self) -> None:
        root = self.layout.root
        while True:
            try:
                # Every node writes its heartbeat under the root every TTL/3, so a
                # stream quiet for a whole TTL comes from a hung member.
                watch = self.calls.watch(
                    root, prefix_end(root), self.mirror.revision + 1, silence=self.session_ttl
                )
                async for events in watch:
                    self.mirror.catch_up_to(watch.created_at)
                    self.mirror.apply(events)
            except WatchCompacted:
                log.warning("watch fell behind etcd's compaction: reloading every queue")
                if self.operators is not None:
                    self.operators.overflow_all()  # they would miss what was compacted
                while True:
                    try:
                        await self._load_mirror()
                        await self.records.recheck_records()
                        break
                    except (EtcdUnavailable, EtcdError):
                        await trio.sleep(0.5)

    async def _keep_alive(self) -> None:
        """Every TTL/3: one keepalive of the node's lease (or a new lease), then the
        stray sweep (beside the next rounds, if it takes that long). Sooner when the
        lease is gone (at once), or when etcd failed a
        call since the last round (KEEPALIVE_RETRY after it): a keepalive that failed
        is tried again soon, since everything of the node's sessions hangs on the
        lease, and a free that etcd refused is swept as soon as etcd answers, so that
        its key is free again within moments of etcd's return. After a failure the
        rounds go on every KEEPALIVE_RETRY for two etcd deadlines once etcd answers
        again: a write etcd refused may still commit when its members come back (the
        leader kept it in its log), and its entry reaches the mirror only then."""
        async with trio.open_nursery() as sweeps:
            await self._keep_alive_rounds(sweeps)

    async def _keep_alive_rounds(self, sweeps: trio.Nursery) -> None:
        """:meth:`_keep_alive`'s rounds; the sweeps run in ``sweeps``, beside them:
        over a slow link to etcd a sweep of many strays takes many round trips, and
        a keepalive held up behind it would lose a lease etcd is still renewing."""
        period = self.session_ttl / 3
        lease, calls = self.lease, self.calls
        last_round = trio.current_time()  # the lease was just granted
        failed = False
        settle_until = -math.inf  # rounds come every KEEPALIVE_RETRY until then
        while True:
            next_round = last_round + period
            if last_round < settle_until:
                next_round = last_round + KEEPALIVE_RETRY
            with trio.move_on_at(next_round):
                await calls.keeper_wanted.wait()
            if calls.keeper_wanted.is_set():  # something failed since the last round
                settle_until = trio.current_time() + 2 * calls.deadline
            if failed or lease.id:
                # Only a lease just lost hurries: never more often than
                # KEEPALIVE_RETRY otherwise, however many calls fail meanwhile.
                await trio.sleep_until(last_round + KEEPALIVE_RETRY)
            last_round = trio.current_time()
            failed = True
            if calls.handed_over:
                return  # the successor keeps the lease alive now
            lease.check_expiry()  # a lease found gone here is this round's to renew
            # Anything that fails from here on calls for another round.
            calls.keeper_wanted = trio.Event()
            try:
                await lease.keep_alive()
            except (EtcdUnavailable, EtcdError):
                calls.unavailable("node lease keepalive")
                continue
            failed = False
            if not calls.frozen and not sweeps.child_tasks:  # one sweep at a time;
                sweeps.start_soon(self._sweep)  # whoever serves on sweeps

    async def _heartbeat(self) -> None:
        """The node's own lease, renewed in a loop of its own (a slow session
        keepalive must not let it lapse), and a write of its key: that write is also
        what keeps every node's watch from falling silent (see :meth:`_watch`)."""
        ttl = self._heartbeat_ttl()
        while True:
            await trio.sleep(ttl / 4)
            if self.calls.handed_over:
                return  # the successor beats for this node now
            try:
                self._node_lease = await self._renew_heartbeat(self._node_lease, urgent=True)
            except (EtcdUnavailable, EtcdError):
                self.calls.unavailable("node heartbeat")

    def _heartbeat_ttl(self) -> int:
        return max(2, self.session_ttl // 2)

    async def _sweep(self) -> None:
        """Delete entries on the node's lease that no hold and no running request
        owns: left by a free that etcd refused, a request cancelled while its txn
        was in flight, an answer lost after a commit, or a session this node no
        longer has. Judged on the mirror, and every delete is guarded by the entry's
        revision (and by the session record, for a session the node still has).

        Only the sessions with entries on this node's lease are looked at (the mirror
        knows them by lease, :meth:`~.mirror.QueueMirror.tags_on`), at most
        :data:`SWEEP_BUDGET` entries a round; a round goes on where the last one
        stopped."""
        lease = self.lease.id
        if not lease:
            return
        now = trio.current_time()
        moved, adopting = self.ledger.moved_tags, self.ledger.adopting
        for tag, until in list(moved.items()):
            if until < now:
                del moved[tag]
        tags = self._sweep_tags
        if not tags:
            tags.extend(reversed(self.mirror.tags_on(lease)))
        budget = SWEEP_BUDGET
        while tags and budget > 0:
            tag = tags.pop()
            session = self.ledger.by_tag.get(tag)
            if (session is not None and session.lost) or tag in moved or tag in adopting:
                continue
            entries = self.mirror.entries_on(tag, lease)
            budget -= len(entries) + 1
            if session is None:
                strays = entries
            else:
                held = dict(self.records.entries(self.ledger.holds(session)))
                strays = [
                    (key, revision)
                    for key, revision in entries
                    if key not in session.pending and held.get(key) != revision
                ]
            if strays:
                try:
                    await self.records.delete_entries(session, strays)
                except (EtcdUnavailable, EtcdError, BackendUnavailable):
                    tags.append(tag)  # first in the next round
                    return
