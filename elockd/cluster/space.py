"""The lock space kept in etcd: what one elockd node does for its own sessions.

etcd decides; the node only asks. Each session that takes a lock opens one etcd
lease (``--session-ttl``) which the node keeps alive; every queue entry the session
creates is bound to it, so a clean disconnect frees everything with one revoke and
a dead node's sessions are freed by etcd when their leases run out. Grants follow
from the order of the entries (see :mod:`.mirror`); a fencing token is the entry's
create revision plus the cluster's stored token floor, so tokens increase across
keys, nodes and rebuilt clusters.

Rules kept from the in-memory engine: plain holds follow the session's grace time,
holds with ``ttl=`` outlive their connection until they expire (this node runs the
timers), and ``conn_id ID`` takes over a session that lives on without a connection,
on this node or (once its node is gone) on another. What etcd adds: when etcd has no
quorum every decision fails closed with :class:`~elockd.backend.BackendUnavailable`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import trio

from elockd.backend import BackendUnavailable, QueueFull, TooManyHolds
from elockd.cluster.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Event,
    KeyValue,
    WatchCompacted,
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
    entry_value,
    parse_entry_value,
    parse_record,
)
from elockd.cluster.mirror import (
    GRANTED,
    LOST,
    ClusterWaiter,
    QueueMirror,
    granted_kvs,
    holders_after_handover,
    may_grant_shared,
    shared_rule_input,
)
from elockd.deadlines import Deadlines
from elockd.logthrottle import LogThrottle
from elockd.sessions import Hold, Session

log = logging.getLogger("elockd.cluster")
#: A node waiting for etcd at start-up says so every 10 s, not every retry.
startup_wait_log = LogThrottle(log, logging.WARNING, 10.0)

T = TypeVar("T")

#: Seconds a node waits for etcd to release its sessions when it shuts down.
SHUTDOWN_GRACE = 2.0
#: Guarded deletes per txn: etcd's default --max-txn-ops is 128.
DELETES_PER_TXN = 64


class ClusterHold(Hold):
    """A hold whose truth is an etcd entry: ``revision`` guards its deletion."""

    __slots__ = ("revision", "ttl")

    def __init__(
        self, session: Session, key: bytes, shared: bool, revision: int, floor: int, now: float
    ) -> None:
        super().__init__(session, key, shared, floor + revision, now)
        self.revision = revision
        self.ttl: float | None = None


class ClusterSession(Session):
    """A session of this node, with the etcd lease its entries are bound to."""

    __slots__ = (
        "abort",
        "expires_at",
        "lease",
        "lost",
        "pending",
        "record_lock",
        "record_revision",
    )

    def __init__(self, session_id: str, peer: bytes) -> None:
        super().__init__(session_id, peer)
        self.lease = 0
        # Entries a request of this session is creating right now: not strays.
        self.pending: set[bytes] = set()
        self.expires_at = math.inf  # by this node's clock: when etcd may drop the lease
        self.record_revision = 0  # mod revision of our last write of its record
        self.record_lock = trio.Lock()
        self.lost = False
        self.abort: Callable[[], None] | None = None  # ends its connection


class Grant:
    """The outcome of a request: granted or not, the holders count for shared
    replies, and for a refused multi-key request the keys others hold."""

    __slots__ = ("blocked", "count", "granted")

    def __init__(self, granted: bool, count: int = 0, blocked: Sequence[bytes] = ()) -> None:
        self.granted = granted
        self.count = count
        self.blocked = list(blocked)


class _Counted:
    """A stand-in with only a length, for the ``q`` counters read as ``len(...)``."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    def __len__(self) -> int:
        return self._count()


class ClusterLockSpace:
    """This node's view of the lock space in etcd, and its sessions."""

    def __init__(
        self,
        client: EtcdClient,
        root: bytes,
        *,
        session_ttl: int = 5,
        max_waiters: int = 10_000,
        max_holds: int = 10_000,
    ) -> None:
        self.client = client
        self.layout = Layout(root)
        self.session_ttl = session_ttl
        self.max_waiters = max_waiters
        self.max_holds = max_holds
        self.node_id = secrets.token_hex(8)
        self.mirror = QueueMirror(self.layout, on_other=self._record_changed)
        self.token_floor = 0
        self.sessions: dict[str, ClusterSession] = {}
        self._deadlines: Deadlines[ClusterHold | ClusterSession] = Deadlines(_carries)
        self._nursery: trio.Nursery | None = None
        self._node_lease = 0
        self._by_lease: dict[int, ClusterSession] = {}
        self._taking: set[str] = set()  # session ids a conn_id is taking over now
        self._revoking: set[int] = set()  # leases of ended sessions not revoked yet
        self.on_new_deadline: Callable[[], None] | None = None
        self.on_hold_end: Callable[[bool, float], None] | None = None
        self.on_holds_end: Callable[[bool, list[float]], None] | None = None
        self.on_wait_end: Callable[[bool, float], None] | None = None
        # What `q` and /metrics read: this node's counters ...
        self.orphans = 0
        self.shared_orphans = 0
        self.expired = 0
        self.timeouts = 0
        self.leases = 0
        self.sessions_in_grace = 0
        self.sessions_lost = 0
        self.backend_unavailable = 0
        self.local_waiting = 0
        # ... and the cluster's lock counts, from the mirror.
        self.exclusive = _Counted(self.mirror.exclusive_locks)
        self.shared = _Counted(self.mirror.shared_locks)

    def extra_counters(self) -> dict[str, int]:
        """`q` lines only a cluster node has."""
        return {
            "backend_unavailable": self.backend_unavailable,
            "local_waiting": self.local_waiting,
            "sessions_lost": self.sessions_lost,
        }

    @property
    def shared_holders(self) -> int:
        return self.mirror.shared_holders()

    @property
    def waiting(self) -> int:
        return self.mirror.waiting()

    # ------------------------------------------------------------- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join the cluster, then keep leases alive and the mirror current until
        cancelled; on the way out, revoke this node's sessions so their locks go at
        once rather than after the session TTL."""
        await self._call(self._load_token_floor)
        self._node_lease = await self._call(self._start_heartbeat)
        await self._call(self._load_mirror)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch)
                nursery.start_soon(self._keep_alive)
                nursery.start_soon(self._heartbeat)
                log.info("node %s joined at revision %d", self.node_id, self.mirror.revision)
                task_status.started()
        finally:
            self._nursery = None
            with trio.move_on_after(SHUTDOWN_GRACE) as cleanup:
                cleanup.shield = True
                async with trio.open_nursery() as ends:
                    for session in self.sessions.values():
                        if session.lease and not session.lost:
                            ends.start_soon(self._end_at_shutdown, session)
                    for lease in [*self._revoking, self._node_lease]:
                        ends.start_soon(self._revoke_quietly, lease)

    async def _end_at_shutdown(self, session: ClusterSession) -> None:
        """Revoke a session's lease, unless another node has just claimed it."""
        record_key = self.layout.session_record(session.id)
        with contextlib.suppress(EtcdUnavailable, EtcdError):
            result = await self.client.txn(
                [compare_mod(record_key, "==", session.record_revision)], [delete_op(record_key)]
            )
            if result.succeeded:
                await self.client.lease_revoke(session.lease)

    async def _revoke_quietly(self, lease: int) -> None:
        with contextlib.suppress(EtcdUnavailable, EtcdError):
            await self.client.lease_revoke(lease)

    async def _load_token_floor(self) -> None:
        """The first node of a new cluster records the wall clock in nanoseconds as
        the floor under every token: a cluster rebuilt empty later starts above it."""
        floor_key = self.layout.token_floor
        result = await self.client.txn(
            [compare_create(floor_key, "==", 0)],
            [put_op(floor_key, b"%d" % time.time_ns())],
            [range_op(floor_key)],
        )
        if result.succeeded:
            _, kvs, _ = await self.client.get(floor_key)
        else:
            kvs = result.kvs(0)
        self.token_floor = int(kvs[0].value) if kvs else 0

    async def _start_heartbeat(self) -> int:
        lease, _ = await self.client.lease_grant(self._heartbeat_ttl())
        await self.client.put(self.layout.node(self.node_id), b"%d" % os.getpid(), lease)
        return lease

    async def _load_mirror(self) -> None:
        queues = self.layout.queues
        revision, kvs, _ = await self.client.get(queues, prefix_end(queues))
        self.mirror.load(revision, kvs)

    async def _watch(self) -> None:
        root = self.layout.root
        while True:
            try:
                # Every node writes its heartbeat under the root every TTL/3, so a
                # stream quiet for a whole TTL comes from a hung member.
                async for events in self.client.watch(
                    root, prefix_end(root), self.mirror.revision + 1, silence=self.session_ttl
                ):
                    self.mirror.apply(events)
            except WatchCompacted:
                log.warning("watch fell behind etcd's compaction: reloading every queue")
                while True:
                    try:
                        await self._load_mirror()
                        await self._recheck_records()
                        break
                    except (EtcdUnavailable, EtcdError):
                        await trio.sleep(0.5)

    async def _recheck_records(self) -> None:
        """After a reload: the session-record changes the watch missed, so a session
        another node claimed meanwhile is let go here (see _record_changed)."""
        sessions = self.layout.sessions
        _, records, _ = await self.client.get(sessions, prefix_end(sessions))
        for record in records:
            session = self._by_lease.get(record.lease)
            if (
                session is not None
                and record.mod_revision > session.record_revision
                and parse_record(record.value).node != self.node_id
            ):
                self._moved(session, "claimed by another node while the watch was behind")

    async def _keep_alive(self) -> None:
        """Every TTL/3: one keepalive per live session lease, then the stray sweep."""
        period = self.session_ttl / 3
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            for session in list(self.sessions.values()):
                if session.lease and not session.lost and now > session.expires_at:
                    # etcd may have expired the lease: its holds are no longer this
                    # node's to promise. Fail closed.
                    self._lose(session, "etcd was not reached for a whole session TTL")
            async with trio.open_nursery() as nursery:
                for session in list(self.sessions.values()):
                    if session.lease and not session.lost:
                        nursery.start_soon(self._keep_session_alive, session)
            await self._sweep()

    async def _heartbeat(self) -> None:
        """The node's own lease, renewed in a loop of its own (a slow session
        keepalive must not let it lapse), and a write of its key: that write is also
        what keeps every node's watch from falling silent (see :meth:`_watch`)."""
        ttl = self._heartbeat_ttl()
        while True:
            await trio.sleep(ttl / 4)
            try:
                if await self.client.lease_keepalive(self._node_lease) == 0:
                    self._node_lease = await self._start_heartbeat()
                else:
                    node_key = self.layout.node(self.node_id)
                    await self.client.put(node_key, b"%d" % os.getpid(), self._node_lease)
            except (EtcdUnavailable, EtcdError):
                self._unavailable("node heartbeat")

    def _heartbeat_ttl(self) -> int:
        return max(2, self.session_ttl // 2)

    async def _keep_session_alive(self, session: ClusterSession) -> None:
        lease = session.lease
        sent = trio.current_time()
        try:
            remaining = await self.client.lease_keepalive(lease)
        except (EtcdUnavailable, EtcdError):
            self._unavailable("session keepalive")
            return
        if session.lease != lease:
            return
        if remaining == 0:
            self._lose(session, "its etcd lease expired")
        else:
            session.expires_at = sent + remaining

    async def _sweep(self) -> None:
        """Delete entries of this node's sessions that no hold and no running request
        owns: left by a free that etcd refused, a request cancelled while its txn
        was in flight, or an answer lost after a commit. Judged on the mirror, and
        every delete is guarded by the entry's revision and the session record."""
        for lease, entries in list(self.mirror.by_lease.items()):
            session = self._by_lease.get(lease)
            if session is None or session.lost:
                continue
            held = {self._entry_key(h): h.revision for h in self._holds(session)}
            strays = [
                (key, revision)
                for key, revision in entries.items()
                if key not in session.pending and held.get(key) != revision
            ]
            if strays:
                try:
                    await self._delete_entries(session, strays)
                except (EtcdUnavailable, EtcdError, BackendUnavailable):
                    return  # next round

    def _unavailable(self, what: str) -> None:
        self.backend_unavailable += 1
        log.warning("backend unavailable: etcd did not answer (%s)", what)

    async def _call(self, step: Callable[[], Awaitable[T]]) -> T:
        """Retry a start-up step until etcd answers (a node may start before quorum)."""
        while True:
            try:
                return await step()
            except EtcdUnavailable as exc:
                self.backend_unavailable += 1
                startup_wait_log("waiting for etcd to start", fields={"cause": str(exc)})
                await trio.sleep(1)

    def _spawn(self, job: Callable[[], Awaitable[object]], what: str) -> None:
        """Run etcd work that no request waits for (frees after a disconnect, lease
        ends). If etcd is down it is logged: the stray sweep or the session lease
        frees it later."""
        nursery = self._nursery
        if nursery is None:
            return

        async def run() -> None:
            try:
                await job()
            except (EtcdUnavailable, EtcdError, BackendUnavailable) as error:
                self._unavailable(f"{what}: {error}")

        nursery.start_soon(run)

    # --------------------------------------------------------------- sessions

    def open_session(self, session_id: str, peer: bytes) -> ClusterSession:
        session = ClusterSession(session_id, peer)
        self.sessions[session_id] = session
        return session

    async def _ensure_lease(self, session: ClusterSession) -> int:
        if session.lost:
            raise BackendUnavailable("session lost")
        if not session.lease:
            sent = trio.current_time()
            lease, ttl = await self._etcd(self.client.lease_grant(self.session_ttl))
            session.lease = lease
            session.expires_at = sent + ttl
            self._by_lease[lease] = session
        # Also after a write whose answer was lost: every free is guarded by the
        # record's revision, so it must be known before anything is taken.
        if not session.record_revision and not await self._write_record(session, connected=True):
            raise BackendUnavailable("session taken over by another node")
        return session.lease

    def _record_guard(self, session: ClusterSession) -> dict[str, Any]:
        """A compare that holds only while this node still owns the session: every
        write that frees something of a session carries it, so a node that lost a
        session to a ``conn_id`` elsewhere (a pause, a late timer) frees nothing."""
        return compare_mod(self.layout.session_record(session.id), "==", session.record_revision)

    def _record_value(self, session: ClusterSession, *, connected: bool) -> bytes:
        return encode_record(SessionRecord(self.node_id, connected, round(session.grace * 1000)))

    async def _write_record(
        self, session: ClusterSession, *, connected: bool | None = None
    ) -> bool:
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
                result = await self._etcd(
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
            self._moved(session, "its record changed")
            return False

    def disconnect(self, session: Session, now: float) -> None:
        """The connection is gone: plain holds go now (grace 0) or when the grace time
        ends; holds with a lease stay. The session's etcd lease is revoked once it
        holds nothing, which frees every entry in one step."""
        assert isinstance(session, ClusterSession)
        session.connected = False
        session.abort = None
        if session.grace > 0 and session.lease and not session.lost:
            if session.grace_deadline is None:
                self.sessions_in_grace += 1
            session.grace_deadline = now + session.grace
            self._schedule(session.grace_deadline, session)
            self._spawn(lambda: self._write_record(session), "session record")
        else:
            self._end_grace(session, now)

    def _end_grace(self, session: ClusterSession, now: float) -> None:
        if session.grace_deadline is not None:
            self.sessions_in_grace -= 1
        session.grace_deadline = None
        plain = [h for h in self._holds(session) if h.lease_deadline is None]
        for hold in plain:
            if hold.shared:
                self.shared_orphans += 1
            else:
                self.orphans += 1
            self._drop(hold, now)
        if session.lease and not session.lost and not session.is_empty():
            # Leases live on: free only the plain holds, keep the session for conn_id.
            entries = [(self._entry_key(h), h.revision) for h in plain]

            async def free_orphans() -> None:
                # In this order: the record write moves the guard the deletes carry.
                await self._delete_entries(session, entries)
                await self._write_record(session)

            self._spawn(free_orphans, "free orphaned holds")
            return
        self._forget(session)

    def _forget(self, session: ClusterSession) -> None:
        """The session is over: delete its record (guarded: only while it is still
        ours), then revoke its lease, which takes every entry with it."""
        self._let_go(session)
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

        self._spawn(end, "end a session")

    def _let_go(self, session: ClusterSession) -> None:
        self.sessions.pop(session.id, None)
        if self._by_lease.get(session.lease) is session:
            del self._by_lease[session.lease]

    def _lose(self, session: ClusterSession, why: str) -> None:
        """etcd no longer has this session: everything it held is gone already."""
        if session.lost:
            return
        session.lost = True
        self.sessions_lost += 1
        log.warning("session %s lost: %s; closing its connection", session.id[:8], why)
        self._drop_all(session)
        if not session.connected:
            self._let_go(session)

    def _moved(self, session: ClusterSession, why: str) -> None:
        """Another node took the session over (``conn_id`` there): let go of it here
        without freeing anything, and end its connection here if it has one."""
        if session.lost:
            return
        session.lost = True  # for this node: nothing more may be done with it
        log.warning("session %s taken over elsewhere (%s)", session.id[:8], why)
        if session.grace_deadline is not None:
            self.sessions_in_grace -= 1
            session.grace_deadline = None
        for hold in self._holds(session):
            self._untrack(hold)
        if session.abort is not None:
            session.abort()
        self._let_go(session)

    def _drop_all(self, session: ClusterSession) -> None:
        now = trio.current_time()
        for hold in self._holds(session):
            self._drop(hold, now)
        if session.abort is not None:
            session.abort()

    def _record_changed(self, event: Event) -> None:
        """A session record claimed by another node (``conn_id`` there)."""
        kv = event.kv
        if event.type == "DELETE" or not kv.key.startswith(self.layout.sessions):
            return
        session = self._by_lease.get(kv.lease)
        if session is None or kv.mod_revision <= session.record_revision:
            return
        node = parse_record(kv.value).node
        if node != self.node_id:
            self._moved(session, f"node {node} claimed it")

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
        local = self.sessions.get(session_id)
        if local is not None:
            if local.connected or local.lost or not local.lease:
                return None
            # etcd first: if the record cannot be written, nothing changed here.
            if not await self._write_record(local, connected=True):
                return None
            if local.lost or not local.lease or self.sessions.get(session_id) is not local:
                return None  # its grace or last lease ended while the record was written
            self._adopt_local(local, current)
            return local
        record_key = self.layout.session_record(session_id)
        _, kvs, _ = await self._etcd(self.client.get(record_key))
        if not kvs:
            return None
        record = kvs[0]
        state = parse_record(record.value)
        if state.connected:
            _, alive, _ = await self._etcd(self.client.get(self.layout.node(state.node)))
            if alive:
                return None
        session = ClusterSession(session_id, current.peer)
        session.name = current.name
        session.lease = record.lease
        session.grace = state.grace_ms / 1000
        value = self._record_value(session, connected=True)
        claimed = await self._etcd(
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
        remaining = await self._etcd(self.client.lease_keepalive(record.lease))
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
            remaining = await self._etcd(self.client.lease_keepalive(record.lease))
        except BackendUnavailable:
            # Let a later conn_id (here or elsewhere) try again.
            self._spawn(lambda: self._write_record(session, connected=False), "session record")
            raise
        if remaining == 0 or session_id in self.sessions:
            return None
        session.expires_at = sent + remaining
        self.sessions[session_id] = session
        self._by_lease[session.lease] = session
        self._forget_empty(current)
        return session

    def _adopt_local(self, target: ClusterSession, current: ClusterSession) -> None:
        target.connected = True
        if target.grace_deadline is not None:
            self.sessions_in_grace -= 1
        target.grace_deadline = None
        target.peer = current.peer
        if current.name is not None:
            target.name = current.name
        self._forget_empty(current)

    def _forget_empty(self, session: ClusterSession) -> None:
        session.connected = False
        self._forget(session)

    async def _adopt_entries(self, session: ClusterSession) -> None:
        """Rebuild the holds of a session taken over from a dead node. A request's
        entries (one revision; several keys for ``mlock``) become holds when they
        hold every lock they are in (a ``ttl`` restarts in full); others are left
        to the stray sweep (:meth:`_sweep`), since their requests died with the old
        connection."""
        names = await self._etcd(self.client.lease_keys(session.lease), session)
        if names is None:
            raise BackendUnavailable("session lease gone")
        requests: dict[int, list[tuple[bytes, KeyValue]]] = {}
        for etcd_key in names:
            name = self.layout.parse_entry(etcd_key)
            if name is None:
                continue
            queue_prefix = self.layout.queue_prefix(name.kind, name.key)
            _, kvs, _ = await self._etcd(
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
                hold = self._record_hold(session, name.kind, key, revision, now)
                ttl = parse_entry_value(kv.value).ttl
                if ttl is not None:
                    hold.ttl = ttl
                    self._set_lease(hold, now + ttl)

    # ------------------------------------------------------------------ holds

    def _holds(self, session: Session) -> list[ClusterHold]:
        holds: list[ClusterHold] = []
        for table in (session.exclusive, session.shared):
            for hold in table.values():
                assert isinstance(hold, ClusterHold)
                holds.append(hold)
        return holds

    def _entry_key(self, hold: ClusterHold) -> bytes:
        session = hold.session
        assert isinstance(session, ClusterSession)
        return self.layout.entry(SHARED if hold.shared else EXCLUSIVE, hold.key, session.lease)

    def _record_hold(
        self, session: ClusterSession, kind: bytes, key: bytes, revision: int, now: float
    ) -> ClusterHold:
        shared = kind == SHARED
        hold = ClusterHold(session, key, shared, revision, self.token_floor, now)
        (session.shared if shared else session.exclusive)[key] = hold
        return hold

    def _untrack(self, hold: ClusterHold) -> None:
        """Forget a hold locally (etcd is told separately, or already knows)."""
        table = hold.session.shared if hold.shared else hold.session.exclusive
        if table.get(hold.key) is hold:
            del table[hold.key]
        if hold.lease_deadline is not None:
            hold.lease_deadline = None
            self.leases -= 1

    def _drop(self, hold: ClusterHold, now: float) -> None:
        self._untrack(hold)
        if self.on_hold_end is not None:
            self.on_hold_end(hold.shared, now - hold.granted_at)

    async def _delete_entries(
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
            await self._etcd(self.client.txn([self._record_guard(session)], batch), session)

    def _check_hold_room(self, session: Session, new: int) -> None:
        if len(session.exclusive) + len(session.shared) + new > self.max_holds:
            raise TooManyHolds

    # ---------------------------------------------------------------- requests

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
        missing = list(dict.fromkeys(k for k in keys if k not in table))
        now = trio.current_time()
        for key in keys:
            own = table.get(key)
            if own is not None and ttl is not None:
                assert isinstance(own, ClusterHold)
                own.ttl = ttl
                self._set_lease(own, now + ttl)
        if not missing:
            count = await self._holders(keys[0]) if kind == SHARED else 0
            return Grant(True, count)
        self._check_hold_room(session, len(missing))
        if wait and any(
            len(q.revisions) >= self.max_waiters
            for q in (self.mirror.queues.get((kind, k)) for k in missing)
            if q is not None
        ):
            raise QueueFull
        lease = await self._ensure_lease(session)
        entries = [self.layout.entry(kind, k, lease) for k in missing]
        # From here until the request ends, its entries are not strays, whatever
        # state the txns leave them in (see _sweep); after it, they are.
        session.pending.update(entries)
        try:
            return await self._request(session, kind, missing, entries, limit, ttl, wait)
        finally:
            session.pending.difference_update(entries)

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
        value = entry_value(limit, ttl, session.owner)
        # Anything of ours created at or before this revision is not this request's:
        # a stray the sweep may be deleting right now (see _sweep).
        start = self.mirror.revision
        if kind == EXCLUSIVE and not wait:
            return await self._try_exclusive(session, keys, entries, value, ttl, start)
        revision, holds_now, holders = await self._enqueue(
            session, kind, keys, entries, value, limit, start
        )
        if holds_now and kind == SHARED and limit:
            holds_now = await self._mark_held(entries[0], revision, limit, ttl, session)
        if holds_now:
            grant = self._granted(session, kind, keys, revision, ttl, now, waited=False)
            if holders is not None:
                # This node's mirror may not have reached the grant yet: the reply
                # counts the holders etcd had at the grant's own revision.
                grant.count = holders
            return grant
        if not wait:
            await self._delete_entries(session, [(e, revision) for e in entries])
            return Grant(False, await self._holders(keys[0]))
        return await self._wait(session, kind, keys, entries, revision, limit, ttl, wait)

    async def _try_exclusive(
        self,
        session: ClusterSession,
        keys: list[bytes],
        entries: list[bytes],
        value: bytes,
        ttl: float | None,
        start: int,
    ) -> Grant:
        """One txn: if every key's queue is empty, enter them all."""
        layout, lease = self.layout, session.lease
        prefixes = [layout.queue_prefix(EXCLUSIVE, k) for k in keys]
        result = await self._etcd(
            self.client.txn(
                [compare_create(p, "==", 0, prefix_end(p)) for p in prefixes],
                [put_op(e, value, lease) for e in entries],
                [range_op(p, prefix_end(p), sort_by_create=True, limit=1) for p in prefixes],
            ),
            session,
        )
        now = trio.current_time()
        if result.succeeded:
            return self._granted(session, EXCLUSIVE, keys, result.revision, ttl, now, waited=False)
        heads = [result.kvs(i)[0] if result.kvs(i) else None for i in range(len(keys))]
        if all(
            h is not None and h.key == e and h.create_revision > start
            for h, e in zip(heads, entries, strict=True)
        ):
            # An earlier attempt of this very txn committed before its answer was
            # lost (the client retried): the entries are ours and at the head.
            revision = heads[0].create_revision if heads[0] is not None else 0
            return self._granted(session, EXCLUSIVE, keys, revision, ttl, now, waited=False)
        blocked = [
            k for k, h, e in zip(keys, heads, entries, strict=True) if h is not None and h.key != e
        ]
        return Grant(False, blocked=blocked)

    async def _enqueue(
        self,
        session: ClusterSession,
        kind: bytes,
        keys: list[bytes],
        entries: list[bytes],
        value: bytes,
        limit: int,
        start: int,
    ) -> tuple[int, bool, int | None]:
        """Enter every queue in one txn: (its revision, whether the new entries hold
        every lock at that revision, and for a shared lock its holders then; None
        when unknown)."""
        prefixes = [self.layout.queue_prefix(kind, k) for k in keys]
        shared = kind == SHARED  # the shared rule needs every entry's limit
        result = await self._etcd(
            self.client.txn(
                [compare_create(e, "==", 0) for e in entries],
                [put_op(e, value, session.lease) for e in entries]
                + [
                    range_op(p, prefix_end(p), count_only=not shared, sort_by_create=shared)
                    for p in prefixes
                ],
                [range_op(e) for e in entries],
            ),
            session,
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

    async def _wait(
        self,
        session: ClusterSession,
        kind: bytes,
        keys: list[bytes],
        entries: list[bytes],
        revision: int,
        limit: int,
        ttl: float | None,
        wait: float,
    ) -> Grant:
        waiter = ClusterWaiter([(kind, k) for k in keys], limit)
        waiter.revision = revision
        woken = trio.Event()
        waiter.wake = woken.set
        since = trio.current_time()
        self.local_waiting += 1
        self.mirror.add_waiter(waiter)
        try:
            with trio.move_on_after(wait):
                await woken.wait()
        finally:
            self.local_waiting -= 1
            self.mirror.remove_waiter(waiter)
            now = trio.current_time()
            if self.on_wait_end is not None:
                self.on_wait_end(kind == SHARED, now - since)
            if waiter.state != GRANTED:
                # Timed out, lost, or the peer left: take our entries out of the
                # queues (also when this task is being cancelled). If etcd cannot
                # be reached now, the stray sweep deletes them later.
                with trio.move_on_after(self.client.deadline + 1) as scope:
                    scope.shield = True
                    with contextlib.suppress(BackendUnavailable):
                        await self._delete_entries(session, [(e, revision) for e in entries])
        if waiter.state == GRANTED and kind == SHARED:
            with trio.CancelScope(shield=True):  # an unmarked grant would block the queue
                marked = await self._mark_held(entries[0], revision, limit, ttl, session)
            if not marked:
                waiter.state = LOST
        if waiter.state == GRANTED:
            return self._granted(session, kind, keys, revision, ttl, now, waited=True)
        self.timeouts += 1
        if kind == SHARED:
            return Grant(False, await self._holders(keys[0]))
        return Grant(False, blocked=[k for k in keys if self._held_by_other(session, k)])

    def _held_by_other(self, session: ClusterSession, key: bytes) -> bool:
        queue = self.mirror.queues.get((EXCLUSIVE, key))
        if queue is None or not queue.revisions:
            return False
        return queue.entries[queue.revisions[0]].lease != session.lease

    def _granted(
        self,
        session: ClusterSession,
        kind: bytes,
        keys: list[bytes],
        revision: int,
        ttl: float | None,
        now: float,
        *,
        waited: bool,
    ) -> Grant:
        for key in keys:
            hold = self._record_hold(session, kind, key, revision, now)
            if ttl is not None:
                hold.ttl = ttl
                self._set_lease(hold, now + ttl)
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
        :mod:`.mirror`): False when the entry is gone (the session was lost)."""
        value = entry_value(limit, ttl, session.owner, held=True)
        result = await self._etcd(
            self.client.txn(
                [compare_create(entry, "==", revision)], [put_op(entry, value, session.lease)]
            )
        )
        return result.succeeded

    async def release(self, session: ClusterSession, kind: bytes, key: bytes) -> Grant:
        """Free this session's hold: (was it held, holders left for shared). A hold
        whose entry is already gone (a retried delete that committed the first
        time, or a lost session) counts as released: the lock is free of it."""
        table = session.shared if kind == SHARED else session.exclusive
        hold = table.get(key)
        if hold is None:
            return Grant(False)
        assert isinstance(hold, ClusterHold)
        entry = self._entry_key(hold)
        prefix = self.layout.queue_prefix(kind, key)
        read_queue = range_op(prefix, prefix_end(prefix), sort_by_create=True)
        # Let go here first: if etcd does not answer, the stray sweep frees the entry
        # once it does (the client was asked to release, not to keep holding).
        self._drop(hold, trio.current_time())
        result = await self._etcd(
            self.client.txn(
                [self._record_guard(session)],
                [
                    txn_op([compare_create(entry, "==", hold.revision)], [delete_op(entry)]),
                    read_queue,
                ],
                [read_queue],
            ),
            session,
        )
        if not result.succeeded:
            # Another node took the session over (its watch event follows); what is
            # left, if anything, is the stray sweep's.
            return Grant(False)
        queue = result.kvs(1)
        return Grant(True, holders_after_handover(queue) if kind == SHARED else 0)

    async def release_all(self, session: ClusterSession) -> None:
        """Free every hold; if etcd refuses, the holds are gone here anyway and the
        stray sweep frees their entries once etcd answers."""
        holds = self._holds(session)
        entries = [(self._entry_key(h), h.revision) for h in holds]
        now = trio.current_time()
        for hold in holds:
            self._drop(hold, now)
        await self._delete_entries(session, entries)

    def renew(self, session: Session, key: bytes, ttl: float) -> bool:
        hold = session.exclusive.get(key) or session.shared.get(key)
        if hold is None:
            return False
        assert isinstance(hold, ClusterHold)
        hold.ttl = ttl
        self._set_lease(hold, trio.current_time() + ttl)
        return True

    # ------------------------------------------------------------------ reads

    async def queue(self, kind: bytes, key: bytes | None) -> list[tuple[bytes, list[KeyValue]]]:
        """A linearizable read of one queue (or every queue of a table), oldest first."""
        prefix = self.layout.queues + kind + b"/"
        if key is not None:
            prefix = self.layout.queue_prefix(kind, key)
        _, kvs, _ = await self._etcd(
            self.client.get(prefix, prefix_end(prefix), sort_by_create=True)
        )
        queues: dict[bytes, list[KeyValue]] = {}
        for kv in kvs:
            name = self.layout.parse_entry(kv.key)
            if name is not None:
                queues.setdefault(name.key, []).append(kv)
        return sorted(queues.items())

    async def _holders(self, key: bytes) -> int:
        queues = await self.queue(SHARED, key)
        return len(granted_kvs(queues[0][1])) if queues else 0

    async def holders(self, kind: bytes, key: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """(lock name, owner) of every hold in a table, or of one key: read from a
        snapshot of the queues as the caller goes (a dump streams; each key's holders
        are as they are when its turn comes)."""
        queues = await self.queue(kind, key)

        def pairs() -> Iterator[tuple[bytes, bytes]]:
            for name, kvs in queues:
                held = list(granted_kvs(kvs)) if kind == SHARED else kvs[:1]
                for kv in held:
                    yield name, parse_entry_value(kv.value).owner

        return pairs()

    async def describe(self, key: bytes) -> tuple[KeyValue | None, int, int]:
        """``info``: the exclusive head entry, shared holders, requests waiting."""
        exclusive = await self.queue(EXCLUSIVE, key)
        shared = await self.queue(SHARED, key)
        head = exclusive[0][1][0] if exclusive else None
        waiting_exclusive = len(exclusive[0][1]) - 1 if exclusive else 0
        holders = len(granted_kvs(shared[0][1])) if shared else 0
        waiting_shared = len(shared[0][1]) - holders if shared else 0
        return head, holders, waiting_exclusive + waiting_shared

    def local_hold(self, lease: int, key: bytes) -> ClusterHold | None:
        """The exclusive hold on ``key`` of this node's session with ``lease``."""
        session = self._by_lease.get(lease)
        hold = session.exclusive.get(key) if session is not None else None
        return hold if isinstance(hold, ClusterHold) else None

    # ----------------------------------------------------------------- timers

    def _set_lease(self, hold: ClusterHold, deadline: float) -> None:
        if hold.lease_deadline == deadline:
            return  # its entry is in the heap already (renews pipelined in one tick)
        if hold.lease_deadline is None:
            self.leases += 1
        hold.lease_deadline = deadline
        self._schedule(deadline, hold)

    def _schedule(self, deadline: float, target: ClusterHold | ClusterSession) -> None:
        if self._deadlines.add(deadline, target) and self.on_new_deadline is not None:
            self.on_new_deadline()

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def advance(self, now: float, budget: int | None = None) -> bool:
        """Run every lease and grace end due by ``now`` (the server's timer task).
        Each only starts an etcd call here, so there is no slice to bound."""
        for _, target in self._deadlines.due(now):
            if isinstance(target, ClusterSession):
                self._end_grace(target, now)
            else:
                self._expire(target, now)
        return False

    def _expire(self, hold: ClusterHold, now: float) -> None:
        """A ``ttl=`` lease ran out: this node frees it (guarded by its revision)."""
        session = hold.session
        assert isinstance(session, ClusterSession)
        self.expired += 1
        entries = [(self._entry_key(hold), hold.revision)]
        self._drop(hold, now)
        self._spawn(lambda: self._delete_entries(session, entries), "expire a lease")
        if not session.connected and session.grace_deadline is None and session.is_empty():
            self._forget(session)

    # ---------------------------------------------------------------- helpers

    async def _etcd(self, call: Awaitable[T], session: ClusterSession | None = None) -> T:
        """Await an etcd call: etcd without quorum, or an error reply, becomes
        BackendUnavailable (the request fails closed; the node stays up). "lease not
        found" means the session's lease expired before this node noticed."""
        try:
            return await call
        except EtcdUnavailable as error:
            self._unavailable(str(error) or "no quorum")
            raise BackendUnavailable("backend unavailable") from error
        except EtcdError as error:
            if session is not None and "lease not found" in error.message:
                self._lose(session, "etcd no longer knows its lease")
            else:
                self._unavailable(f"etcd refused a request: {error.message}")
            raise BackendUnavailable(error.message) from error


def _carries(deadline: float, target: ClusterHold | ClusterSession) -> bool:
    """Whether a deadline-heap entry is current (its lease or grace still ends then)."""
    if isinstance(target, ClusterSession):
        return target.grace_deadline == deadline and not target.connected
    return target.lease_deadline == deadline
