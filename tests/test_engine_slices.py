"""The engine's bounded slices: waits timing out through the deadline heap, sessions
ending in a crowd freed a slice at a time, and the cap on sessions without a
connection. Exact and instant: time is a number passed in."""

from __future__ import annotations

from elockd.engine.locks import (
    CANCELLED,
    ENDED_DISCONNECTED,
    ENDED_GRACE_EXPIRED,
    ENDED_SESSION_LIMIT,
    GRANTED,
    LockEngine,
    Waiter,
)
from elockd.engine.sessions import Session


def open_sessions(engine: LockEngine, count: int, prefix: str = "s") -> list[Session]:
    return [engine.open_session(f"{prefix}{i}", b"10.0.0.1:%d" % i) for i in range(count)]


class Ended:
    """Records what the audit hook hears."""

    def __init__(self, engine: LockEngine) -> None:
        self.calls: list[tuple[str, int, int, str]] = []
        engine.on_session_end = self.record

    def record(self, session: Session, exclusive: int, shared: int, why: str) -> None:
        self.calls.append((session.id, exclusive, shared, why))


def test_a_wait_times_out_at_its_deadline_and_wakes_its_client() -> None:
    engine = LockEngine()
    holder, waiting = open_sessions(engine, 2)
    engine.acquire(holder, b"k", 0.0)
    waiter = engine.wait_for(waiting, b"k", 0.0, timeout=2.5)
    assert isinstance(waiter, Waiter)
    woken: list[int] = []
    waiter.wake = lambda: woken.append(waiter.state)
    assert engine.next_deadline() == 2.5
    engine.advance(2.4)
    assert waiter.waiting and not woken
    engine.advance(2.5)
    assert woken == [CANCELLED] and engine.timeouts == 1 and engine.waiting == 0
    assert engine.waiting_for(b"k") == 0
    assert engine.blocked_keys(waiter) == [b"k"]
    engine.release(holder, b"k", 3.0)  # a timed-out waiter is never granted later
    assert waiter.state == CANCELLED and b"k" not in engine.exclusive


def test_a_granted_wait_leaves_a_stale_deadline_that_changes_nothing() -> None:
    engine = LockEngine()
    holder, waiting = open_sessions(engine, 2)
    engine.acquire(holder, b"k", 0.0)
    waiter = engine.wait_for(waiting, b"k", 0.0, timeout=5.0)
    assert isinstance(waiter, Waiter)
    engine.release(holder, b"k", 1.0)
    assert waiter.state == GRANTED
    engine.advance(10.0)
    assert engine.exclusive[b"k"].session is waiting and engine.timeouts == 0


def test_timeouts_run_in_budgeted_slices_in_deadline_order() -> None:
    engine = LockEngine()
    holder, *crowd = open_sessions(engine, 11)
    engine.acquire(holder, b"k", 0.0)
    waiters = []
    for index, session in enumerate(crowd):
        waiter = engine.wait_for(session, b"k", 0.0, timeout=1.0 + index / 100)
        assert isinstance(waiter, Waiter)
        waiters.append(waiter)
    assert engine.advance(5.0, budget=4)  # more is due
    assert [w.state for w in waiters] == [CANCELLED] * 4 + [0] * 6
    assert engine.advance(5.0, budget=4)
    assert not engine.advance(5.0, budget=4)  # the last two: nothing more due
    assert all(w.state == CANCELLED for w in waiters) and engine.timeouts == 10


def test_cancelling_from_the_middle_of_a_queue_keeps_the_order_of_the_rest() -> None:
    engine = LockEngine()
    holder, *queued = open_sessions(engine, 6)
    engine.acquire(holder, b"k", 0.0)
    waiters = [engine.wait_for(s, b"k", 0.0) for s in queued]
    for index in (1, 3):
        waiter = waiters[index]
        assert isinstance(waiter, Waiter)
        engine.cancel(waiter, 0.0)
    order = []
    for _ in range(3):
        owner = engine.exclusive[b"k"].session
        engine.release(owner, b"k", 1.0)
        order.append(engine.exclusive[b"k"].session)
    assert order == [queued[0], queued[2], queued[4]]


def test_sessions_ending_in_a_crowd_are_freed_a_slice_at_a_time() -> None:
    engine = LockEngine(free_slice=6)
    ended = Ended(engine)
    crowd = open_sessions(engine, 5)
    for index, session in enumerate(crowd):
        for key in range(4):
            engine.acquire(session, b"k%d-%d" % (index, key), 0.0)
    (waiting,) = open_sessions(engine, 1, prefix="w")
    waiter = engine.wait_for(waiting, b"k4-0", 0.0)
    assert isinstance(waiter, Waiter)
    for session in crowd:
        engine.disconnect(session, 1.0)
    # One session (4 holds) fits this slice's budget of 6; the other four wait,
    # their holds still held: nothing is free until the engine says so.
    assert len(engine.exclusive) == 16 and engine.orphans == 4
    assert engine.next_deadline() == float("-inf")
    assert engine.take_over("s4", waiting) is None  # ending: no conn_id
    assert waiter.waiting
    # A slice starts sessions while budget is left and never splits one: 4 + 4.
    assert engine.advance(1.0, budget=1)
    assert len(engine.exclusive) == 8 and waiter.waiting
    assert not engine.advance(1.0, budget=1)
    assert engine.exclusive.keys() == {b"k4-0"} and engine.orphans == 20
    assert waiter.state == GRANTED and engine.exclusive[b"k4-0"].session is waiting
    assert engine.sessions.keys() == {"w0"} and engine.detached == 0
    assert ended.calls == [(f"s{i}", 4, 0, ENDED_DISCONNECTED) for i in range(5)]


def test_an_advance_without_budget_frees_every_ending_session() -> None:
    engine = LockEngine(free_slice=1)
    crowd = open_sessions(engine, 3)
    for index, session in enumerate(crowd):
        engine.acquire(session, b"x%d" % index, 0.0)
        engine.acquire_shared(session, b"s", 0.0)
        engine.disconnect(session, 0.0)
    assert engine.exclusive  # over the slice: queued
    assert not engine.advance(0.0)
    assert not engine.exclusive and not engine.shared and engine.shared_holders == 0
    assert (engine.orphans, engine.shared_orphans) == (3, 3)


def test_grace_end_is_reported_with_its_reason() -> None:
    engine = LockEngine()
    ended = Ended(engine)
    (session,) = open_sessions(engine, 1)
    session.grace = 2.0
    engine.acquire(session, b"k", 0.0)
    engine.acquire_shared(session, b"s", 0.0)
    engine.disconnect(session, 0.0)
    assert ended.calls == [] and engine.sessions_in_grace == 1
    engine.advance(2.0)
    assert ended.calls == [("s0", 1, 1, ENDED_GRACE_EXPIRED)]
    assert not engine.sessions and engine.detached == 0


def test_a_session_that_holds_nothing_is_not_reported() -> None:
    engine = LockEngine()
    ended = Ended(engine)
    (session,) = open_sessions(engine, 1)
    engine.disconnect(session, 0.0)
    assert ended.calls == [] and not engine.sessions


def test_sessions_without_a_connection_are_bounded_by_max_sessions() -> None:
    engine = LockEngine(max_sessions=2)
    ended = Ended(engine)
    crowd = open_sessions(engine, 4)
    for index, session in enumerate(crowd):
        session.grace = 60.0
        engine.acquire(session, b"k%d" % index, 0.0, ttl=None if index % 2 else 30.0)
        engine.disconnect(session, 0.0)
    # Two live on in grace; the third and fourth end at once, the lease too.
    assert engine.sessions.keys() == {"s0", "s1"} and engine.detached == 2
    assert engine.exclusive.keys() == {b"k0", b"k1"}
    assert engine.orphans == 2 and engine.leases == 1
    assert ended.calls == [("s2", 1, 0, ENDED_SESSION_LIMIT), ("s3", 1, 0, ENDED_SESSION_LIMIT)]
    (newcomer,) = open_sessions(engine, 1, prefix="n")
    assert engine.take_over("s2", newcomer) is None  # its id is refused
    assert engine.take_over("s0", newcomer) is not None  # a kept one can be resumed
    assert engine.detached == 1


def test_connected_sessions_do_not_count_against_max_sessions() -> None:
    engine = LockEngine(max_sessions=1)
    crowd = open_sessions(engine, 50)
    for index, session in enumerate(crowd):
        engine.acquire(session, b"k%d" % index, 0.0, ttl=10.0)
    assert len(engine.sessions) == 50 and engine.detached == 0
    crowd[0].grace = 5.0
    engine.disconnect(crowd[0], 0.0)
    assert "s0" in engine.sessions and engine.exclusive[b"k0"].session is crowd[0]
