"""The lock space kept in etcd, as the server sees it: one backend object.

etcd decides; a node only asks. :class:`ClusterLockSpace` is what the server, the
cluster's verbs, ``q`` and /metrics hold on to, and it only puts together the
parts, split as etcd's own client splits its ``concurrency`` package:

* :mod:`.ownership`: session ownership (``session.go``): the node's etcd lease a
  session's keys hang on, the session's tag and record, its ends (disconnect,
  grace, ``ttl=`` expiry, loss, a move elsewhere) and its takeover with ``conn_id``;
* :mod:`.recipe`: the lock recipe (``mutex.go``): acquire, release, renew, and the
  reads behind ``i``, ``d`` and ``info``;
* :mod:`.node`: the node's lifecycle: join, the watch, the heartbeat, the keepalive
  of the node's lease and the stray sweep, and leaving.

Under all three lie this node's books (:mod:`.ledger`: sessions, holds, deadlines,
counters; pure), the one way they call etcd (:mod:`.calls`: a failed call fails
closed with :class:`~elockd.backend.interface.BackendUnavailable` and is counted), the keys
and values (:mod:`.layout`) and the mirror of the queues with the grant rule
(:mod:`.mirror`). A part reaches another only through the methods named here, so
each can change (batched transactions, say) without the others.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.etcd.client import EtcdClient
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, Layout, parse_entry_value
from elockd.backend.cluster.ledger import (
    ClusterAnswer,
    ClusterHold,
    ClusterSession,
    Ledger,
    fencing_token,
)
from elockd.backend.cluster.mirror import QueueMirror
from elockd.backend.cluster.node import ClusterNode
from elockd.backend.cluster.ownership import SessionOwnership
from elockd.backend.cluster.recipe import LockRecipe
from elockd.backend.cluster.state import ClusterDump, ClusterRestore, WaitingRequest
from elockd.backend.interface import (
    Backend,
    BackendUnavailable,
    Grant,
    Holders,
    KeyInfo,
    Later,
    QueueFull,
    TooManyHolds,
)
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
    ) -> None:
        self.client = client
        self.layout = layout = Layout(root)
        self.session_ttl = session_ttl
        self.max_waiters = max_waiters
        self.max_holds = max_holds
        self.node_id = secrets.token_hex(8)
        self.calls = calls = EtcdCalls(client)
        self.mirror = mirror = QueueMirror(layout)
        self.ledger = ledger = Ledger(max_holds, max_waiters, mirror, calls)
        self.ownership = ownership = SessionOwnership(
            calls, ledger, layout, mirror, self.node_id, session_ttl
        )
        calls.on_lease_gone = ownership.lease_gone
        mirror.on_other = ownership.record_changed
        self.recipe = LockRecipe(ownership, mirror, max_waiters)
        self.node = ClusterNode(ownership, mirror)

    @property
    def books(self) -> Ledger:
        return self.ledger

    def background(self) -> Callable[..., Awaitable[None]]:
        """Join, then the watch, the heartbeat, the keepalives and the sweep."""
        return self.node.run

    def open_session(self, session_id: str, peer: bytes) -> Session:
        return self.ownership.open_session(session_id, peer)

    def disconnect(self, session: Session, now: float) -> None:
        self.ownership.disconnect(session, now)

    def next_deadline(self) -> float | None:
        return self.ledger.next_deadline()

    def advance(self, now: float, budget: int | None = None) -> bool:
        return self.ownership.advance(now, budget)

    # ------------------------------------------------ the backend interface
    # Every answer needs etcd, so each comes later: a Later running the part's
    # coroutine. Only renew and token are answered from this node's own books.

    def take_over(self, session_id: str, current: Session) -> Later[Session | None]:
        async def run() -> Session | None:
            return await self.ownership.take_over(session_id, _ours(current))

        return Later(run)

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
        self, session: ClusterSession, start: Callable[[], Awaitable[Grant]] | None
    ) -> WaitingRequest:
        """A request that waits for a grant, as a hand-over can stop and move it
        (docs/upgrade.md). Asked again (after a failed hand-over, or on the
        successor, where ``start`` is None), it gives the answer it already had, or
        waits on where its wait stood."""
        ledger, calls = self.ledger, self.calls

        async def run() -> Grant:
            if request.answer is not None:
                return request.answer.give()
            stopped = ledger.suspended_wait(session)
            with calls.busy():
                try:
                    if stopped is not None:
                        grant = await self.recipe.wait_for(stopped)
                    elif start is not None:
                        grant = await start()
                    else:
                        raise BackendUnavailable("the waiting request did not come along")
                except (BackendUnavailable, QueueFull, TooManyHolds) as refusal:
                    request.answer = ClusterAnswer(refusal=refusal)
                    raise
                request.answer = ClusterAnswer(grant)
            return grant

        request = WaitingRequest(run)
        return request

    def release_all(self, session: Session, now: float) -> Later[None]:
        return Later(lambda: self.recipe.release_all(_ours(session)))

    def renew(self, session: Session, key: bytes, now: float, ttl: float) -> bool:
        self.ownership.check_expiry()  # past it, the session's holds are gone
        return self.recipe.renew(session, key, ttl)

    def token(self, session: Session, key: bytes) -> int | None:
        self.ownership.check_expiry()  # past it, the session's holds are gone
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

    # ------------------------------------------- hand-over (docs/upgrade.md)

    def freeze(self) -> None:
        self.calls.freeze()

    async def settle(self) -> None:
        await self.calls.settled()

    def thaw(self) -> None:
        self.calls.thaw()
        # What the watch skipped while frozen: sessions claimed elsewhere meanwhile.
        self.calls.spawn(self.ownership.recheck_records, "recheck session records")

    def hand_off(self) -> None:
        self.calls.hand_off()

    def adopt_identity(self, node_id: str, heartbeat_lease: int, sessions_lease: int) -> None:
        """Be the node a predecessor was: its sessions' records name it, its
        heartbeat lease says it lives, and its sessions hang on its lease (which the
        node renews as it joins)."""
        self.node_id = self.ownership.node_id = self.node.node_id = node_id
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
    """Every session of a node is one it opened (:meth:`SessionOwnership.open_session`)."""
    assert isinstance(session, ClusterSession)
    return session
