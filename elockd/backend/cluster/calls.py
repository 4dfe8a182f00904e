"""How a cluster node's work reaches etcd, and what it makes of etcd not answering.

The node's :class:`~elockd.backend.cluster.etcd.client.EtcdClient` is held here and
nowhere else: the parts (:mod:`.lease`, :mod:`.records`, :mod:`.ends`,
:mod:`.takeover`, :mod:`.recipe`, :mod:`.node`) are each given an :class:`EtcdCalls`
at construction, whose calls (``txn``, ``get``, ``put``, ``lease_*``, ``watch``) are
the only way they have to etcd. So one policy covers every call by construction:
a call a request makes fails closed with
:class:`~elockd.backend.interface.BackendUnavailable` when etcd has no quorum or
answers with an error, and is counted and logged once, here. The node's own loops
and start-up steps, which each have a policy of their own for etcd not answering
(start-up retries until it answers, the keeper counts a failed round and comes
back sooner, the watch reloads), make the same calls through
:attr:`EtcdCalls.unmapped`, which raises etcd's own errors as they are. Work that
no request waits for (frees after a disconnect, lease ends) goes through
:meth:`EtcdCalls.spawn`, into the nursery the node runs. A policy over all calls
(how many may be in flight, which failures mean etcd is down) has one place to live.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

import trio

from elockd.backend.cluster.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    TxnResult,
    Watch,
)
from elockd.backend.cluster.tokens import TOKENS_PER_REVISION
from elockd.backend.interface import BackendUnavailable
from elockd.observe.logthrottle import LogThrottle

log = logging.getLogger("elockd.cluster")
#: A node waiting for etcd at start-up says so every 10 s, not every retry.
startup_wait_log = LogThrottle(log, logging.WARNING, 10.0)
#: Every request fails while etcd has no quorum (8,583 lines in 7 s of a burst):
#: one line per 10 s, with a count.
unavailable_log = LogThrottle(log, logging.WARNING, 10.0)

T = TypeVar("T")

#: The :meth:`EtcdCalls.busy` scope of the waiting request this task runs, if any.
_working_scope: ContextVar[trio.CancelScope | None] = ContextVar("working_scope", default=None)


class Calls:
    """The etcd calls a part of the node may make. Each goes through
    :meth:`_answer`, which says what a failure becomes: here, etcd's own error
    (:class:`~elockd.backend.cluster.etcd.client.EtcdUnavailable`,
    :class:`~elockd.backend.cluster.etcd.client.EtcdError`), for a caller with a
    policy of its own (see :attr:`EtcdCalls.unmapped`)."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client

    @property
    def deadline(self) -> float:
        """Seconds a call may take before etcd counts as not answering
        (``--etcd-timeout``): also how long a request waits for what etcd must do
        first (a new lease, the watch catching up)."""
        return self._client.deadline

    async def _answer(self, call: Awaitable[T]) -> T:
        return await call

    async def txn(
        self,
        compare: Sequence[dict[str, Any]],
        success: Sequence[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
        *,
        ranks: int = 0,
    ) -> TxnResult:
        return await self._answer(self._client.txn(compare, success, failure, ranks=ranks))

    async def get(
        self, key: bytes, range_end: bytes | None = None, *, sort_by_create: bool = False
    ) -> tuple[int, list[KeyValue], int]:
        return await self._answer(self._client.get(key, range_end, sort_by_create=sort_by_create))

    async def revision(self, key: bytes) -> int:
        """etcd's current revision, from a linearizable read of ``key``'s count
        (nothing of its value travels)."""
        revision, _, _ = await self._answer(self._client.get(key, count_only=True))
        return revision

    async def put(self, key: bytes, value: bytes, lease: int = 0, *, urgent: bool = False) -> int:
        return await self._answer(self._client.put(key, value, lease, urgent=urgent))

    async def lease_grant(self, ttl: int) -> tuple[int, int]:
        return await self._answer(self._client.lease_grant(ttl))

    async def lease_keepalive(self, lease: int, *, until: float | None = None) -> int:
        return await self._answer(self._client.lease_keepalive(lease, until=until))

    def watch(
        self, key: bytes, range_end: bytes, start_revision: int, *, silence: float | None = None
    ) -> Watch:
        """A watch stream: it reconnects on its own and never fails but with
        :class:`~elockd.backend.cluster.etcd.client.WatchCompacted`, its caller's."""
        return self._client.watch(key, range_end, start_revision, silence=silence)


class EtcdCalls(Calls):
    """The node's etcd calls for requests (failures become BackendUnavailable, see
    :meth:`_answer`), the same calls for the node's own loops
    (:attr:`unmapped`), the "backend unavailable" count, and the nursery (set while
    the node runs) that background jobs start in."""

    def __init__(self, client: EtcdClient) -> None:
        super().__init__(client)
        #: The same calls, raising etcd's own errors: for the node's start-up steps
        #: (:meth:`until_answered` retries them) and its loops (the heartbeat, the
        #: keeper, the watch's reload), each of which counts or retries a failure
        #: by its own rule.
        self.unmapped = Calls(client)
        self.nursery: trio.Nursery | None = None
        self.backend_unavailable = 0
        #: The latest revision a txn of this node's requests answered at: once the
        #: mirror is there, it shows every change this node has told a client of
        #: (``ls`` waits for that, see :mod:`.operators`).
        self.latest = 0
        #: Called when etcd answers "lease not found" for a session's call: the
        #: node's lease expired before the node noticed (see :mod:`.lease`).
        self.on_lease_gone: Callable[[str], None] | None = None
        #: Set when the node's keeper (see :mod:`.node`) should not wait for its
        #: next period: the node's lease is gone, or etcd did not answer or refused
        #: a call, so whatever that call was to delete is still there (a refused
        #: free) and whatever it was to write may be (a lost answer), for the
        #: keeper's sweep as soon as etcd answers again.
        self.keeper_wanted = trio.Event()
        #: While a hand-over copies this node's books (docs/upgrade.md), nothing may
        #: change them: waits hold their outcome, the sweep and the session checks
        #: skip their round. ``handed_over`` once the successor has them: this
        #: process then changes nothing in etcd again.
        self.frozen = False
        self.handed_over = False
        self._thawed = trio.Event()
        self._busy = 0  # background jobs, and waiting requests between their waits
        self._idle = trio.Event()
        self._working: set[trio.CancelScope] = set()  # waiting requests' etcd work

    def freeze(self) -> None:
        """A hand-over starts copying the books (see ``frozen``). Waiting requests in
        the middle of their etcd work are shielded until they reach their wait or
        their answer: the pause may interrupt their connection, but a txn cut short
        would leave entries nobody can account for."""
        self.frozen = True
        self._thawed = trio.Event()
        for scope in self._working:
            scope.shield = True

    def thaw(self) -> None:
        """The hand-over failed: this node goes on as if nothing had happened."""
        self.frozen = False
        self._thawed.set()

    def hand_off(self) -> None:
        """The successor has the books: stay frozen until this process exits."""
        self.handed_over = True

    async def thawed(self) -> None:
        """Return once the freeze ends (never, once handed over: the process exits)."""
        await self._thawed.wait()

    async def settled(self) -> None:
        """Return once no background job (a free, a record write, a revoke) and no
        waiting request's etcd work is under way: each changes what a hand-over must
        copy (a record revision, a hold, a wait). A waiting request rests while it
        waits for its grant, and a hand-over counts its connection as at rest from
        the start, so only this tells that it got there."""
        while self._busy:
            if self._idle.is_set():  # not one another waiter waits on
                self._idle = trio.Event()
            await self._idle.wait()

    def _one_less(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._idle.set()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """A waiting request's etcd work, which :meth:`settled` waits for and
        :meth:`freeze` shields."""
        with trio.CancelScope(shield=self.frozen) as scope:
            token = _working_scope.set(scope)
            self._working.add(scope)
            self._busy += 1
            try:
                yield
            finally:
                self._working.discard(scope)
                _working_scope.reset(token)
                self._one_less()

    @contextlib.contextmanager
    def resting(self) -> Iterator[None]:
        """Within :meth:`busy`: the wait for a grant, which is not etcd work and may
        be interrupted (a hand-over then keeps the wait, see :mod:`.recipe`)."""
        scope = _working_scope.get()
        if scope is None:
            yield
            return
        self._working.discard(scope)
        scope.shield = False
        self._one_less()
        try:
            yield
        finally:
            self._busy += 1
            self._working.add(scope)
            scope.shield = self.frozen

    def unavailable(self, what: str) -> None:
        self.backend_unavailable += 1
        self.keeper_wanted.set()
        unavailable_log("backend unavailable: etcd did not answer (%s)", what)

    async def _answer(self, call: Awaitable[T]) -> T:
        """Await an etcd call: etcd without quorum, or an error reply, becomes
        BackendUnavailable (the request fails closed; the node stays up). "lease not
        found" means the node's lease expired before the node noticed: every write
        that goes through here hangs on it (the heartbeat's, on a lease of its own,
        goes through :attr:`unmapped`)."""
        try:
            answer = await call
        except EtcdUnavailable as error:
            self.unavailable(str(error) or "no quorum")
            raise BackendUnavailable("backend unavailable") from error
        except EtcdError as error:
            if "lease not found" in error.message:
                if self.on_lease_gone is not None:
                    self.on_lease_gone("etcd no longer knows the node's lease")
            else:
                self.unavailable(f"etcd refused a request: {error.message}")
            raise BackendUnavailable(error.message) from error
        if isinstance(answer, TxnResult) and answer.revision > self.latest:
            self.latest = answer.revision
        return answer

    async def until_answered(self, step: Callable[[], Awaitable[T]]) -> T:
        """Retry a start-up step until etcd answers (a node may start before quorum).
        The step makes its calls through :attr:`unmapped`, so that etcd not
        answering reaches here as such."""
        while True:
            try:
                return await step()
            except EtcdUnavailable as exc:
                self.backend_unavailable += 1
                startup_wait_log("waiting for etcd to start", fields={"cause": str(exc)})
                await trio.sleep(1)

    def spawn(self, job: Callable[[], Awaitable[object]], what: str) -> None:
        """Run etcd work that no request waits for (frees after a disconnect, lease
        ends). If etcd is down it is logged: the stray sweep or the node's lease
        frees it later. So does the node's lease when the node is stopping: its
        nursery is gone, or closed already while connections still end (the node's
        task has not resumed yet to say so)."""
        nursery = self.nursery
        if nursery is None or self.handed_over:
            return  # stopping, or the successor's to do

        async def run() -> None:
            try:
                await job()
            except (EtcdUnavailable, EtcdError, BackendUnavailable) as error:
                self.unavailable(f"{what}: {error}")
            finally:
                self._one_less()

        with contextlib.suppress(RuntimeError):  # "Nursery is closed to new arrivals"
            nursery.start_soon(run)
            self._busy += 1

    async def revoke_quietly(self, lease: int) -> None:
        """Revoke a lease on the way out; if etcd does not answer, its TTL ends it."""
        with contextlib.suppress(EtcdUnavailable, EtcdError):
            await self._client.lease_revoke(lease)

    async def run_batches(self) -> None:
        """Send the node's txns in batches (group commit) until cancelled, each
        batch taking at most the ranks that keep fencing tokens apart
        (:mod:`.tokens`)."""
        await self._client.run_batches(max_ranks=TOKENS_PER_REVISION)
