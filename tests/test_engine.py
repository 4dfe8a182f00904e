"""Examples of the lock engine's rules, one behaviour each (the model test explores
the same rules at random; these pin the cases a reader looks for first)."""

from __future__ import annotations

import pytest

from elockd.engine.locks import CANCELLED, GRANTED, LockEngine, QueueFull, TooManyHolds, Waiter
from elockd.engine.sessions import Hold, Session


def sessions(engine: LockEngine, count: int) -> list[Session]:
    return [engine.open_session(f"s{i}", f"10.0.0.{i}:1000".encode()) for i in range(count)]


def granted_order(waiters: list[Waiter]) -> list[int]:
    return [i for i, w in enumerate(waiters) if w.state == GRANTED]


def test_exclusive_one_holder_and_repeat_by_holder() -> None:
    engine = LockEngine()
    a, b = sessions(engine, 2)
    assert engine.acquire(a, b"k", 0.0)
    assert engine.acquire(a, b"k", 0.0)  # harmless repeat, still one hold
    assert not engine.acquire(b, b"k", 0.0)
    assert engine.release(a, b"k", 0.0)
    assert not engine.release(a, b"k", 0.0)
    assert engine.acquire(b, b"k", 0.0)


def test_waiters_are_served_first_come_first_served() -> None:
    engine = LockEngine()
    holder, *queued = sessions(engine, 4)
    engine.acquire(holder, b"k", 0.0)
    waiters = [engine.wait_for(s, b"k", float(i)) for i, s in enumerate(queued)]
    assert all(isinstance(w, Waiter) for w in waiters)
    ws = [w for w in waiters if w is not None]
    assert engine.waiting == 3
    engine.release(holder, b"k", 5.0)
    assert granted_order(ws) == [0] and engine.exclusive[b"k"].session is queued[0]
    engine.release(queued[0], b"k", 6.0)
    assert granted_order(ws) == [0, 1]
    engine.release(queued[1], b"k", 7.0)
    assert granted_order(ws) == [0, 1, 2] and engine.waiting == 0


def test_try_once_never_overtakes_a_waiter() -> None:
    engine = LockEngine()
    holder, waiting, late = sessions(engine, 3)
    engine.acquire(holder, b"k", 0.0)
    waiter = engine.wait_for(waiting, b"k", 0.0)
    engine.release(holder, b"k", 1.0)  # handed over at once: never free in between
    assert waiter is not None and waiter.granted
    assert not engine.acquire(late, b"k", 1.0)


def test_cancelled_waiter_is_never_granted_and_wakes_nobody() -> None:
    engine = LockEngine()
    holder, first, second = sessions(engine, 3)
    engine.acquire(holder, b"k", 0.0)
    w1 = engine.wait_for(first, b"k", 0.0)
    w2 = engine.wait_for(second, b"k", 0.0)
    assert w1 is not None and w2 is not None
    engine.cancel(w1, 1.0, timed_out=True)
    assert w1.state == CANCELLED and engine.timeouts == 1
    engine.release(holder, b"k", 2.0)
    assert w1.state == CANCELLED and w2.granted
    assert engine.exclusive[b"k"].session is second


def test_wake_callback_runs_on_grant() -> None:
    engine = LockEngine()
    holder, waiting = sessions(engine, 2)
    engine.acquire(holder, b"k", 0.0)
    waiter = engine.wait_for(waiting, b"k", 0.0)
    assert waiter is not None
    woken: list[bool] = []
    waiter.wake = lambda: woken.append(waiter.granted)
    engine.release(holder, b"k", 1.0)
    assert woken == [True]


def test_disconnect_frees_plain_holds_counts_orphans_and_cancels_waits() -> None:
    engine = LockEngine()
    a, b = sessions(engine, 2)
    engine.acquire(a, b"x", 0.0)
    engine.acquire_shared(a, b"s", 0.0)
    engine.acquire(b, b"y", 0.0)
    waiter = engine.wait_for(a, b"y", 0.0)
    assert waiter is not None
    engine.disconnect(a, 1.0)
    assert waiter.state == CANCELLED
    assert b"x" not in engine.exclusive and engine.shared_count(b"s") == 0
    assert (engine.orphans, engine.shared_orphans) == (1, 1)
    assert "s0" not in engine.sessions
    engine.release(b, b"y", 2.0)
    assert b"y" not in engine.exclusive  # the cancelled waiter did not get it


def test_lease_expires_at_its_deadline_and_wakes_the_next_waiter() -> None:
    engine = LockEngine()
    a, b = sessions(engine, 2)
    engine.acquire(a, b"k", 0.0, ttl=2.0)
    waiter = engine.wait_for(b, b"k", 0.5)
    assert waiter is not None and engine.leases == 1
    engine.advance(1.999)
    assert not waiter.granted
    engine.advance(2.0)
    assert waiter.granted and engine.expired == 1 and engine.leases == 0


def test_renew_moves_the_deadline_and_stale_heap_entries_are_skipped() -> None:
    engine = LockEngine()
    (a,) = sessions(engine, 1)
    engine.acquire(a, b"k", 0.0, ttl=1.0)
    assert engine.renew(a, b"k", 0.5, 3.0)
    engine.advance(1.0)  # the old deadline: stale, skipped
    assert b"k" in engine.exclusive
    engine.advance(3.5)
    assert b"k" not in engine.exclusive and engine.expired == 1
    assert not engine.renew(a, b"k", 4.0, 1.0)


def test_lease_survives_disconnect_and_session_waits_for_takeover() -> None:
    engine = LockEngine()
    a, fresh = sessions(engine, 2)
    engine.acquire(a, b"lease", 0.0, ttl=10.0)
    engine.acquire(a, b"plain", 0.0)
    engine.disconnect(a, 1.0)
    assert b"lease" in engine.exclusive and b"plain" not in engine.exclusive
    assert engine.orphans == 1
    assert engine.take_over(a.id, fresh) is a
    assert a.connected and fresh.id not in engine.sessions
    engine.advance(11.0)
    assert b"lease" not in engine.exclusive and engine.expired == 1


def test_grace_keeps_holds_until_it_ends() -> None:
    engine = LockEngine()
    a, b = sessions(engine, 2)
    engine.acquire(a, b"k", 0.0)
    waiter = engine.wait_for(b, b"k", 0.0)
    a.grace = 2.0
    engine.disconnect(a, 1.0)
    engine.advance(2.9)
    assert b"k" in engine.exclusive and engine.exclusive[b"k"].session is a
    engine.advance(3.0)
    assert waiter is not None and waiter.granted and engine.orphans == 1
    assert a.id not in engine.sessions


def test_takeover_within_grace_keeps_holds_without_orphans() -> None:
    engine = LockEngine()
    a, fresh, busy = sessions(engine, 3)
    engine.acquire(a, b"k", 0.0)
    a.grace = 5.0
    engine.disconnect(a, 1.0)
    engine.acquire(busy, b"other", 1.0)
    assert engine.take_over(a.id, busy) is None  # must hold nothing yet
    assert engine.take_over(a.id, fresh) is a
    assert engine.take_over(a.id, busy) is None  # connected again
    engine.advance(10.0)
    assert engine.exclusive[b"k"].session is a and engine.orphans == 0


def test_tokens_strictly_increase_from_the_seed() -> None:
    engine = LockEngine(first_token=1_000)
    a, b = sessions(engine, 2)
    tokens = []
    for _ in range(3):
        engine.acquire(a, b"k", 0.0)
        tokens.append(engine.exclusive[b"k"].token)
        engine.release(a, b"k", 0.0)
        engine.acquire(b, b"j", 0.0)
        tokens.append(engine.exclusive[b"j"].token)
        engine.release(b, b"j", 0.0)
    assert tokens == sorted(set(tokens)) and tokens[0] == 1_000


def test_shared_limit_counts_every_holder_and_queues_fifo() -> None:
    engine = LockEngine()
    a, b, c, d = sessions(engine, 4)
    assert engine.acquire_shared(a, b"s", 0.0) == (True, 1)  # sg: no limit
    assert engine.wait_shared(b, b"s", 0.0, limit=2) == 2
    first = engine.wait_shared(c, b"s", 0.0, limit=2)
    second = engine.wait_shared(d, b"s", 0.0, limit=3)
    assert isinstance(first, Waiter) and isinstance(second, Waiter)
    engine.release_shared(a, b"s", 1.0)
    assert first.granted and first.count == 2
    assert second.granted and second.count == 3  # it fits its own limit of 3
    assert engine.shared_count(b"s") == 3


def test_limited_try_once_does_not_overtake_queued_waiters() -> None:
    engine = LockEngine()
    a, b, c = sessions(engine, 3)
    engine.acquire_shared(a, b"s", 0.0)
    waiter = engine.wait_shared(b, b"s", 0.0, limit=1)
    assert isinstance(waiter, Waiter)
    assert engine.acquire_shared(c, b"s", 0.0, limit=5) == (False, 1)


def test_head_shared_waiter_that_gives_up_lets_the_next_one_in() -> None:
    engine = LockEngine()
    a, b, c = sessions(engine, 3)
    engine.acquire_shared(a, b"s", 0.0)
    strict = engine.wait_shared(b, b"s", 0.0, limit=1)
    roomy = engine.wait_shared(c, b"s", 0.0, limit=2)
    assert isinstance(strict, Waiter) and isinstance(roomy, Waiter)
    assert not roomy.granted  # FIFO: behind the head, even though it would fit
    engine.cancel(strict, 1.0)
    assert roomy.granted and roomy.count == 2


def test_mlock_is_all_or_nothing_without_waiting() -> None:
    engine = LockEngine()
    a, b = sessions(engine, 2)
    engine.acquire(b, b"y", 0.0)
    assert engine.request_many(a, [b"x", b"y", b"z"], 0.0) == [b"y"]
    assert not a.exclusive
    engine.release(b, b"y", 0.0)
    assert engine.request_many(a, [b"x", b"y", b"z"], 0.0) is None
    assert sorted(a.exclusive) == [b"x", b"y", b"z"]


def test_mlock_waiter_frees_what_it_took_when_it_gives_up() -> None:
    engine = LockEngine()
    a, b, c = sessions(engine, 3)
    engine.acquire(b, b"y", 0.0)
    waiter = engine.request_many(a, [b"x", b"y"], 0.0, wait=True)
    assert isinstance(waiter, Waiter) and waiter.taken == [b"x"]
    later = engine.wait_for(c, b"x", 0.0)
    engine.cancel(waiter, 1.0, timed_out=True)
    assert later is not None and later.granted  # what it took went to the next waiter
    assert b"y" in engine.exclusive and not a.exclusive


def test_mlock_in_opposite_orders_cannot_deadlock() -> None:
    engine = LockEngine()
    a, b, owner = sessions(engine, 3)
    engine.acquire(owner, b"x", 0.0)
    engine.acquire(owner, b"y", 0.0)
    first = engine.request_many(a, [b"x", b"y"], 0.0, wait=True)
    second = engine.request_many(b, [b"y", b"x"], 0.0, wait=True)
    assert isinstance(first, Waiter) and isinstance(second, Waiter)
    engine.release(owner, b"y", 1.0)  # the older waiter gets it, not half of each
    engine.release(owner, b"x", 1.0)
    assert first.granted and not second.granted
    engine.release_all(a, 2.0)
    assert second.granted


def test_mlock_waiter_is_not_starved_by_single_key_requests() -> None:
    engine = LockEngine()
    multi, *singles = sessions(engine, 4)
    engine.acquire(singles[0], b"hot", 0.0)
    waiter = engine.request_many(multi, [b"hot", b"cold"], 0.0, wait=True)
    assert isinstance(waiter, Waiter)
    late = engine.wait_for(singles[1], b"hot", 0.0)
    assert not engine.acquire(singles[2], b"hot", 0.0)
    engine.release(singles[0], b"hot", 1.0)
    assert waiter.granted and late is not None and not late.granted


def test_mlock_queues_again_for_a_held_key_whose_lease_ends_while_it_waits() -> None:
    engine = LockEngine()
    a, b = sessions(engine, 2)
    engine.acquire(a, b"mine", 0.0, ttl=1.0)
    engine.acquire(b, b"theirs", 0.0)
    waiter = engine.request_many(a, [b"mine", b"theirs"], 0.0, wait=True, ttl=5.0)
    assert isinstance(waiter, Waiter)
    engine.advance(1.0)  # the lease on "mine" ends; the waiter takes it back at once
    assert engine.exclusive[b"mine"].session is a and not waiter.granted
    engine.release(b, b"theirs", 2.0)
    assert waiter.granted and sorted(a.exclusive) == [b"mine", b"theirs"]
    assert all(h.lease_deadline == 7.0 for h in a.exclusive.values())


def test_hold_limit_refuses_and_changes_nothing() -> None:
    engine = LockEngine(max_holds=2)
    a, b = sessions(engine, 2)
    engine.acquire(a, b"1", 0.0)
    engine.acquire_shared(a, b"2", 0.0)
    with pytest.raises(TooManyHolds):
        engine.acquire(a, b"3", 0.0)
    with pytest.raises(TooManyHolds):
        engine.request_many(a, [b"3", b"4"], 0.0)
    assert sorted(engine.exclusive) == [b"1"] and engine.shared_count(b"2") == 1
    assert engine.acquire(a, b"1", 0.0)  # a repeat adds no hold: allowed
    assert engine.acquire(b, b"3", 0.0)


def test_waiter_limit_per_key() -> None:
    engine = LockEngine(max_waiters=1)
    holder, first, second = sessions(engine, 3)
    engine.acquire(holder, b"k", 0.0)
    assert engine.wait_for(first, b"k", 0.0) is not None
    with pytest.raises(QueueFull):
        engine.wait_for(second, b"k", 0.0)
    assert engine.waiting == 1 and not second.waiters


def test_hold_end_hook_reports_hold_time() -> None:
    ended: list[tuple[bool, float]] = []
    engine = LockEngine(on_hold_end=lambda shared, seconds: ended.append((shared, seconds)))
    (a,) = sessions(engine, 1)
    engine.acquire(a, b"k", 1.0)
    engine.acquire_shared(a, b"s", 2.0)
    engine.release_all(a, 4.5)
    assert sorted(ended) == [(False, 3.5), (True, 2.5)]


def test_a_session_ending_reports_its_hold_times_in_one_batch() -> None:
    batches: list[tuple[bool, list[float]]] = []
    engine = LockEngine(on_holds_end=lambda shared, seconds: batches.append((shared, seconds)))
    a, b = sessions(engine, 2)
    engine.acquire(a, b"x", 1.0)
    engine.acquire(a, b"y", 2.0)
    engine.acquire_shared(a, b"s", 3.0)
    waiter = engine.wait_for(b, b"y", 3.0)
    engine.disconnect(a, 5.0)
    assert sorted((shared, sorted(seconds)) for shared, seconds in batches) == [
        (False, [3.0, 4.0]),
        (True, [2.0]),
    ]
    assert waiter is not None and waiter.granted  # hand-over still happens key by key
    assert engine.orphans == 2 and engine.shared_orphans == 1 and engine.shared_holders == 0


def test_without_a_batch_hook_each_hold_time_is_reported_alone() -> None:
    ended: list[tuple[bool, float]] = []
    engine = LockEngine(on_hold_end=lambda shared, seconds: ended.append((shared, seconds)))
    (a,) = sessions(engine, 1)
    engine.acquire(a, b"x", 1.0)
    engine.acquire_shared(a, b"s", 2.0)
    engine.disconnect(a, 4.0)
    assert sorted(ended) == [(False, 3.0), (True, 2.0)]


def test_mlock_requeued_after_its_lease_ended_keeps_its_place_by_arrival() -> None:
    """Re-queued at the back, the older mlock would hold B while the younger held A,
    each waiting for the other: a deadlock."""
    engine = LockEngine()
    s1, s2, s3 = sessions(engine, 3)
    engine.acquire(s1, b"A", 0.0, ttl=1.0)
    engine.acquire(s3, b"B", 0.0)
    older = engine.request_many(s1, [b"A", b"B"], 0.0, wait=True)
    younger = engine.request_many(s2, [b"A", b"B"], 0.0, wait=True)
    assert isinstance(older, Waiter) and isinstance(younger, Waiter)
    engine.advance(1.0)  # A's lease ends: the older waiter takes it back first
    assert engine.exclusive[b"A"].session is s1
    engine.release(s3, b"B", 2.0)
    assert older.granted and not younger.granted
    engine.release_all(s1, 3.0)
    assert younger.granted


def test_a_single_shared_holder_costs_no_dict() -> None:
    engine = LockEngine()
    a, b = sessions(engine, 2)
    engine.acquire_shared(a, b"s", 0.0)
    assert isinstance(engine.shared[b"s"], Hold)  # 224 bytes of dict saved per key
    assert engine.acquire_shared(b, b"s", 0.0) == (True, 2)
    assert isinstance(engine.shared[b"s"], dict)
    assert engine.release_shared(a, b"s", 1.0) == 1
    assert [h.session for h in engine.shared_holds(b"s")] == [b]
    assert engine.release_shared(b, b"s", 1.0) == 0
    assert b"s" not in engine.shared and engine.shared_holders == 0


def test_an_mlock_holding_one_key_already_is_granted_the_rest_before_older_waiters_of_it() -> None:
    """s0 holds b; s1 waits for b; s0 mlocks a and b and waits for a only. When a comes
    free, s0 has both: it overtook nobody on b, which it held before s1 queued."""
    engine = LockEngine()
    s0, s1, s2 = (engine.open_session(f"s{i}", b"p") for i in range(3))
    assert engine.acquire(s2, b"a", 0.0)
    assert engine.acquire(s0, b"b", 0.0)
    older = engine.wait_for(s1, b"b", 0.0, timeout=10)
    mlock = engine.request_many(s0, [b"a", b"b"], 0.0, wait=True, timeout=10)
    assert isinstance(older, Waiter) and isinstance(mlock, Waiter)
    engine.disconnect(s2, 1.0)
    assert mlock.granted and older.waiting
    assert engine.exclusive[b"a"].session is s0 and engine.exclusive[b"b"].session is s0
    engine.release_all(s0, 2.0)
    assert older.granted
