"""The lock engine against a simple model, driven by Hypothesis.

Random sessions take, wait for, release, renew and give up exclusive, shared and
multi-key locks, disconnect with or without grace, take each other over, and let
time pass. After every step the engine must agree with what the model knows:

* one exclusive holder per key, and the tables of keys and sessions agree;
* a grant made under a limit never finds more holders than that limit;
* waiters get each key in the order they queued for it (exclusive and shared), a
  cancelled waiter is never granted, and a key with waiters is never left free
  (no lost wake-up);
* leases are gone once their deadline has been advanced past; sessions live on
  only while connected, in grace, or owning a lease;
* ``orphans`` counts exactly the plain holds of sessions that ended;
* a request refused by a limit (holds per session, waiters per key) changes nothing.

Time is a plain float the test moves forward, so deadlines are exact.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from elockd.engine.locks import (
    CANCELLED,
    GRANTED,
    WAITING,
    LockEngine,
    QueueFull,
    TooManyHolds,
    Waiter,
)
from elockd.engine.sessions import Hold, Session

KEYS = [b"a", b"b", b"c"]
TTLS = st.sampled_from([None, None, 0.5, 1.0, 2.5])
LIMITS = st.integers(min_value=1, max_value=2)
MAX_HOLDS = 3
MAX_WAITERS = 3

REFUSED = object()  # what a request refused by a limit returns in this test

keys = st.sampled_from(KEYS)
picks = st.integers(min_value=0, max_value=1_000)


class EngineModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.wakes: list[Waiter] = []
        self.engine = LockEngine(max_waiters=MAX_WAITERS, max_holds=MAX_HOLDS)
        self.connected: list[Session] = []
        self.serial = 0
        # The model: per-key queues in the order requests queued, and expected orphans.
        self.xqueue: dict[bytes, list[Waiter]] = {k: [] for k in KEYS}
        self.squeue: dict[bytes, list[Waiter]] = {k: [] for k in KEYS}
        self.orphans = 0
        self.shared_orphans = 0
        for _ in range(3):
            self.open()

    # ------------------------------------------------------------- helpers

    def open(self) -> Session:
        self.serial += 1
        session = self.engine.open_session(f"s{self.serial}", f"10.0.0.1:{self.serial}".encode())
        self.connected.append(session)
        return session

    def idle(self, pick: int) -> Session | None:
        """A connected session with no pending wait: only those send requests."""
        ready = [s for s in self.connected if not s.waiters]
        return ready[pick % len(ready)] if ready else None

    def track(self, waiter: Waiter) -> Waiter:
        def woke() -> None:
            assert waiter.state == GRANTED
            if waiter.shared:
                assert waiter.count == self.engine.shared_count(waiter.keys[0])
                assert waiter.count <= waiter.limit, "a limited grant passed its limit"
            else:
                assert all(k in waiter.session.exclusive for k in waiter.keys)
            self.wakes.append(waiter)

        waiter.wake = woke
        if waiter.shared:
            self.squeue[waiter.keys[0]].append(waiter)
        else:
            # Keys it already holds (before, or taken at once because they were free)
            # are not queued for; the rest are, behind everyone already queued.
            for key in waiter.keys:
                if key not in waiter.session.exclusive:
                    self.xqueue[key].append(waiter)
        return waiter

    def state(self) -> Any:
        """Everything a refused request must leave alone."""
        return (
            {k: h.session.id for k, h in self.engine.exclusive.items()},
            {
                k: sorted(h.session.id for h in self.engine.shared_holds(k))
                for k in self.engine.shared
            },
            self.engine.waiting,
            self.engine.leases,
            {k: list(q) for k, q in self.engine._xqueues.items()},
            {k: list(q) for k, q in self.engine._squeues.items()},
        )

    def refused_cleanly(self, call: Any) -> Any:
        before = self.state()
        try:
            return call()
        except (TooManyHolds, QueueFull):
            assert self.state() == before, "a refused request changed the tables"
            return REFUSED

    # --------------------------------------------------------------- rules

    @rule()
    def connect(self) -> None:
        if len(self.connected) < 5:
            self.open()

    @rule(pick=picks, key=keys, ttl=TTLS)
    def try_lock(self, pick: int, key: bytes, ttl: float | None) -> None:
        session = self.idle(pick)
        if session is None:
            return
        holder = self.engine.exclusive.get(key)
        got = self.refused_cleanly(lambda: self.engine.acquire(session, key, self.now, ttl))
        if got is not REFUSED:
            assert got == (holder is None or holder.session is session)
            if got:
                assert self.engine.exclusive[key].session is session

    @rule(pick=picks, key=keys, ttl=TTLS)
    def wait_lock(self, pick: int, key: bytes, ttl: float | None) -> None:
        session = self.idle(pick)
        if session is None:
            return
        result = self.refused_cleanly(lambda: self.engine.wait_for(session, key, self.now, ttl))
        if isinstance(result, Waiter):
            self.track(result)

    @rule(pick=picks, key=keys)
    def unlock(self, pick: int, key: bytes) -> None:
        session = self.idle(pick)
        if session is None:
            return
        held = key in session.exclusive
        assert self.engine.release(session, key, self.now) == held

    @rule(pick=picks, key=keys, limit=st.none() | LIMITS, ttl=TTLS)
    def try_shared(self, pick: int, key: bytes, limit: int | None, ttl: float | None) -> None:
        session = self.idle(pick)
        if session is None:
            return
        before = self.engine.shared_count(key)
        mine = key in session.shared

        def call() -> tuple[bool, int]:
            return self.engine.acquire_shared(session, key, self.now, limit=limit, ttl=ttl)

        result = self.refused_cleanly(call)
        if result is REFUSED:
            return
        granted, count = result
        if mine:
            assert granted and count == before
        elif limit is None:
            assert granted and count == before + 1
        elif granted:
            assert count <= limit and count == before + 1
            queued = [w for w in self.squeue[key] if w.state == WAITING]
            assert not queued, "a try-once shared request overtook queued waiters"
        else:
            assert count == before

    @rule(pick=picks, key=keys, limit=LIMITS, ttl=TTLS)
    def wait_shared(self, pick: int, key: bytes, limit: int, ttl: float | None) -> None:
        session = self.idle(pick)
        if session is None:
            return
        result = self.refused_cleanly(
            lambda: self.engine.wait_shared(session, key, self.now, limit=limit, ttl=ttl)
        )
        if isinstance(result, Waiter):
            self.track(result)
        elif result is not REFUSED:
            assert result <= limit or key in session.shared

    @rule(pick=picks, key=keys)
    def unlock_shared(self, pick: int, key: bytes) -> None:
        session = self.idle(pick)
        if session is None:
            return
        held = key in session.shared
        left = self.engine.release_shared(session, key, self.now)
        assert (left is not None) == held

    @rule(pick=picks, wanted=st.lists(keys, min_size=1, max_size=3), wait=st.booleans())
    def mlock(self, pick: int, wanted: list[bytes], wait: bool) -> None:
        session = self.idle(pick)
        if session is None:
            return
        others = [k for k in wanted if k in self.engine.exclusive and k not in session.exclusive]
        result = self.refused_cleanly(
            lambda: self.engine.request_many(session, wanted, self.now, wait=wait)
        )
        if result is REFUSED:
            return
        if result is None:
            assert not others and all(k in session.exclusive for k in wanted)
        elif isinstance(result, Waiter):
            assert others
            self.track(result)
        else:
            assert sorted(set(result)) == sorted(set(others))
            assert all(k not in session.exclusive for k in others)

    @rule(pick=picks, key=keys, ttl=st.sampled_from([0.5, 1.0, 2.5]))
    def renew(self, pick: int, key: bytes, ttl: float) -> None:
        session = self.idle(pick)
        if session is None:
            return
        held = key in session.exclusive or key in session.shared
        assert self.engine.renew(session, key, self.now, ttl) == held

    @rule(pick=picks)
    def unlock_all(self, pick: int) -> None:
        session = self.idle(pick)
        if session is None:
            return
        self.engine.release_all(session, self.now)
        assert not session.exclusive and not session.shared

    @rule(pick=picks, timed_out=st.booleans())
    def give_up(self, pick: int, timed_out: bool) -> None:
        """A wait times out (409) or is abandoned."""
        waiting = [w for s in self.connected for w in s.waiters]
        if not waiting:
            return
        waiter = sorted(waiting, key=lambda w: w.since)[pick % len(waiting)]
        timeouts = self.engine.timeouts
        self.engine.cancel(waiter, self.now, timed_out=timed_out)
        assert waiter.state == CANCELLED
        assert self.engine.timeouts == timeouts + timed_out
        if not waiter.shared:
            for key in waiter.taken:
                assert key not in waiter.session.exclusive, "gave up but kept a key"

    @rule(pick=picks, grace=st.sampled_from([0.0, 0.0, 1.0, 3.0]))
    def disconnect(self, pick: int, grace: float) -> None:
        if not self.connected:
            return
        session = self.connected.pop(pick % len(self.connected))
        session.grace = grace
        taken = {k for w in session.waiters for k in w.taken}
        if grace == 0:
            self.count_orphans(session, exclude=taken)
        waiters = list(session.waiters)
        self.engine.disconnect(session, self.now)
        assert all(w.state == CANCELLED for w in waiters)
        if grace == 0:
            assert all(h.lease_deadline is not None for h in session.exclusive.values())
            assert all(h.lease_deadline is not None for h in session.shared.values())

    @rule(pick=picks)
    def take_over(self, pick: int) -> None:
        gone = sorted(
            (s for s in self.engine.sessions.values() if not s.connected), key=lambda s: s.id
        )
        if not gone or len(self.connected) >= 6:
            return
        fresh = self.open()
        target = gone[pick % len(gone)]
        assert self.engine.take_over(target.id, fresh) is target
        self.connected.remove(fresh)
        self.connected.append(target)
        assert fresh.id not in self.engine.sessions and target.connected

    @rule(pick=picks)
    def take_over_refused(self, pick: int) -> None:
        """A connected session, or an unknown id, cannot be taken over."""
        session = self.idle(pick)
        if session is None or len(self.connected) < 2:
            return
        other = next(s for s in self.connected if s is not session)
        assert self.engine.take_over(other.id, session) is None
        assert self.engine.take_over("no-such-session", session) is None

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        for session in self.engine.sessions.values():
            deadline = session.grace_deadline
            if not session.connected and deadline is not None and deadline <= self.now:
                self.count_orphans(session, exclude=set())
        held_while_waiting = [
            (w, k, s.exclusive[k])
            for s in self.connected
            for w in s.waiters
            if not w.shared
            for k in w.keys
            if k in s.exclusive
        ]
        self.engine.advance(self.now)
        for waiter, key, hold in held_while_waiting:
            if waiter.session.exclusive.get(key) is not hold:  # its lease ended: it queues again
                queue = self.xqueue[key]  # in its place by arrival
                queue.append(waiter)
                queue.sort(key=lambda w: w.serial)
        for hold in self.all_holds():
            assert hold.lease_deadline is None or hold.lease_deadline > self.now
        next_deadline = self.engine.next_deadline()
        assert next_deadline is None or next_deadline > self.now

    def count_orphans(self, session: Session, exclude: set[bytes]) -> None:
        self.orphans += sum(
            h.lease_deadline is None and k not in exclude for k, h in session.exclusive.items()
        )
        self.shared_orphans += sum(h.lease_deadline is None for h in session.shared.values())

    # ---------------------------------------------------------- invariants

    def all_holds(self) -> list[Any]:
        holds = list(self.engine.exclusive.values())
        holds += list(self.engine.shared_holds())
        return holds

    @invariant()
    def tables_agree(self) -> None:
        engine = self.engine
        for key, hold in engine.exclusive.items():
            assert hold.key == key and not hold.shared
            assert hold.session.exclusive[key] is hold
            assert engine.sessions[hold.session.id] is hold.session
        for key, entry in engine.shared.items():
            holders = list(engine.shared_holds(key))
            assert holders, "an empty shared entry was left behind"
            assert isinstance(entry, Hold | dict), "a Hold or a dict"
            assert engine.shared_count(key) == len(holders)
            for hold in holders:
                session = hold.session
                assert hold.shared and session.shared[key] is hold
                assert engine.sessions[session.id] is session
        for session in engine.sessions.values():
            for key, hold in session.exclusive.items():
                assert engine.exclusive[key] is hold
            for key, hold in session.shared.items():
                assert hold in engine.shared_holds(key)
            if not session.connected:
                assert session.grace_deadline is not None or session.leases > 0
                assert not session.waiters
        assert engine.leases == sum(h.lease_deadline is not None for h in self.all_holds())
        assert engine.waiting == sum(len(s.waiters) for s in engine.sessions.values())
        assert all(s.connected for s in self.connected)

    @invariant()
    def exclusive_waiters_in_order(self) -> None:
        for key, queue in self.xqueue.items():
            queue[:] = [w for w in queue if w.state != CANCELLED]
            while queue and (key in queue[0].taken or queue[0].state == GRANTED):
                queue.pop(0)
            for waiter in queue:
                assert key not in waiter.taken, "a waiter got a key out of turn"
                assert waiter.state == WAITING
            if queue:
                assert key in self.engine.exclusive, "a key with waiters was left free"

    @invariant()
    def mlock_waiters_never_wait_on_each_other_in_a_cycle(self) -> None:
        """What mlock promises: no two waiters each hold (as taken keys) what the
        other waits for, directly or around a cycle. Cycles through plain holds are
        the client's own hold-and-wait and are not the engine's to prevent."""
        waiting = [w for s in self.engine.sessions.values() for w in s.waiters if not w.shared]
        taken_by = {key: w for w in waiting for key in w.taken}
        blocked_on = {
            w: {
                taken_by[key]
                for key in w.keys
                if key not in w.session.exclusive and key in taken_by
            }
            for w in waiting
        }
        for start in waiting:  # depth-first walk; the graphs here have a handful of nodes
            stack, seen = [start], set()
            while stack:
                for nxt in blocked_on[stack.pop()]:
                    assert nxt is not start, "mlock waiters wait on each other in a cycle"
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)

    @invariant()
    def shared_waiters_in_order(self) -> None:
        for key, queue in self.squeue.items():
            queue[:] = [w for w in queue if w.state != CANCELLED]
            while queue and queue[0].state == GRANTED:
                queue.pop(0)
            assert all(w.state == WAITING for w in queue), "a shared waiter got in out of turn"
            if queue:
                assert self.engine.shared_count(key) >= queue[0].limit, "a fitting head waits"

    @invariant()
    def granted_waiters_hold_everything(self) -> None:
        for waiter in self.wakes:
            assert waiter.state == GRANTED
        self.wakes.clear()

    @invariant()
    def the_ls_index_holds_every_live_key_once(self) -> None:
        """elockd.engine.keyindex: the ordered keys are the live ones and the ones
        noted stale, each once."""
        index = self.engine.index
        live = set(self.engine.exclusive) | set(self.engine.shared)
        ordered = list(index.ordered)
        assert len(ordered) == len(set(ordered)), ordered
        assert set(ordered) == live | set(index.stale)

    @invariant()
    def orphans_counted(self) -> None:
        assert self.engine.orphans == self.orphans
        assert self.engine.shared_orphans == self.shared_orphans


EngineModel.TestCase.settings = settings(
    max_examples=800, stateful_step_count=40, deadline=None, print_blob=True
)
TestEngineModel = EngineModel.TestCase
