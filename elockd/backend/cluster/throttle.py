"""``throttle`` on a cluster: the GCRA's TAT in etcd, swapped in one transaction.

A key's TAT (``<root>t/tat/<hex key>``, see :mod:`.layout`) is kept on the wall
clock, since nodes share no monotonic one: node clocks must agree (NTP), and a skew
of δ seconds between two nodes can admit at most δ·COUNT/PERIOD units more than one
server would (docs/cluster.md, "Throttles on a cluster"). Every admission is one
etcd transaction that compares the TAT's mod revision (or its absence) with the one
the node judged on and writes the new TAT, so the rate holds across nodes: two
nodes never both admit on the same TAT.

Waiters (``wait=S``) queue in a line per key (``<root>t/wait/<hex key>/<id>``, on
the node's lease, so a dead node's waiters leave with it), ordered by create
revision as lock waiters are. A request that does not wait is admitted only while
the line is empty (its transaction compares that too); one that may wait is, in
the same transaction, either admitted (line empty, TAT as judged) or put in line
(the failure branch), so nobody who reaches etcd later goes before it. Only the
head of a line is admitted, by its own node, at its turn, with a transaction that
also checks it still heads the line and deletes its entry. The rule is
:mod:`.throttle_book`'s; the copy of the keys this node judges on is the mirror's.

Lapsed TATs are deleted by the node that wrote them (and by any node, once lapsed
for two session TTLs: their writer may be gone), guarded by the TAT's mod revision:
a key whose TAT moved meanwhile stays.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.etcd.client import (
    KeyValue,
    TxnResult,
    compare_create,
    compare_lease,
    compare_mod,
    delete_op,
    prefix_end,
    put_op,
    range_op,
    txn_op,
)
from elockd.backend.cluster.layout import Layout, parse_tat_value, tat_value, waiter_value
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import ClusterSession, Ledger
from elockd.backend.cluster.throttle_book import (
    NO_TAT,
    ThrottleBook,
    head_turn,
    judge_in_line,
    refusal,
)
from elockd.backend.interface import BackendUnavailable, QueueFull
from elockd.engine.gcra import Rate, Verdict, judge
from elockd.engine.throttles import TooManyThrottles

log = logging.getLogger("elockd.cluster")

#: Swaps a request tries before it gives up (each lost one means another request
#: on the same key was admitted meanwhile, so a busy key makes progress).
MAX_SWAPS = 32
#: Deletes of lapsed TATs per txn (etcd's --max-txn-ops is 128).
DELETES_PER_TXN = 64


@dataclass(eq=False)
class ThrottleWait:
    """A ``throttle ... wait=S`` request of ``session`` in its key's line: its entry
    (``etcd_key``, created at ``revision``), its rate and deadline (this node's
    monotonic clock). Kept in the books as a lock wait is, so that a hand-over can
    move it (docs/upgrade.md)."""

    session: ClusterSession
    key: bytes
    rate: Rate
    etcd_key: bytes
    revision: int
    deadline: float
    since: float
    suspended: bool = False


@dataclass(frozen=True, slots=True)
class _Seen:
    """What one transaction answered of a key: its TAT (and the revision that wrote
    it, 0 for none), the line's cost and head, as of ``at``."""

    tat: float
    tat_revision: int
    queued: float
    head: bytes | None
    at: int


class ClusterThrottles:
    """The throttle verb of one node: its swaps, its waiters, its sweep of lapsed
    TATs and of its own stray line entries."""

    def __init__(
        self,
        calls: EtcdCalls,
        ledger: Ledger,
        layout: Layout,
        book: ThrottleBook,
        mirror_revision: Callable[[], int],
        lease: NodeLease,
        node_id: str,
        *,
        max_throttles: int,
        max_waiters: int,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.calls, self.ledger, self.layout, self.book = calls, ledger, layout, book
        self.mirror_revision = mirror_revision
        self.lease = lease
        self.node_id = node_id  # a successor takes its predecessor's
        self.max_throttles = max_throttles
        self.max_waiters = max_waiters
        self.wall = wall
        #: Line entries a request of this node is creating or waits on: not strays.
        self.live: set[bytes] = set()

    # ------------------------------------------------------------- the verb

    async def throttle(self, session: ClusterSession, key: bytes, rate: Rate, wait: float) -> Verdict:
        if rate.cost == 0:
            return await self._peek(key, rate)
        wall = self.wall()
        if not self.book.has_state(key, wall) and self.book.live(wall) >= self.max_throttles:
            raise TooManyThrottles
        if wait > 0 and self.book.line_length(key) >= self.max_waiters:
            raise QueueFull
        found = self.book.tat(key)
        tat = found.tat if found is not None else NO_TAT
        verdict, _ = judge(tat, wall, rate)
        if not verdict.admitted and wait <= 0:
            # Refused on this node's copy: etcd's TAT is the same or later, never
            # earlier, so it refuses there too (without the line, which only adds).
            return self._answered(refusal(tat, wall, rate, self.book.queued(key)))
        return await self._swap(session, key, rate, wait)

    async def _peek(self, key: bytes, rate: Rate) -> Verdict:
        """``cost=0``: changes nothing; one linearizable read of the TAT."""
        _, kvs, _ = await self.calls.get(self.layout.tat(key))
        tat = parse_tat_value(kvs[0].value)[0] if kvs else NO_TAT
        verdict, _ = judge(tat, self.wall(), rate)
        return self._answered(verdict)

    def _answered(self, verdict: Verdict) -> Verdict:
        if verdict.admitted:
            self.ledger.admitted += 1
        else:
            self.ledger.throttled += 1
        return verdict

    async def _swap(self, session: ClusterSession, key: bytes, rate: Rate, wait: float) -> Verdict:
        """Compare-and-swap the TAT until it holds or the answer is a refusal. With
        ``wait``, the request instead joins the line in the same transaction when
        the swap cannot be made, and waits its turn."""
        layout = self.layout
        tat_key, line = layout.tat(key), layout.throttle_line(key)
        found = self.book.tat(key)
        seen = _Seen(
            found.tat if found is not None else NO_TAT,
            found.revision if found is not None else 0,
            self.book.queued(key),
            None,
            self.mirror_revision(),
        )
        entry = b""
        if wait > 0:
            entry = layout.throttle_waiter(key, secrets.randbits(63) | 1)
            self.live.add(entry)
        try:
            for _ in range(MAX_SWAPS):
                now = self.wall()
                verdict, after = judge_in_line(seen.tat, now, rate, seen.queued)
                if not verdict.admitted and not wait:
                    return self._answered(verdict)
                guard = [
                    compare_mod(tat_key, "==", seen.tat_revision)
                    if seen.tat_revision
                    else compare_create(tat_key, "==", 0),
                    compare_create(line, "==", 0, prefix_end(line)),
                ]
                reads = [
                    range_op(tat_key),
                    range_op(line, prefix_end(line), sort_by_create=True),
                ]
                queue: list[dict[str, Any]] = []
                if wait > 0:
                    units = rate.cost * rate.interval
                    queue = [put_op(entry, waiter_value(self.node_id, units), self.lease.current())]
                if verdict.admitted:
                    result = await self.calls.txn(
                        guard, [put_op(tat_key, tat_value(after, self.node_id))], queue + reads
                    )
                    if result.succeeded:
                        return self._answered(verdict)
                else:
                    result = await self.calls.txn([], queue + reads)
                if wait > 0:
                    return await self._queued(session, key, rate, wait, entry, result)
                seen = _read(result, 0)
            raise BackendUnavailable("throttle: too many requests on one key raced this one")
        finally:
            if wait > 0 and not self.ledger_keeps(session, entry):
                self.live.discard(entry)

    def ledger_keeps(self, session: ClusterSession, entry: bytes) -> bool:
        wait = self.ledger.waits.get(session.id)
        return isinstance(wait, ThrottleWait) and wait.etcd_key == entry and wait.suspended

    async def _queued(
        self,
        session: ClusterSession,
        key: bytes,
        rate: Rate,
        wait: float,
        entry: bytes,
        result: TxnResult,
    ) -> Verdict:
        """The request is in line since ``result``'s revision: wait for its turn."""
        seen = _read(result, 1)
        queued = trio.current_time()
        state = ThrottleWait(session, key, rate, entry, result.revision, queued + wait, queued)
        return await self.wait_for(state, seen)

    # ------------------------------------------------------------- the line

    async def wait_for(self, state: ThrottleWait, seen: _Seen | None = None) -> Verdict:
        """Wait in line until this request's turn (admitted) or its deadline (409);
        also a wait a hand-over stopped, here or on a predecessor, whose entry kept
        its place meanwhile. While a hand-over copies the books the outcome waits,
        as a lock wait's does (:mod:`.recipe`)."""
        ledger, calls, book = self.ledger, self.calls, self.book
        self.live.add(state.etcd_key)
        state.suspended = False
        ledger.waits[state.session.id] = state  # type: ignore[assignment]
        ledger.local_waiting += 1
        changed = trio.Event()

        def wake() -> None:
            changed.set()

        book.listen(state.key, wake)
        verdict: Verdict | None = None
        try:
            while verdict is None:
                with calls.resting():
                    due = self._due(state, seen)
                    while due is not None and trio.current_time() < state.deadline:
                        with trio.move_on_at(min(due, state.deadline)):
                            await changed.wait()
                        if calls.frozen:
                            await calls.thawed()
                        changed = trio.Event()
                        book.unlisten(state.key, wake)
                        book.listen(state.key, wake)
                        due = self._due(state, seen)
                if due is not None:
                    break  # the deadline
                verdict, seen = await self._take_turn(state, seen)
        finally:
            book.unlisten(state.key, wake)
            ledger.local_waiting -= 1
            kept = calls.frozen or calls.handed_over
            if kept:
                state.suspended = True
            elif ledger.waits.get(state.session.id) is state:
                del ledger.waits[state.session.id]  # type: ignore[arg-type]
            if not kept:
                if ledger.on_wait_end is not None:
                    ledger.on_wait_end(False, trio.current_time() - state.since)
                if verdict is None:
                    # Timed out, or the peer left: out of the line (shielded, also
                    # when this task is being cancelled). If etcd cannot be reached
                    # now, the sweep deletes it later.
                    with trio.move_on_after(calls.deadline + 1) as scope:
                        scope.shield = True
                        with contextlib.suppress(BackendUnavailable):
                            await self._leave(state)
                self.live.discard(state.etcd_key)
        if verdict is not None:
            return self._answered(verdict)
        ledger.timeouts += 1
        found = book.tat(state.key)
        tat = found.tat if found is not None else NO_TAT
        return self._answered(
            refusal(tat, self.wall(), state.rate, book.queued(state.key, state.revision))
        )

    def _view(self, state: ThrottleWait, seen: _Seen | None) -> _Seen:
        """The key as the freshest of this node's copy and the last answer of etcd
        shows it."""
        if seen is not None and seen.at > self.mirror_revision():
            return seen
        book = self.book
        found = book.tat(state.key)
        head = book.head(state.key)
        return _Seen(
            found.tat if found is not None else NO_TAT,
            found.revision if found is not None else 0,
            book.queued(state.key, state.revision),
            head.etcd_key if head is not None else None,
            self.mirror_revision(),
        )

    def _due(self, state: ThrottleWait, seen: _Seen | None) -> float | None:
        """When this node should look again (this node's monotonic clock), or None
        when it is this waiter's turn now. Not at the head: at the deadline (a
        change of the line wakes it sooner)."""
        view = self._view(state, seen)
        if view.at < state.revision:
            return state.deadline  # the copy has not seen the entry yet
        if view.head != state.etcd_key:
            if view.head is None or (
                view.at >= state.revision and not self.book.has_waiter(state.etcd_key)
                and view is not seen
            ):
                raise BackendUnavailable("throttle wait lost: this node's etcd lease ran out")
            return state.deadline
        now = self.wall()
        verdict, _, due = head_turn(view.tat, now, state.rate)
        if verdict is not None:
            return None
        return trio.current_time() + (due - now)

    async def _take_turn(
        self, state: ThrottleWait, seen: _Seen | None
    ) -> tuple[Verdict | None, _Seen | None]:
        """The head's turn has come: swap the TAT, delete the entry, in one txn that
        also checks the entry still heads its line. (None, what etcd has) if not."""
        self.lease.check_expiry()
        if self.lease.past_deadline():
            raise BackendUnavailable("throttle wait lost: this node's etcd lease ran out")
        view = self._view(state, seen)
        now = self.wall()
        verdict, after, _ = head_turn(view.tat, now, state.rate)
        if verdict is None:
            return None, view
        tat_key, line = self.layout.tat(state.key), self.layout.throttle_line(state.key)
        result = await self.calls.txn(
            [
                compare_mod(tat_key, "==", view.tat_revision)
                if view.tat_revision
                else compare_create(tat_key, "==", 0),
                compare_create(state.etcd_key, "==", state.revision),
                compare_create(line, ">", state.revision - 1, prefix_end(line)),
            ],
            [put_op(tat_key, tat_value(after, self.node_id)), delete_op(state.etcd_key)],
            [range_op(tat_key), range_op(line, prefix_end(line), sort_by_create=True, limit=1)],
        )
        if result.succeeded:
            return verdict, None
        fresh = _read(result, 0, before=state.revision)
        if fresh.head != state.etcd_key:
            raise BackendUnavailable("throttle wait lost: this node's etcd lease ran out")
        return None, fresh

    async def _leave(self, state: ThrottleWait) -> None:
        entry = state.etcd_key
        await self.calls.txn([compare_create(entry, "==", state.revision)], [delete_op(entry)])

    # ------------------------------------------------------------- the sweep

    async def run(self) -> None:
        """Every second: delete the lapsed TATs this node wrote (and any lapsed
        long ago), and this node's line entries no request waits on (a leave etcd
        refused). Runs in the node's nursery until cancelled."""
        while True:
            await trio.sleep(1.0)
            if self.calls.frozen or self.calls.handed_over:
                continue
            with contextlib.suppress(BackendUnavailable):
                await self.sweep()

    async def sweep(self) -> None:
        book = self.book
        orphaned_after = 2.0 * self.lease.ttl
        deletes = [
            txn_op([compare_mod(self.layout.tat(key), "==", found.revision)], [
                delete_op(self.layout.tat(key))
            ])
            for key, found in book.lapsed(self.wall(), self.node_id, orphaned_after)
        ]
        lease = self.lease.id
        if lease:
            deletes += [
                txn_op(
                    [
                        compare_create(entry.etcd_key, "==", entry.revision),
                        compare_lease(entry.etcd_key, "==", lease),
                    ],
                    [delete_op(entry.etcd_key)],
                )
                for entry in book.waiters_on(lease)
                if entry.etcd_key not in self.live
            ]
        for start in range(0, len(deletes), DELETES_PER_TXN):
            await self.calls.txn([], deletes[start : start + DELETES_PER_TXN])

    # -------------------------------------------------------------- counts

    def keys(self) -> int:
        """Throttle keys with state now (``q``'s ``throttles``): TATs not yet
        swept (lapsed ones go within a second) and keys with waiters only."""
        book = self.book
        return len(book.tats) + sum(1 for key in book.lines if key not in book.tats)


def _read(result: TxnResult, first: int, *, before: int | None = None) -> _Seen:
    """A key as a txn's two reads (its TAT, then its line oldest first) show it."""
    tats: list[KeyValue] = result.kvs(first)
    line: list[KeyValue] = result.kvs(first + 1)
    tat, revision = (parse_tat_value(tats[0].value)[0], tats[0].mod_revision) if tats else (
        NO_TAT,
        0,
    )
    from elockd.backend.cluster.layout import parse_waiter_value

    queued = sum(
        parse_waiter_value(kv.value)[1]
        for kv in line
        if before is None or kv.create_revision < before
    )
    return _Seen(tat, revision, queued, line[0].key if line else None, result.revision)


_ = math  # noqa: F841
