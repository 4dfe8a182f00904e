"""The rule that passes over a throttle line's silent head
(:mod:`elockd.engine.line_grace`), on its own and in a model of a key on a cluster.

The model is a key as etcd holds it (TAT, the wall time of the write that set it,
the line) with waiters whose node takes their turn at once (live) or never
(silent: cut from etcd). A live waiter behind silent heads, or a newcomer, passes
them over by the rule. Checked: over any window of length W the key admits at
most ``B + W·COUNT/PERIOD`` units (passing admits nobody); a live head is never
passed over; a live waiter is admitted no later than the ``retry`` it was told when
it joined plus one grace per silent head ahead of it; waiters are admitted in
arrival order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

from hypothesis import given, settings
from hypothesis import strategies as st

from elockd.backend.cluster.layout import parse_tat_value, tat_value
from elockd.backend.cluster.throttle_book import NO_TAT, behind, head_turn, judge_in_line
from elockd.engine.gcra import EPSILON, Rate
from elockd.engine.line_grace import passed_entries, passed_over, turn

GRACE = 1.0
RATE = Rate(2, 1.0, 1, 1)  # 0.5 s a unit, burst 1
UNITS, CAPACITY = RATE.cost * RATE.interval, RATE.capacity
STEP = (UNITS, CAPACITY)


def test_a_head_is_passed_over_only_after_its_turn_and_the_grace() -> None:
    # TAT 10.0: the head's turn is 10.0 (one unit of 0.5 s, burst 1).
    assert turn(10.0, NO_TAT, UNITS, CAPACITY) == 10.0
    assert passed_over(10.0, NO_TAT, 11.0, GRACE, [STEP], 16) == (0, 11.0)
    assert passed_over(10.0, NO_TAT, 11.0001, GRACE, [STEP], 16) == (1, math.inf)


def test_each_next_head_gets_its_own_grace_from_when_it_became_the_head() -> None:
    line = [STEP, STEP, STEP]
    # The second became the head at 11.0 (the first was passed over then), so it is
    # passed over after 12.0, the third after 13.0: a grace each, not one for all.
    assert passed_over(10.0, NO_TAT, 11.5, GRACE, line, 16) == (1, 12.0)
    assert passed_over(10.0, NO_TAT, 12.5, GRACE, line, 16) == (2, 13.0)
    assert passed_over(10.0, NO_TAT, 99.0, GRACE, line, 16) == (3, math.inf)
    assert passed_over(10.0, NO_TAT, 99.0, GRACE, line, 2) == (2, math.inf)


def test_a_head_became_the_head_no_earlier_than_the_write_of_the_tat() -> None:
    # Its GCRA turn was long ago, but the TAT was written at 50 (the one ahead of it
    # was admitted, or passed over, then): its grace runs from 50.
    assert passed_over(10.0, 50.0, 50.9, GRACE, [STEP], 16) == (0, 51.0)
    assert passed_over(10.0, 50.0, 51.1, GRACE, [STEP], 16) == (1, math.inf)


def test_passing_a_head_passes_the_later_entries_of_its_node() -> None:
    heads = [(b"w1", 1, "a"), (b"w2", 2, "b"), (b"w3", 3, "a"), (b"w4", 4, "c"), (b"w5", 5, "a")]
    assert passed_entries(heads, 0) == ()
    assert passed_entries(heads, 1) == ((b"w1", 1, "a"), (b"w3", 3, "a"), (b"w5", 5, "a"))
    assert passed_entries(heads, 2) == (*heads[:3], (b"w5", 5, "a"))


def test_a_tats_value_carries_when_it_was_written_and_reads_without_it() -> None:
    assert parse_tat_value(tat_value(12.5, "n1", 10.25)) == (12.5, "n1", 10.25)
    # A value written before the field existed: no time, so only the GCRA turn counts.
    assert parse_tat_value(tat_value(12.5, "n1")) == (12.5, "n1", NO_TAT)
    assert parse_tat_value(b"12.5 n1 soon") == (math.inf, "", NO_TAT)  # refuses: safe


def test_no_tat_passes_nobody() -> None:
    assert passed_over(NO_TAT, NO_TAT, 1e9, GRACE, [STEP, STEP], 16) == (0, math.inf)


@settings(max_examples=300, deadline=None)
@given(
    tat=st.floats(0, 100),
    since=st.floats(0, 100),
    grace=st.floats(0.01, 3),
    later=st.floats(0, 50),
    now=st.floats(0, 200),
    length=st.integers(0, 6),
)
def test_passing_is_monotone_and_each_head_costs_a_grace(
    tat: float, since: float, grace: float, later: float, now: float, length: int
) -> None:
    line = [STEP] * length
    count, due = passed_over(tat, since, now, grace, line, 16)
    later_count, _ = passed_over(tat, since, now + later, grace, line, 16)
    assert later_count >= count  # once passed over, passed over for good
    if count:
        first = turn(tat, since, UNITS, CAPACITY)
        assert now > first + count * grace - 1e-9  # never sooner than a grace each
    if count < length:
        assert due >= now  # the next is not passed over yet (only once past it)
        assert passed_over(tat, since, due + 1e-6, grace, line, 16)[0] == count + 1


# ------------------------------------------------------------ the model


@dataclass
class Waiter:
    number: int
    silent: bool
    arrived: float
    promised: float  # the retry it was told, plus a grace per silent head ahead


class Key:
    """One key as etcd holds it: TAT, ``since`` (the wall time of the last TAT
    write) and the line; the times admissions happened."""

    def __init__(self) -> None:
        self.tat = NO_TAT
        self.since = NO_TAT
        self.line: list[Waiter] = []
        self.admitted: list[tuple[float, int]] = []
        self.order: list[int] = []

    def steps(self) -> list[tuple[float, float]]:
        return [STEP] * len(self.line)

    def pass_over(self, now: float) -> None:
        """A live actor at ``now`` (a waiter behind, a newcomer) passes over the
        heads the rule says are passed over, in one write of the TAT as it was."""
        count, _ = passed_over(self.tat, self.since, now, GRACE, self.steps(), 16)
        for waiter in self.line[:count]:
            assert waiter.silent, "a live head was passed over"
        if count:
            del self.line[:count]
            self.since = now

    def run_until(self, until: float) -> None:
        """Live heads take their turn when it comes; a live waiter behind silent
        heads passes them over as soon as the rule lets it."""
        while self.line:
            head = self.line[0]
            if not head.silent:
                due = turn(self.tat, self.since, UNITS, CAPACITY)
                if due > until:
                    return
                verdict, after, _ = head_turn(self.tat, due + EPSILON / 2, RATE)
                assert verdict is not None
                self.tat, self.since = after, due
                self.admitted.append((due, RATE.cost))
                self.order.append(head.number)
                assert due <= head.promised + 1e-6, (due, head.promised)
                self.line.pop(0)
                continue
            if all(waiter.silent for waiter in self.line):
                return  # nobody live to pass it over: the next newcomer will
            _, due = passed_over(self.tat, self.since, -1e18, GRACE, self.steps(), 16)
            if due > until:
                return
            self.pass_over(due + 1e-9)

    def ask(self, now: float, wait: bool, silent: bool, number: int) -> None:
        self.run_until(now)
        self.pass_over(now)  # the newcomer passes over what the rule says
        ahead = self.steps()
        verdict, after = judge_in_line(self.tat, now, RATE, ahead)
        if verdict.admitted:
            assert not self.line
            self.tat, self.since = after, now
            self.admitted.append((now, RATE.cost))
            return
        if wait:
            retry = behind(self.tat, now, RATE, ahead).retry
            silent_ahead = sum(waiter.silent for waiter in self.line)
            promised = now + retry + silent_ahead * GRACE
            self.line.append(Waiter(number, silent, now, promised))


@settings(max_examples=300, deadline=None)
@given(
    schedule=st.lists(
        st.tuples(st.floats(0, 1.5), st.booleans(), st.booleans()),  # gap, wait, silent
        max_size=50,
    )
)
def test_silent_heads_cost_a_grace_each_and_never_the_rate(
    schedule: list[tuple[float, bool, bool]],
) -> None:
    key, live = Key(), []
    arrivals = list(accumulate(gap for gap, _, _ in schedule))
    for number, (at, (_, wait, silent)) in enumerate(zip(arrivals, schedule, strict=True)):
        key.ask(at, wait, silent, number)
        if wait and not silent and key.line and key.line[-1].number == number:
            live.append(number)
    now = arrivals[-1] if arrivals else 0.0
    key.run_until(now + 1000)
    key.ask(now + 1000, False, False, -1)  # a last newcomer passes the silent rest
    # Every live waiter was admitted, in arrival order.
    assert [n for n in key.order if n in live] == live
    # The window bound: B + W·COUNT/PERIOD units in any window of length W.
    times = sorted(key.admitted)
    per_second = RATE.calls / RATE.period
    for i, (start, _) in enumerate(times):
        spent = accumulate(cost for _, cost in times[i:])
        ends = [end for end, _ in times[i:]]
        assert all(
            units <= RATE.burst + (end - start) * per_second + 1e-6
            for units, end in zip(spent, ends, strict=True)
        )
