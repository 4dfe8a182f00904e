"""The lock space kept in etcd, as the server sees it: one backend object.

etcd decides; a node only asks. :class:`ClusterLockSpace` is what the server, the
cluster's verbs, ``q`` and /metrics hold on to, and it only puts together the
parts, split as etcd's own client splits its ``concurrency`` package, each with
one job:

* :mod:`.lease`: the node's etcd lease (``session.go``): its grant, keepalive and
  revoke, and the local deadline after which nothing under it is confirmed;
* :mod:`.records`: a session's tag and record, the guard every free carries, and
  the guarded deletes of its entries;
* :mod:`.ends`: a session's ends (disconnect, grace, ``ttl=`` expiry, loss with the
  lease, a move elsewhere);
* :mod:`.takeover`: ``conn_id``, here or from a node that is gone;
* :mod:`.recipe`: the lock recipe (``mutex.go``): acquire, release, renew, and the
  reads behind ``i``, ``d`` and ``info``;
* :mod:`.node`: the node's lifecycle: join, the watch, the heartbeat, the keeper
  (the lease's keepalive rounds and the stray sweep), and leaving.

Under them lie this node's books (:mod:`.ledger`: sessions, holds, deadlines,
counters), the fencing-token rule (:mod:`.tokens`), the one way they call etcd
(:mod:`.calls`: the only holder of the etcd client; a failed call fails closed
with :class:`~elockd.backend.interface.BackendUnavailable` and is counted), the keys
and values (:mod:`.layout`) and the mirror of the queues with the grant rule
(:mod:`.mirror`). Each part is given at construction, here, the parts it uses.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.ends import SessionEnds, SessionLoss
from elockd.backend.cluster.etcd.client import EtcdClient
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, Layout, parse_entry_value
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import (
    ClusterAnswer,
    ClusterHold,
    ClusterSession,
    Ledger,
    ThrottleWait,
)
from elockd.backend.cluster.mirror import QueueMirror
from elockd.backend.cluster.node import ClusterNode
from elockd.backend.cluster.operators import ClusterOperators
from elockd.backend.cluster.recipe import LockRecipe
from elockd.backend.cluster.records import SessionRecords
from elockd.backend.cluster.state import ClusterDump, ClusterRestore, WaitingRequest
from elockd.backend.cluster.takeover import Takeover
from elockd.backend.cluster.throttle import ClusterThrottles
from elockd.backend.cluster.tokens import fencing_token
from elockd.backend.interface import (
    Backend,
    BackendUnavailable,
    Evicted,
    Grant,
    Holders,
    KeyInfo,
    KeyRows,
    Later,
    QueueFull,
    TooManyHolds,
    TooManyThrottles,
)
from elockd.engine.gcra import Rate, Verdict
from elockd.engine.sessions import Session

__all__ = ["ClusterHold", "ClusterLockSpace", "ClusterSession"]


class ClusterLockSpace(Backend):
    """This node's view of the lock space in etcd, and its sessions: the backend
    a cluster node's server runs on (see :class:`elockd.backend.interface.Backend`).
    Its counters and hooks are in its books (:class:`Ledger`)."""

    kind = "etcd"

    def __init__(
        self,
        client: EtcdClient,
        root: bytes,
        *,
        session_ttl: int = 5,
        max_waiters: int = 10_000,
        max_holds: int = 10_000,
        max_throttles: int = 1_000_000,
        throttle_line_grace: float = 1.0,
    ) -> None:
        self.client = client  # the server closes it; only calls (below) calls it
        self.layout = layout = Layout(root)
        self.session_ttl = session_ttl
        self.max_waiters = max_waiters
        self.max_holds = max_holds
        self.node_id = node_id = secrets.token_hex(8)
        self.calls = calls = EtcdCalls(client)
        self.mirror = mirror = QueueMirror(layout)
        self.ledger = ledger = Ledger(max_holds, max_waiters, mirror, calls)
        # Each part is given the parts it uses. SessionLoss comes first: it needs
        # nothing of etcd, and the lease and the records tell it of a session lost
        # with the lease or moved to another node.
        self.loss = loss = SessionLoss(calls, ledger, session_ttl)
        self.lease = lease = NodeLease(calls, session_ttl, self._lose_all)
        self.records = records = SessionRecords(calls, ledger, layout, lease, node_id, loss.moved)
        self.ends = ends = SessionEnds(calls, ledger, lease, records, mirror)
        self.takeover = Takeover(calls, ledger, layout, mirror, lease, records, ends)
        calls.on_lease_gone = lease.gone
        mirror.on_other = records.record_changed
        self.recipe = LockRecipe(calls, ledger, layout, mirror, lease, records, max_waiters)
        self.throttles = ClusterThrottles(
            calls,
            ledger,
            layout,
            mirror.throttles,
            lambda: mirror.revision,
            lease,
            node_id,
            max_throttles=max_throttles,
            max_waiters=max_waiters,
            line_grace=throttle_line_grace,
        )
        self.operators = operators = ClusterOperators(ledger, mirror, records)
        self.node = ClusterNode(calls, ledger, layout, mirror, lease, records, ends, node_id)
        self.node.loops.append(self.throttles.run)
        self.node.loops.append(operators.send_acks)
        self.node.operators = operators

    @property
    def books(self) -> Ledger:
        return self.ledger

    def _lose_all(self, why: str) -> None:
        """The lease is gone (or may be): every session under it is lost, and every
        watcher is woken, so that its stream says it can no longer vouch for what
        it shows (the deadline gate) rather than stay silent."""
        self.loss.lose_all(why)
        for watcher in self.ledger.watchers.all():
            if watcher.wake is not None:
                watcher.wake()

    def deadline_gate(self) -> Callable[[float], bool]:
        return self.lease.cannot_vouch

    def background(self) -> Callable[..., Awaitable[None]]:
        """Join, then the watch, the heartbeat, the keepalives and the sweep."""
        return self.node.run

    def open_session(self, session_id: str, peer: bytes) -> Session:
        return self.ledger.open_session(session_id, peer)

    def disconnect(self, session: Session, now: float) -> None:
        self.ends.disconnect(session, now)

    def next_deadline(self) -> float | None:
        return self.ledger.next_deadline()

    def advance(self, now: float, budget: int | None = None) -> bool:
        return self.ends.advance(now, budget)

    # ------------------------------------------------ the backend interface
    # Every answer needs etcd, so each comes later: a Later running the part's
    # coroutine. Only renew and token are answered from this node's own books.

    def take_over(self, session_id: str, current: Session) -> Later[Session | None]:
        async def run() -> Session | None:
            return await self.takeover.take_over(session_id, _ours(current))

        return Later(run)

    # Operators (docs/cluster.md, "Operators on a cluster"): ls and watch read the
    # mirror; kill is one etcd txn.

    def listing(
        self, prefix: bytes, now: float, *, older: float | None, limit: int | None
    ) -> Later[KeyRows]:
        return Later(lambda: self.operators.listing(prefix, older, limit))

    def kill(self, key: bytes, now: float) -> Later[list[Evicted]]:
        return Later(lambda: self.operators.kill(key))

    def watch_keys(self, prefix: bytes, after: bytes | None, count: int) -> list[bytes]:
        return self.operators.watch_keys(prefix, after, count)

    def watch_lines(self, key: bytes) -> list[bytes]:
        return self.operators.watch_lines(key)

    def rename(self, session: Session, name: bytes | None) -> Later[None]:
        return Later(lambda: self.recipe.rename(_ours(session), name))

    def acquire(self, session: Session, key: bytes, now: float) -> Later[bool]:
        async def run() -> bool:
            return (await self.lock(session, [key], now, wait=0, ttl=None).run()).granted

        return Later(run)

    def release(self, session: Session, key: bytes, now: float) -> Later[bool]:
        async def run() -> bool:
            return (await self.recipe.release(_ours(session), EXCLUSIVE, key)).granted

        return Later(run)

    def release_shared(self, session: Session, key: bytes, now: float) -> Later[int | None]:
        async def run() -> int | None:
            freed = await self.recipe.release(_ours(session), SHARED, key)
            return freed.count if freed.granted else None

        return Later(run)

    def holders(self, shared: bool, key: bytes | None, *, ordered: bool = False) -> Later[Holders]:
        # One range read gives etcd's order: keys in byte order already.
        return Later(lambda: self.recipe.holders(SHARED if shared else EXCLUSIVE, key))

    def lock(
        self, session: Session, keys: list[bytes], now: float, *, wait: float, ttl: float | None
    ) -> Later[Grant]:
        def start() -> Awaitable[Grant]:
            return self.recipe.acquire(_ours(session), EXCLUSIVE, keys, limit=1, ttl=ttl, wait=wait)

        return self.waiting_request(_ours(session), start) if wait > 0 else Later(start)

    def lock_shared(
        self,
        session: Session,
        key: bytes,
        now: float,
        *,
        limit: int | None,
        wait: float,
        ttl: float | None,
    ) -> Later[Grant]:
        def start() -> Awaitable[Grant]:
            return self.recipe.acquire(
                _ours(session), SHARED, [key], limit=_stored(limit), ttl=ttl, wait=wait
            )

        return self.waiting_request(_ours(session), start) if wait > 0 else Later(start)

    def waiting_request(
        self, session: ClusterSession, start: Callable[[], Awaitable[Any]] | None
    ) -> WaitingRequest:
        """A request that waits for a grant, as a hand-over can stop and move it
        (docs/upgrade.md). Asked again (after a failed hand-over, or on the
        successor, where ``start`` is None), it gives the answer it already had, or
        waits on where its wait stood."""
        ledger, calls = self.ledger, self.calls

        async def run() -> Any:
            if request.answer is not None:
                grant = request.answer.give()
                if isinstance(grant, Grant) and grant.granted:
                    # Granted before a pause, told only now (here, or on a
                    # successor): still within the lease's deadline? (An admitted
                    # throttle holds nothing: etcd has its new TAT already.)
                    self.lease.confirm(session)
                return grant
            stopped = ledger.suspended_wait(session)
            with calls.busy():
                try:
                    if isinstance(stopped, ThrottleWait):
                        grant = await self.throttles.wait_for(stopped)
                    elif stopped is not None:
                        grant = await self.recipe.wait_for(stopped)
                    elif start is not None:
                        grant = await start()
                    else:
                        raise BackendUnavailable("the waiting request did not come along")
                except (BackendUnavailable, QueueFull, TooManyHolds, TooManyThrottles) as refusal:
                    request.answer = ClusterAnswer(refusal=refusal)
                    raise
                request.answer = ClusterAnswer(grant)
            return grant

        request = WaitingRequest(run)
        return request

    def release_all(self, session: Session, now: float) -> Later[None]:
        return Later(lambda: self.recipe.release_all(_ours(session)))

    def renew(self, session: Session, key: bytes, now: float, ttl: float) -> bool:
        self.lease.check_expiry()  # past it, the session's holds are gone
        if self.lease.past_deadline():  # and while frozen, nothing is confirmed
            return False
        return self.recipe.renew(session, key, ttl)

    def token(self, session: Session, key: bytes) -> int | None:
        self.lease.check_expiry()  # past it, the session's holds are gone
        if self.lease.past_deadline():  # and while frozen, nothing is confirmed
            return None
        return super().token(session, key)

    def info(self, key: bytes, now: float) -> Later[KeyInfo]:
        async def run() -> KeyInfo:
            head, shared, waiting = await self.recipe.describe(key)
            found = KeyInfo(shared=shared, waiting=waiting)
            if head is not None:
                value = parse_entry_value(head.value)
                found.owner = value.owner
                found.token = fencing_token(
                    self.ledger.token_floor, head.create_revision, value.rank
                )
                # A lease's end is known to the node that runs it: this one's own.
                name = self.layout.parse_entry(head.key)
                local = self.ledger.local_hold(name.tag, key) if name is not None else None
                if local is not None and local.lease_deadline is not None:
                    found.ttl = max(0.0, local.lease_deadline - trio.current_time())
            return found

        return Later(run)

    def throttle(
        self, session: Session, key: bytes, now: float, rate: Rate, *, wait: float
    ) -> Later[Verdict]:
        """``throttle``: a compare-and-swap of the key's TAT in etcd (``now``, this
        node's monotonic clock, is not used: a cluster's TATs are on the wall
        clock, see :mod:`.throttle`). A request that may wait is one a hand-over
        can move, as a lock wait is."""

        def start() -> Awaitable[Verdict]:
            return self.throttles.throttle(_ours(session), key, rate, wait)

        return self.waiting_request(_ours(session), start) if wait > 0 else Later(start)

    # ------------------------------------------- hand-over (docs/upgrade.md)

    def freeze(self) -> None:
        self.calls.freeze()
        self.operators.freeze()

    async def settle(self) -> None:
        await self.calls.settled()

    def thaw(self) -> None:
        self.calls.thaw()
        self.operators.thaw()
        # What the watch skipped while frozen: sessions claimed elsewhere meanwhile.
        self.calls.spawn(self.records.recheck_records, "recheck session records")

    def hand_off(self) -> None:
        self.calls.hand_off()

    def adopt_identity(self, node_id: str, heartbeat_lease: int, sessions_lease: int) -> None:
        """Be the node a predecessor was: its sessions' records name it, its
        heartbeat lease says it lives, and its sessions hang on its lease (which the
        node renews as it joins)."""
        self.node_id = self.records.node_id = self.node.node_id = node_id
        self.throttles.node_id = node_id
        self.node.adopted_lease = heartbeat_lease
        self.node.adopted_sessions_lease = sessions_lease

    def dump(self, now: float, pending: Sequence[tuple[Session, Any]]) -> ClusterDump:
        return ClusterDump(self, now, pending)

    def restore(self, now: float) -> ClusterRestore:
        return ClusterRestore(self, now)

    @property
    def backend_unavailable(self) -> int:
        return self.calls.backend_unavailable


def _stored(limit: int | None) -> int:
    """A shared limit as etcd's entries store it: 0 is none (None at the interface)."""
    return 0 if limit is None else limit


def _ours(session: Session) -> ClusterSession:
    """Every session of a node is one it opened (:meth:`Ledger.open_session`)."""
    assert isinstance(session, ClusterSession)
    return session
