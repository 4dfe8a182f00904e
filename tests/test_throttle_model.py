"""The throttle table against what the GCRA promises, driven by Hypothesis.

Random sessions ask random keys at each key's rate with random costs, peek, wait
in line or not, disconnect, and let time pass. The test keeps a log of every
admission (when, which key, what cost) and a model of each key's line, and checks
after every step:

* **the window bound**: over any window of length W, a key admits at most
  ``B + W·COUNT/PERIOD`` units of cost;
* **first come, first served**: a key's waiters are admitted in the order they
  queued, whatever their cost, and none whose turn came after its wait ran out;
* **as soon as the rate allows**: after time has been advanced, the head of no
  line could be admitted now (a line never stalls), and no waiter is left past
  its deadline;
* **a peek changes nothing**: the table's TATs and lines are the same after it;
* the books agree: ``waiting`` is the sum of the lines, every waiting session's
  waits are known, and a lapsed key has no state once time passed the grain after
  it (``LAPSE_GRAIN``).

Time is a plain float the test moves forward, so every turn and timeout is exact.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from elockd.engine.bookkeeping import QueueFull
from elockd.engine.gcra import EPSILON, Rate, Verdict, judge
from elockd.engine.locks import LockEngine
from elockd.engine.sessions import Session
from elockd.engine.throttles import ThrottleWaiter, lapse_time

#: Each key's (COUNT, PERIOD, BURST): the window bound is stated per rate.
RATES = {b"a": (2, 1.0, 3), b"b": (1, 0.5, 1), b"c": (5, 2.0, 5)}
KEYS = sorted(RATES)

keys = st.sampled_from(KEYS)
picks = st.integers(min_value=0, max_value=1_000)
waits = st.sampled_from([0.0, 0.0, 0.3, 1.0, 4.0])
steps = st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.5, 1.0, 3.0])


class ThrottleModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.engine = LockEngine(max_waiters=4)
        self.table = self.engine.throttles
        self.sessions = [self.engine.open_session(str(i), b"p%d" % i) for i in range(3)]
        # (time, key, cost) of every admission with a cost.
        self.admissions: list[tuple[float, bytes, int]] = []
        # The model's lines: waiters in the order they queued.
        self.lines: dict[bytes, list[ThrottleWaiter]] = {k: [] for k in KEYS}

    def rate(self, key: bytes, cost: int) -> Rate:
        count, period, burst = RATES[key]
        return Rate(count, period, burst, min(cost, burst))

    def watch(self, waiter: ThrottleWaiter) -> None:
        """Log the waiter's admission when the table wakes it (at the model's now)."""

        def woke() -> None:
            assert waiter.verdict is not None
            if waiter.verdict.admitted:
                line = self.lines[waiter.key]
                assert line and line[0] is waiter, "admitted out of turn"
                assert waiter.admit <= waiter.deadline + EPSILON, "its turn came after its wait"
                assert waiter.admit <= self.now + EPSILON, "admitted before its turn"
                self.admissions.append((self.now, waiter.key, waiter.rate.cost))
            self.lines[waiter.key].remove(waiter)

        waiter.wake = woke

    def snapshot(self) -> tuple[dict[bytes, float], dict[bytes, list[ThrottleWaiter]]]:
        return dict(self.table.tats), {k: list(v) for k, v in self.table.lines.items()}

    @rule(pick=picks, key=keys, cost=st.integers(min_value=0, max_value=5), wait=waits)
    def ask(self, pick: int, key: bytes, cost: int, wait: float) -> None:
        session = self.sessions[pick % len(self.sessions)]
        if not session.connected:
            return
        rate = self.rate(key, cost)
        before = self.snapshot()
        try:
            got = self.table.request(session, key, self.now, rate, wait)
        except QueueFull:  # a limit: nothing may have changed
            assert len(self.lines[key]) == 4
            assert self.snapshot() == before
            return
        if isinstance(got, Verdict):
            if got.admitted and rate.cost:
                assert not self.lines[key], "a request overtook a line"
                self.admissions.append((self.now, key, rate.cost))
            elif rate.cost == 0:
                assert got.admitted
                assert self.snapshot() == before, "a peek changed the table"
            else:
                assert not got.admitted and got.retry > 0
                assert wait == 0 or got.retry > wait  # refused at once: it cannot make it
            return
        assert wait > 0 and rate.cost > 0
        self.lines[key].append(got)
        self.watch(got)

    @rule(pick=picks)
    def disconnect(self, pick: int) -> None:
        session = self.sessions[pick % len(self.sessions)]
        if session.connected:
            self.engine.disconnect(session, self.now)
            assert session not in self.table.by_session
            for line in self.lines.values():
                assert all(w.session is not session for w in line)
            self.sessions[self.sessions.index(session)] = self.engine.open_session(
                f"{id(session)}-{self.now}", b"new"
            )

    @rule(step=steps)
    def advance(self, step: float) -> None:
        self.now += step
        while self.engine.advance(self.now, budget=7):
            pass
        for key, line in self.lines.items():
            for waiter in line:
                assert waiter.deadline > self.now, "a wait past its deadline is still waiting"
            if line:  # the head cannot be admitted yet: no line stalls
                head = line[0]
                verdict, _ = judge(self.table.tats.get(key, float("-inf")), self.now, head.rate)
                assert not verdict.admitted, "a head that fits was left waiting"
        for key, tat in self.table.tats.items():  # dropped at the grain after it lapsed
            kept = tat > self.now or self.table.lines.get(key) or lapse_time(tat) > self.now
            assert kept, "a lapsed key kept its state past its grain"

    @invariant()
    def within_the_window_bound(self) -> None:
        for key in KEYS:
            count, period, burst = RATES[key]
            times = [(t, c) for t, k, c in self.admissions if k == key]
            for i, (start, _) in enumerate(times):
                total = 0
                for end, cost in times[i:]:
                    total += cost
                    assert total <= burst + (end - start) * count / period + 1e-6, (key, times)

    @invariant()
    def lines_agree(self) -> None:
        table_lines = {k: list(v) for k, v in self.table.lines.items()}
        assert table_lines == {k: v for k, v in self.lines.items() if v}
        assert self.table.waiting == sum(len(v) for v in self.lines.values())
        by_session: dict[Session, set[ThrottleWaiter]] = {}
        for line in self.lines.values():
            for waiter in line:
                by_session.setdefault(waiter.session, set()).add(waiter)
        assert {k: set(v) for k, v in self.table.by_session.items()} == by_session


ThrottleModel.TestCase.settings = settings(
    max_examples=600, stateful_step_count=50, deadline=None, print_blob=True
)
TestThrottleModel = ThrottleModel.TestCase
