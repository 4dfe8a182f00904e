"""A Hypothesis state machine for the engine's bounded slices.

The model test (test_engine_model.py) checks every rule against a model with frees
that happen at once. This one runs the engine with slices of a single hold, a cap of
two sessions without a connection, and waits that time out through the engine, so that
requests interleave with half-freed crowds, and checks what must hold at every step:
the tables agree, no key has two holders, queues are FIFO and hold only live waiters,
a session the engine is still freeing can never be taken over, the count of sessions
without a connection is exact and bounded, and one full advance finishes every free.
"""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from elockd.engine.locks import GRANTED, WAITING, LockEngine, TooManyHolds, Waiter
from elockd.engine.sessions import Session

keys = st.sampled_from([b"a", b"b", b"c"])
picks = st.integers(min_value=0, max_value=50)
MAX_SESSIONS = 2


class SliceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = LockEngine(free_slice=1, max_sessions=MAX_SESSIONS, max_holds=3)
        self.now = 0.0
        self.ids = itertools.count()
        self.connected: list[Session] = []
        self.grants: dict[bytes, list[int]] = {}  # key -> serials of waiters granted it

    def open(self) -> Session:
        session = self.engine.open_session(f"s{next(self.ids)}", b"peer")
        self.connected.append(session)
        return session

    def pick(self, pick: int) -> Session | None:
        return self.connected[pick % len(self.connected)] if self.connected else None

    def watch(self, waiter: Waiter) -> None:
        def woke() -> None:
            if waiter.state == GRANTED:
                # The keys it was handed while it waited: an mlock whose session held
                # one of its keys already overtakes nobody there.
                for key in waiter.taken if not waiter.shared else waiter.keys:
                    older = [
                        w for w in self.engine._xqueues.get(key, ()) if w.serial < waiter.serial
                    ]
                    assert not older, "a waiter was granted ahead of an older one"
                    self.grants.setdefault(key, []).append(waiter.serial)

        waiter.wake = woke

    @rule()
    def connect(self) -> None:
        if len(self.connected) < 5:
            self.open()

    @rule(pick=picks, key=keys, ttl=st.none() | st.just(1.5))
    def acquire(self, pick: int, key: bytes, ttl: float | None) -> None:
        session = self.pick(pick)
        if session is not None and not session.waiters:
            with contextlib.suppress(TooManyHolds):
                self.engine.acquire(session, key, self.now, ttl)

    @rule(pick=picks, key=keys, timeout=st.sampled_from([0.5, 1.0, 3.0]))
    def wait(self, pick: int, key: bytes, timeout: float) -> None:
        session = self.pick(pick)
        if session is None or session.waiters:
            return
        try:
            waiter = self.engine.wait_for(session, key, self.now, timeout=timeout)
        except TooManyHolds:
            return
        if waiter is not None:
            self.watch(waiter)

    @rule(pick=picks, wanted=st.lists(keys, min_size=2, max_size=3, unique=True))
    def mlock(self, pick: int, wanted: list[bytes]) -> None:
        session = self.pick(pick)
        if session is None or session.waiters:
            return
        try:
            result = self.engine.request_many(session, wanted, self.now, wait=True, timeout=2.0)
        except TooManyHolds:
            return
        if isinstance(result, Waiter) and result.state == WAITING:
            self.watch(result)

    @rule(pick=picks, key=keys)
    def release(self, pick: int, key: bytes) -> None:
        session = self.pick(pick)
        if session is not None:
            self.engine.release(session, key, self.now)

    @rule(pick=picks, grace=st.sampled_from([0.0, 0.0, 1.0]))
    def disconnect(self, pick: int, grace: float) -> None:
        session = self.pick(pick)
        if session is None:
            return
        self.connected.remove(session)
        session.grace = grace
        self.engine.disconnect(session, self.now)
        assert not session.waiters

    @rule(pick=picks)
    def take_over(self, pick: int) -> None:
        gone = sorted(
            (s for s in self.engine.sessions.values() if not s.connected), key=lambda s: s.id
        )
        if not gone:
            return
        target = gone[pick % len(gone)]
        fresh = self.open()
        taken = self.engine.take_over(target.id, fresh)
        if target.ending:
            assert taken is None, "a session whose holds are being freed was taken over"
        if taken is not None:
            self.connected.remove(fresh)
            self.connected.append(taken)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0]), budget=st.sampled_from([1, 2, None]))
    def advance(self, dt: float, budget: int | None) -> None:
        self.now += dt
        more = self.engine.advance(self.now, budget)
        if budget is None:
            assert not more and not self.engine._ending

    @invariant()
    def tables_agree(self) -> None:
        engine = self.engine
        for key, hold in engine.exclusive.items():
            assert hold.key == key and hold.session.exclusive.get(key) is hold
            assert hold.session.id in engine.sessions
        for session in engine.sessions.values():
            for key, hold in session.exclusive.items():
                assert engine.exclusive[key] is hold
            assert not (session.connected and session.ending)
            for waiter in session.waiters:
                assert waiter.state == WAITING and session.connected

    @invariant()
    def queues_hold_live_waiters_of_held_keys(self) -> None:
        for key, queue in self.engine._xqueues.items():
            assert queue and key in self.engine.exclusive, "a free key with a queue"
            serials = [w.serial for w in queue]
            assert serials == sorted(serials), "a queue out of arrival order"
            assert all(w.state == WAITING for w in queue)
        assert self.engine.waiting == sum(len(s.waiters) for s in self.engine.sessions.values())

    @invariant()
    def grants_follow_arrival(self) -> None:
        for serials in self.grants.values():
            assert serials == sorted(serials), "a later waiter was served first"

    @invariant()
    def sessions_without_a_connection_are_counted_and_bounded(self) -> None:
        engine = self.engine
        detached = [s for s in engine.sessions.values() if not s.connected]
        assert engine.detached == len(detached)
        lingering = [s for s in detached if not s.ending]  # in grace or owning leases
        assert len(lingering) <= MAX_SESSIONS


SliceMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_slices = SliceMachine.TestCase
