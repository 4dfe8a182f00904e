"""The deadline heap stays proportional to live deadlines (issue: a renew flood kept
every superseded deadline until it fired, a day later)."""

from __future__ import annotations

import random

from elockd.engine.deadlines import COMPACT_FLOOR, Deadlines
from elockd.engine.locks import LockEngine


class Target:
    def __init__(self) -> None:
        self.deadline: float | None = None


def carries(deadline: float, target: Target) -> bool:
    return target.deadline == deadline


def test_stale_entries_are_compacted_once_the_heap_doubles() -> None:
    heap: Deadlines[Target] = Deadlines(carries)
    target = Target()
    for step in range(100_000):
        target.deadline = 1000.0 + step
        heap.add(target.deadline, target)
        assert len(heap) <= COMPACT_FLOOR
    assert list(heap.due(1e9)) == [(1000.0 + 99_999, target)]


def test_compaction_keeps_every_live_deadline_in_order_ties_as_added() -> None:
    heap: Deadlines[Target] = Deadlines(carries)
    rng = random.Random(7)
    live = [Target() for _ in range(3000)]
    for target in live:
        target.deadline = float(rng.randrange(50))  # many ties
        heap.add(target.deadline, target)
    for _ in range(20_000):  # renew at random: most entries go stale
        target = rng.choice(live)
        deadline = float(rng.randrange(50))
        if deadline != target.deadline:  # as the engine does: one entry per deadline
            target.deadline = deadline
            heap.add(deadline, target)
    assert len(heap) <= 2 * len(live) + COMPACT_FLOOR
    out = []
    for deadline, target in heap.due(100.0):
        out.append((deadline, target))
        target.deadline = None  # handled, as the engine frees or times it out
    assert sorted(id(t) for _, t in out) == sorted(id(t) for t in live)
    deadlines = [d for d, _ in out]
    assert deadlines == sorted(deadlines)


def test_a_deadline_renewed_back_and_forth_in_one_tick_stays_bounded() -> None:
    """Entries A, B, A, B ... of one target: the old A entries read as current again
    whenever the deadline is A; compaction still keeps one entry per target."""
    heap: Deadlines[Target] = Deadlines(carries)
    target = Target()
    for step in range(100_000):
        target.deadline = 5.0 if step % 2 else 100.0
        heap.add(target.deadline, target)
        assert len(heap) <= COMPACT_FLOOR
    assert [t for _, t in heap.due(1e9)][:1] == [target]


def test_a_renew_flood_of_one_lease_leaves_the_engine_heap_flat() -> None:
    engine = LockEngine()
    session = engine.open_session("s", b"peer")
    engine.acquire(session, b"k", 0.0, ttl=86400)
    for step in range(200_000):
        assert engine.renew(session, b"k", float(step), 86400)
    assert len(engine._deadlines) <= COMPACT_FLOOR
    engine.release(session, b"k", 200_000.0)
    engine.advance(10**7)
    assert engine.expired == 0 and engine.leases == 0


def test_renews_pipelined_in_one_tick_add_no_entries() -> None:
    """A chunk of pipelined requests is handled at one ``now``: renewing to the same
    deadline must not push a second current entry (compaction could not drop it)."""
    engine = LockEngine()
    session = engine.open_session("s", b"peer")
    engine.acquire(session, b"k", 0.0, ttl=5)
    for _ in range(100_000):
        engine.renew(session, b"k", 1.0, 5)
    assert len(engine._deadlines) == 2
    engine.advance(6.0)
    assert engine.expired == 1 and not session.exclusive


def test_granted_waits_do_not_leave_their_deadlines_behind() -> None:
    """A hot key whose waiters are granted long before their WAIT ends: each grant
    leaves a stale deadline that would otherwise stay for the whole WAIT."""
    engine = LockEngine()
    holder = engine.open_session("h", b"h")
    waiters = [engine.open_session(f"w{i}", b"w") for i in range(50_000)]
    engine.acquire(holder, b"hot", 0.0)
    previous = holder
    for now, session in enumerate(waiters, start=1):
        waiter = engine.wait_for(session, b"hot", float(now), timeout=86400)
        assert waiter is not None
        engine.release(previous, b"hot", float(now))
        assert waiter.granted
        previous = session
    assert len(engine._deadlines) <= COMPACT_FLOOR
