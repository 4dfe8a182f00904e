"""The cluster's throttle rule (:mod:`elockd.backend.cluster.throttle_book`), checked
on random schedules of requests, costs, peeks, waits and timeouts.

The model is the cluster as etcd sees it: one TAT and one line per key, every
request judged on the state its transaction meets (:func:`judge_in_line`), only the
head of the line admitted, at its turn (:func:`head_turn`), a waiter that runs
out leaving the line. Over any window of length W the key admits at most
``B + W·COUNT/PERIOD`` units; waiters are admitted in arrival order; a peek
changes nothing; a waiter is admitted no later than the ``retry`` it was told
when it joined the line (everyone ahead was counted, nobody behind can pass)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from elockd.backend.cluster.throttle_book import NO_TAT, behind, head_turn, judge_in_line
from elockd.engine.gcra import EPSILON, Rate


@dataclass
class Waiter:
    number: int
    rate: Rate
    arrived: float
    deadline: float
    promised: float  # when it should be admitted at the latest (arrival + retry)


class Key:
    """One key, as etcd holds it, with the times admissions happened."""

    def __init__(self) -> None:
        self.tat = NO_TAT
        self.line: list[Waiter] = []
        self.admitted: list[tuple[float, int]] = []  # (time, cost)
        self.waiter_order: list[int] = []  # waiters by admission

    def run_until(self, until: float) -> None:
        """Admit heads at their turns and drop waiters at their deadlines, in time
        order, up to ``until``."""
        while self.line:
            head = self.line[0]
            _, _, due = head_turn(self.tat, -1e18, head.rate)  # its turn on the TAT
            first_deadline = min(w.deadline for w in self.line)
            when = min(due, first_deadline)
            if when > until:
                return
            if due <= first_deadline and due <= head.deadline:
                verdict, after, _ = head_turn(self.tat, due, head.rate)
                assert verdict is not None and verdict.admitted
                self.tat = after
                self.admitted.append((due, head.rate.cost))
                self.waiter_order.append(head.number)
                assert due <= head.promised + 1e-6
                self.line.pop(0)
            else:
                self.line = [w for w in self.line if w.deadline > first_deadline]

    def ask(self, now: float, rate: Rate, wait: float, number: int) -> None:
        self.run_until(now)
        ahead = [(w.rate.cost * w.rate.interval, w.rate.capacity) for w in self.line]
        before = self.tat
        verdict, after = judge_in_line(self.tat, now, rate, ahead)
        if rate.cost == 0:
            assert self.tat == before  # a peek changes nothing
            return
        if verdict.admitted:
            assert not self.line  # never past a waiter
            self.tat = after
            self.admitted.append((now, rate.cost))
            return
        assert self.tat == before
        mine = behind(self.tat, now, rate, ahead)
        assert mine.retry == verdict.retry or not self.line
        if wait > 0 and verdict.retry <= wait:
            self.line.append(Waiter(number, rate, now, now + wait, now + verdict.retry))


steps = st.lists(
    st.tuples(
        st.floats(0, 1.5),  # time since the last request
        st.integers(0, 5),  # cost (0: a peek)
        st.sampled_from([0.0, 0.0, 0.3, 1.0, 3.0]),  # wait
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    calls=st.integers(1, 20),
    period=st.sampled_from([0.5, 1.0, 2.0]),
    burst=st.integers(5, 8),
    schedule=steps,
)
def test_window_bound_fifo_and_promises(
    calls: int, period: float, burst: int, schedule: list[tuple[float, int, float]]
) -> None:
    key = Key()
    now = 0.0
    numbers: list[int] = []
    for number, (gap, cost, wait) in enumerate(schedule):
        now += gap
        key.ask(now, Rate(calls, period, burst, cost), wait, number)
        if cost and wait:
            numbers.append(number)
    key.run_until(now + 100)
    # FIFO: waiters admitted in the order they joined.
    assert key.waiter_order == sorted(key.waiter_order)
    # The window bound, over every window between two admissions.
    times = key.admitted
    for i, (start, _) in enumerate(times):
        units = 0
        for end, cost in times[i:]:
            units += cost
            assert units <= burst + (end - start) * calls / period + EPSILON * 10, (start, end)
