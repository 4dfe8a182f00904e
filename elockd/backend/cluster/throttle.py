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

A head whose node has not taken its turn ``line_grace`` seconds after it came (the
node is cut from etcd, paused, slow) is passed over (:mod:`elockd.engine.line_grace`):
the waiter behind it, or a newcomer, deletes its entry in a transaction that
compares the TAT it judged on (so the head had not taken its turn) and that the
passed-over entries are the line's first, and rewrites the TAT unchanged with its
own wall clock as ``since``: the new head's turn comes no earlier. The TAT stays,
so passing admits nobody; a passed-over head that comes back finds its entry gone
(its swap compares that entry) and is answered as a wait that ran out.

Lapsed TATs are deleted by the node that wrote them (and by any node, once lapsed
for two session TTLs: their writer may be gone), guarded by the TAT's mod revision:
a key whose TAT moved meanwhile stays.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, NoReturn

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
from elockd.backend.cluster.layout import (
    Layout,
    parse_tat_value,
    parse_waiter_value,
    tat_value,
    waiter_value,
)
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import ClusterSession, Ledger, ThrottleWait
from elockd.backend.cluster.throttle_book import (
    NO_TAT,
    ThrottleBook,
    behind,
    head_turn,
    judge_in_line,
)
from elockd.backend.interface import BackendUnavailable, QueueFull
from elockd.engine.gcra import Rate, Verdict, judge
from elockd.engine.line_grace import Head, passed_entries, passed_over
from elockd.engine.line_grace import Step as Ahead
from elockd.engine.throttles import THROTTLE_KIND, TooManyThrottles

#: Swaps a request tries before it gives up (each lost one means another request
#: on the same key was admitted meanwhile, so a busy key makes progress).
MAX_SWAPS = 32
#: Deletes per txn in the sweep (etcd's --max-txn-ops is 128).
DELETES_PER_TXN = 64
#: Seconds between two sweeps of lapsed TATs and stray line entries.
SWEEP_PERIOD = 1.0
#: Line entries passed over in one txn at most (each costs a compare and a delete;
#: etcd's --max-txn-ops is 128).
MAX_PASS = 32

__all__ = ["ClusterThrottles", "ThrottleWait"]


@dataclass(frozen=True, slots=True)
class Seen:
    """A key as one look showed it (this node's copy, or a txn's reads): its TAT
    and the revision that wrote it (0: none), its line's head and the waiters
    ahead of the request that looks, as of revision ``at``."""

    tat: float
    tat_revision: int
    head: bytes | None
    ahead: Collection[Ahead]
    at: int
    #: The writer's wall clock when it wrote the TAT (the head is the head since).
    since: float = NO_TAT
    #: The line's first entries (at most MAX_PASS): (etcd key, create revision, node).
    heads: tuple[Head, ...] = ()


class PassedOver(Exception):
    """This node's line entry was passed over (deleted by another node) while the
    node's lease held: the wait ends as one that ran out."""


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
        line_grace: float = 1.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.calls, self.ledger, self.layout, self.book = calls, ledger, layout, book
        self.mirror_revision = mirror_revision
        self.lease = lease
        self.node_id = node_id  # a successor takes its predecessor's
        self.max_throttles = max_throttles
        self.max_waiters = max_waiters
        self.line_grace = line_grace
        self.wall = wall
        #: Line entries a request of this node is creating or waits on: not strays.
        self.live: set[bytes] = set()

    # ------------------------------------------------------------- the verb

    async def throttle(
        self, session: ClusterSession, key: bytes, rate: Rate, wait: float
    ) -> Verdict:
        if rate.cost == 0:
            return await self._peek(key, rate)
        book, wall = self.book, self.wall()
        if not book.has_state(key, wall) and book.live(wall) >= self.max_throttles:
            raise TooManyThrottles(key)
        if wait > 0 and book.line_length(key) >= self.max_waiters:
            raise QueueFull(key)
        seen = self._look(key)
        verdict, _ = judge(seen.tat, wall, rate)
        if not verdict.admitted and verdict.retry > wait:
            # Refused on this node's copy: etcd's TAT is the same or later, never
            # earlier, and waiters only add to the wait; so etcd refuses it too.
            return self._answered(judge_in_line(seen.tat, wall, rate, seen.ahead)[0])
        if seen.head is not None:  # a line: are heads of it to be passed over?
            seen = await self._pass_stale(key, replace(seen, heads=self._heads(key)))
        if wait <= 0:
            return await self._swap(key, rate, seen)
        return await self._swap_or_queue(session, key, rate, wait, seen)

    async def _peek(self, key: bytes, rate: Rate) -> Verdict:
        """``cost=0``: changes nothing, counts in nothing (as in memory); one
        linearizable read of the TAT."""
        _, kvs, _ = await self.calls.get(self.layout.tat(key))
        tat = parse_tat_value(kvs[0].value)[0] if kvs else NO_TAT
        return judge(tat, self.wall(), rate)[0]

    def _answered(self, verdict: Verdict) -> Verdict:
        if verdict.admitted:
            self.ledger.admitted += 1
        else:
            self.ledger.throttled += 1
        return verdict

    def _look(
        self, key: bytes, before: int = 1 << 62, *, skip: int = 0, mine: bytes | None = None
    ) -> Seen:
        """``key`` as this node's copy shows it. The line's first entries (what
        passing over needs) only for a waiter, ``mine``, that is not the head: every
        other look names them when it comes to pass (:meth:`_heads`)."""
        book = self.book
        found, head = book.tat(key), book.head(key)
        return Seen(
            found.tat if found is not None else NO_TAT,
            found.revision if found is not None else 0,
            head.etcd_key if head is not None else None,
            book.ahead(key, before, skip=skip),
            self.mirror_revision(),
            found.since if found is not None else NO_TAT,
            self._heads(key) if head is not None and mine not in (None, head.etcd_key) else (),
        )

    def _heads(self, key: bytes) -> tuple[Head, ...]:
        """The first entries of ``key``'s line, as many as one txn passes over."""
        return self.book.heads(key, MAX_PASS)

    # ------------------------------------------------------------- passing over

    def _passing(self, seen: Seen, now: float, mine: bytes = b"") -> tuple[tuple[Head, ...], float]:
        """The entries of ``seen``'s line passed over at ``now`` (wall clock): the
        heads ahead whose turn came more than the grace ago, and the later entries of
        their nodes (:func:`elockd.engine.line_grace.passed_entries`); and when the
        next head will be (``inf``: never, as things stand). Never ``mine``, the entry of the waiter
        that asks: it is here to take its turn."""
        limit = min(len(seen.heads), len(seen.ahead))
        if not limit:
            return (), float("inf")
        count, due = passed_over(seen.tat, seen.since, now, self.line_grace, seen.ahead, limit)
        found = passed_entries(seen.heads, count)
        return tuple(entry for entry in found if entry[0] != mine), due

    def _pass_guard(
        self, key: bytes, seen: Seen, passing: tuple[Head, ...]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(compares, deletes) of passing over ``passing``: the TAT is the one
        ``seen`` judged on (none of them took its turn), each is still in line and
        nothing older is (they are the line's first)."""
        line = self.layout.throttle_line(key)
        compares = [
            compare_mod(self.layout.tat(key), "==", seen.tat_revision),
            compare_create(line, ">", passing[0][1] - 1, prefix_end(line)),
            *(compare_create(etcd_key, "==", revision) for etcd_key, revision, _ in passing),
        ]
        return compares, [delete_op(etcd_key) for etcd_key, _, _ in passing]

    def _passed(
        self,
        key: bytes,
        tat: float,
        revision: int,
        now: float,
        passing: Collection[Head],
    ) -> None:
        """This node's txn wrote ``tat`` at ``now`` and removed ``passing``."""
        self.book.wrote(key, tat, revision, self.node_id, now)
        seen_up_to = self.mirror_revision()
        for etcd_key, _, _ in passing:
            self.book.left(etcd_key, revision, seen_up_to)

    async def _pass_stale(
        self, key: bytes, seen: Seen, before: int = 1 << 62, mine: bytes = b""
    ) -> Seen:
        """Pass over the heads of ``key``'s line (older than ``before``, the waiter
        ``mine``'s place) whose turn came more than the grace ago, if any: the key as
        etcd then shows it."""
        now = self.wall()
        passing, _ = self._passing(seen, now, mine)
        if not passing:
            return seen
        compares, deletes = self._pass_guard(key, seen, passing)
        put = put_op(self.layout.tat(key), tat_value(seen.tat, self.node_id, now))
        reads = self._reads(key)
        result = await self.calls.txn(compares, [put, *deletes, *reads], reads)
        if not result.succeeded:
            return _read(result, 0, before=before)
        self._passed(key, seen.tat, result.revision, now, passing)
        return _read(result, 1 + len(deletes), before=before)

    def _guard(self, key: bytes, seen: Seen) -> list[dict[str, Any]]:
        """The swap's compare: the TAT is the one ``seen`` judged on, and nobody
        waits in the key's line."""
        tat_key, line = self.layout.tat(key), self.layout.throttle_line(key)
        return [
            compare_mod(tat_key, "==", seen.tat_revision)
            if seen.tat_revision
            else compare_create(tat_key, "==", 0),
            compare_create(line, "==", 0, prefix_end(line)),
        ]

    def _reads(self, key: bytes, *, head_only: bool = False) -> list[dict[str, Any]]:
        tat_key, line = self.layout.tat(key), self.layout.throttle_line(key)
        return [
            range_op(tat_key),
            range_op(line, prefix_end(line), sort_by_create=True, limit=1 if head_only else 0),
        ]

    async def _swap(self, key: bytes, rate: Rate, seen: Seen) -> Verdict:
        """A request that does not wait: swap the TAT while the line is empty, judged
        again on etcd's answer each time another request got there first."""
        tat_key = self.layout.tat(key)
        for _ in range(MAX_SWAPS):
            now = self.wall()
            verdict, after = judge_in_line(seen.tat, now, rate, seen.ahead)
            if not verdict.admitted:
                return self._answered(verdict)
            result = await self.calls.txn(
                self._guard(key, seen),
                [put_op(tat_key, tat_value(after, self.node_id, now))],
                self._reads(key),
            )
            if result.succeeded:
                self.book.wrote(key, after, result.revision, self.node_id, now)
                return self._answered(verdict)
            seen = _read(result, 0)
        raise BackendUnavailable("throttle: too many requests on one key raced this one")

    async def _swap_or_queue(
        self, session: ClusterSession, key: bytes, rate: Rate, wait: float, seen: Seen
    ) -> Verdict:
        """A request that may wait: in one txn, admitted if the line is empty and the
        TAT is as judged, or else put at the end of the line (so nobody who reaches
        etcd after it goes first), then waits its turn there."""
        entry = self.layout.throttle_waiter(key, secrets.randbits(63) | 1)
        value = waiter_value(self.node_id, rate.cost * rate.interval, rate.capacity)
        tat_key = self.layout.tat(key)
        self.live.add(entry)
        waiting = False
        try:
            now = self.wall()
            verdict, after = judge_in_line(seen.tat, now, rate, seen.ahead)
            lease = self.lease.current()
            queue = [put_op(entry, value, lease), *self._reads(key)]
            if verdict.admitted:
                put = put_op(tat_key, tat_value(after, self.node_id, now))
                result = await self.calls.txn(self._guard(key, seen), [put], queue)
                if result.succeeded:
                    self.book.wrote(key, after, result.revision, self.node_id, now)
                    return self._answered(verdict)
            else:
                result = await self.calls.txn([], queue)
            joined = KeyValue(entry, value, result.revision, result.revision, lease)
            self.book.joined(joined, self.mirror_revision())
            since = trio.current_time()
            state = ThrottleWait(session, key, rate, entry, result.revision, since + wait, since)
            seen = _read(result, 1, before=result.revision)
            mine = behind(seen.tat, self.wall(), rate, seen.ahead)
            if mine.retry > wait:
                # Its turn, as etcd now shows the key, comes after its wait (the
                # copy judged on trailed etcd): refused now, as on one server.
                await self._leave(state)
                return self._answered(mine)
            waiting = True
            return await self.wait_for(state, seen)
        finally:
            if not waiting:
                self.live.discard(entry)

    # ------------------------------------------------------------- the line

    async def wait_for(self, state: ThrottleWait, seen: Seen | None = None) -> Verdict:
        """Wait in line until this request's turn (admitted) or its deadline (409);
        also a wait a hand-over stopped, here or on a predecessor, whose entry kept
        its place meanwhile. While a hand-over copies the books the outcome waits,
        as a lock wait's does (:mod:`.recipe`)."""
        ledger, calls, book = self.ledger, self.calls, self.book
        self.live.add(state.etcd_key)
        state.suspended = False
        ledger.waits[state.session.id] = state
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
                        due = self._due(state, seen)
                if due is not None:
                    break  # its deadline
                verdict, seen = await self._take_turn(state, seen)
        except PassedOver:
            pass  # answered as a wait that ran out: its place is gone
        finally:
            book.unlisten(state.key, wake)
            ledger.local_waiting -= 1
            kept = calls.frozen or calls.handed_over
            if kept:
                state.suspended = True  # its entry, place and deadline move as they are
            elif ledger.waits.get(state.session.id) is state:
                del ledger.waits[state.session.id]
            if not kept:
                if ledger.on_wait_end is not None:
                    ledger.on_wait_end(THROTTLE_KIND, trio.current_time() - state.since)
                if verdict is None:
                    # Timed out, lost, or the peer left: out of the line (shielded,
                    # also when this task is being cancelled). If etcd cannot be
                    # reached now, the sweep deletes it later.
                    with trio.move_on_after(calls.deadline + 1) as scope:
                        scope.shield = True
                        with contextlib.suppress(BackendUnavailable):
                            await self._leave(state)
                self.live.discard(state.etcd_key)
        if verdict is not None:
            return self._answered(verdict)
        ledger.timeouts += 1
        # Its 409, were it asked again now (behind every other waiter).
        late = self._look(state.key, skip=state.revision)
        return self._answered(behind(late.tat, self.wall(), state.rate, late.ahead))

    def _view(self, state: ThrottleWait, seen: Seen | None) -> Seen:
        """The key as the later of this node's copy and etcd's last answer show it."""
        if seen is not None and seen.at > self.mirror_revision():
            return seen
        view = self._look(state.key, state.revision, mine=state.etcd_key)
        if view.at >= state.revision and not self.book.has_waiter(state.etcd_key):
            self._gone()
        return view

    def _gone(self) -> NoReturn:
        """This node's line entry is gone: with the node's lease (past its local
        deadline), or passed over by another node while the lease held."""
        self.lease.check_expiry()
        if self.lease.past_deadline():
            raise BackendUnavailable("throttle wait lost: this node's etcd lease ran out")
        raise PassedOver()

    def _due(self, state: ThrottleWait, seen: Seen | None) -> float | None:
        """When to look again (this node's monotonic clock), or None when it is this
        waiter's move now (its turn, or passing over the heads ahead of it). Not at
        the head: when the next head ahead may be passed over, else at the deadline
        (a change of the key wakes it sooner)."""
        view = self._view(state, seen)
        if view.at < state.revision:
            return state.deadline
        now = self.wall()
        if view.head != state.etcd_key:
            passing, due = self._passing(view, now, state.etcd_key)
            if _may_pass(passing, view):
                return None  # the heads ahead are passed over: this waiter's move
            if due == float("inf"):
                return state.deadline
        else:
            verdict, _, due = head_turn(view.tat, now, state.rate)
            if verdict is not None:
                return None
        return min(state.deadline, trio.current_time() + max(due - now, 1e-6))

    async def _take_turn(
        self, state: ThrottleWait, seen: Seen | None
    ) -> tuple[Verdict | None, Seen | None]:
        """The head's turn has come: swap the TAT and delete the entry, in one txn
        that also checks that the entry still heads its line (or that only heads
        passed over are ahead of it: they are deleted in the same txn). (None, what
        etcd has) when the TAT moved meanwhile, or when it only passed over heads
        ahead (its own turn has not come). Never under a lease past its local
        deadline."""
        self.lease.check_expiry()
        if self.lease.past_deadline():
            raise BackendUnavailable("throttle wait lost: this node's etcd lease ran out")
        view = self._view(state, seen)
        now = self.wall()
        passing: tuple[Head, ...] = ()
        if view.head != state.etcd_key:
            passing, _ = self._passing(view, now, state.etcd_key)
            if not _may_pass(passing, view):
                return None, view
        verdict, after, _ = head_turn(view.tat, now, state.rate)
        if passing and (verdict is None or len(view.ahead) > len(view.heads)):
            # Its own turn has not come, or the line ahead is longer than one txn
            # passes: only the passing, for now.
            return None, await self._pass_stale(state.key, view, state.revision, state.etcd_key)
        if verdict is None:
            return None, view
        tat_key, line = self.layout.tat(state.key), self.layout.throttle_line(state.key)
        deletes: list[dict[str, Any]] = []
        if passing:
            compares, deletes = self._pass_guard(state.key, view, passing)
        else:
            compares = [
                compare_mod(tat_key, "==", view.tat_revision)
                if view.tat_revision
                else compare_create(tat_key, "==", 0),
                # Every entry of the line is as young as this one or younger.
                compare_create(line, ">", state.revision - 1, prefix_end(line)),
            ]
        result = await self.calls.txn(
            [*compares, compare_create(state.etcd_key, "==", state.revision)],
            [
                put_op(tat_key, tat_value(after, self.node_id, now)),
                delete_op(state.etcd_key),
                *deletes,
            ],
            self._reads(state.key, head_only=not passing),
        )
        if result.succeeded:
            self._passed(state.key, after, result.revision, now, passing)
            self.book.left(state.etcd_key, result.revision, self.mirror_revision())
            return verdict, None
        fresh = _read(result, 0, before=state.revision)
        if all(kv.key != state.etcd_key for kv in result.kvs(1)):
            self._gone()  # nobody older can join a line: the entry itself is gone
        return None, fresh

    async def _leave(self, state: ThrottleWait) -> None:
        entry = state.etcd_key
        result = await self.calls.txn(
            [compare_create(entry, "==", state.revision)], [delete_op(entry)]
        )
        if result.succeeded:
            self.book.left(entry, result.revision, self.mirror_revision())

    # ------------------------------------------------------------- the sweep

    async def run(self) -> None:
        """Every second: delete the lapsed TATs this node wrote (and any lapsed
        long ago: their writer may be gone), and this node's line entries that no
        request waits on (a leave etcd refused). In the node's nursery."""
        while True:
            await trio.sleep(SWEEP_PERIOD)
            if self.calls.frozen or self.calls.handed_over:
                continue
            with contextlib.suppress(BackendUnavailable):
                await self.sweep()

    async def sweep(self) -> None:
        book, layout = self.book, self.layout
        deletes = [
            txn_op(
                [compare_mod(layout.tat(key), "==", found.revision)],
                [delete_op(layout.tat(key))],
            )
            for key, found in book.lapsed(self.wall(), self.node_id, 2.0 * self.lease.ttl)
            if key not in book.lines
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


def _read(result: TxnResult, first: int, *, before: int = 1 << 62) -> Seen:
    """A key as a txn's two reads show it: its TAT, then its line oldest first (the
    waiters older than ``before`` are the ones ahead)."""
    tats, line = result.kvs(first), result.kvs(first + 1)
    tat, revision, since = NO_TAT, 0, NO_TAT
    if tats:
        tat, _, since = parse_tat_value(tats[0].value)
        revision = tats[0].mod_revision
    ahead = [parse_waiter_value(kv.value)[1:] for kv in line if kv.create_revision < before]
    heads = tuple(
        (kv.key, kv.create_revision, parse_waiter_value(kv.value)[0]) for kv in line[:MAX_PASS]
    )
    return Seen(tat, revision, line[0].key if line else None, ahead, result.revision, since, heads)


def _may_pass(passing: tuple[Head, ...], view: Seen) -> bool:
    """Whether a waiter that sees ``view`` passes over ``passing`` itself: when they
    are everyone ahead of it (as far as ``view`` names the line's entries)."""
    if not passing:
        return False
    gone = {etcd_key for etcd_key, _, _ in passing}
    return all(etcd_key in gone for etcd_key, _, _ in view.heads[: len(view.ahead)])
