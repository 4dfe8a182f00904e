"""A waiter whose wait ends at the very instant of its turn is admitted, whatever
order the deadline heap had the two entries in (elockd/engine/throttles.py: a
timeout first serves the line).

``wait=S`` with S equal to the ``retry`` the line promised should be admitted: the
request was queued because ``retry ≤ wait``. It is when the head's turn was set
before the waiter's timeout (the head was first in line when it came), and it is
not when the head became the head later (its turn then set after the waiter's
timeout): the timeout runs first and the waiter leaves the line just before the
serve that would have admitted it.
"""

from __future__ import annotations

from elockd.engine.gcra import Rate
from elockd.engine.locks import LockEngine
from elockd.engine.sessions import CANCELLED, GRANTED
from elockd.engine.throttles import ThrottleWaiter

ONE_PER_SECOND = Rate(1, 1.0, 1)


def test_a_waiter_whose_wait_ends_on_its_turn_is_admitted() -> None:
    engine = LockEngine()
    throttles = engine.throttles
    spender, first, second, third = (engine.open_session(f"s{n}", b"p") for n in range(4))
    assert throttles.request(spender, b"k", 0.0, ONE_PER_SECOND, 0).admitted  # type: ignore[union-attr]
    head = throttles.request(first, b"k", 0.0, ONE_PER_SECOND, 10)  # turn at 1
    after = throttles.request(second, b"k", 0.0, ONE_PER_SECOND, 10)  # turn at 2, set at 1
    # A burst of 2: it fits right after ``after``, at 2, and is told so.
    roomy = throttles._behind(throttles.lines[b"k"], throttles.tats[b"k"], 0.0, Rate(1, 1.0, 2))
    assert roomy.retry == 2.0
    last = throttles.request(third, b"k", 0.0, Rate(1, 1.0, 2), 2.0)  # waits: retry ≤ wait
    assert all(isinstance(w, ThrottleWaiter) for w in (head, after, last))
    engine.advance(1.0)
    engine.advance(2.0)
    assert isinstance(after, ThrottleWaiter) and after.state == GRANTED
    assert isinstance(last, ThrottleWaiter)
    assert last.state == GRANTED, "timed out at its turn" if last.state == CANCELLED else last


def test_compacting_the_heap_keeps_a_heads_turn_and_its_timeout() -> None:
    """A line's head has two deadlines at once; compaction keeps one entry per target
    and deadline, so neither is lost (the timeout must still fire after a re-arm)."""
    engine = LockEngine()
    throttles = engine.throttles
    spender, first = engine.open_session("s", b"p"), engine.open_session("f", b"p")
    assert throttles.request(spender, b"k", 0.0, ONE_PER_SECOND, 0).admitted  # type: ignore[union-attr]
    head = throttles.request(first, b"k", 0.0, ONE_PER_SECOND, 5)
    assert isinstance(head, ThrottleWaiter)
    engine._deadlines.compact()
    kept = sorted(deadline for deadline, _, target in engine._deadlines._heap if target is head)
    assert kept == [head.admit, head.deadline] and head.admit < head.deadline == 5.0


def test_a_key_lapsed_but_not_swept_yet_makes_room_at_max_throttles() -> None:
    """Lapsed keys are swept on grain boundaries; one lapsed since is no state, and
    must not keep a new key out at --max-throttles."""
    engine = LockEngine(max_throttles=2)
    throttles, session = engine.throttles, engine.open_session("s", b"p")
    half_second = Rate(2, 1.0, 1)
    for key in (b"a", b"b"):
        assert throttles.request(session, key, 0.0, half_second, 0).admitted  # type: ignore[union-attr]
    engine.advance(0.6)  # both lapsed at 0.5; their sweep comes at 1.0
    assert len(throttles) == 2
    assert throttles.request(session, b"c", 0.6, half_second, 0).admitted  # type: ignore[union-attr]
    assert sorted(throttles.tats) == [b"c"]  # both lapsed keys were dropped for it
