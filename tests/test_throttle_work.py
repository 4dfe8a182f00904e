"""A long line (up to ``--max-waiters``) must not make each request on its key walk
it: a client that fills a line, then floods the key with requests that are
refused, or drops every waiter at once, must not buy O(line) work per request.

Work is counted, not timed: every step of a walk calls
:func:`elockd.engine.gcra.admit_at` once, so the test counts those calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elockd.engine import throttles as throttles_module
from elockd.engine.gcra import Rate, Verdict, admit_at
from elockd.engine.locks import LockEngine
from elockd.engine.throttles import ThrottleWaiter

LINE = 2000
RATE = Rate(1000, 1.0, 1000, 1)  # a unit every ms, a burst of 1000


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counted = [0]

    def counting(tat: float, rate: Rate) -> float:
        counted[0] += 1
        return admit_at(tat, rate)

    monkeypatch.setattr(throttles_module, "admit_at", counting)
    return counted


def full_line(engine: LockEngine) -> list[ThrottleWaiter]:
    """The burst spent at 0, then LINE waiters, each on its own session."""
    table = engine.throttles
    spender = engine.open_session("spender", b"p")
    for _ in range(RATE.burst):
        assert isinstance(table.request(spender, b"k", 0.0, RATE, 0.0), Verdict)
    line = []
    for n in range(LINE):
        session = engine.open_session(f"w{n}", b"p")
        got = table.request(session, b"k", 0.0, RATE, 100.0)
        assert isinstance(got, ThrottleWaiter)
        line.append(got)
    return line


def test_filling_a_line_walks_it_once(steps: list[int]) -> None:
    full_line(LockEngine(max_waiters=LINE))
    assert steps[0] <= 4 * LINE, steps[0]


def test_refused_requests_behind_a_line_do_not_walk_it(steps: list[int]) -> None:
    engine = LockEngine(max_waiters=LINE)
    full_line(engine)
    asker = engine.open_session("asker", b"p")
    before = steps[0]
    for _ in range(1000):
        got = engine.throttles.request(asker, b"k", 0.0, RATE, 0.0)
        assert isinstance(got, Verdict) and not got.admitted
        # After every waiter, each a ms apart: its own turn at 2.001 s.
        assert got.retry == pytest.approx((LINE + 1) / 1000)
    assert steps[0] - before <= 4 * 1000 + LINE, steps[0] - before


def test_dropping_every_waiter_does_not_walk_the_line_for_each(steps: list[int]) -> None:
    engine = LockEngine(max_waiters=LINE)
    line = full_line(engine)
    before = steps[0]
    for waiter in reversed(line):  # the head last: no turn comes up meanwhile
        engine.disconnect(waiter.session, 0.0)
    assert engine.throttles.waiting == 0 and not engine.throttles.lines
    assert steps[0] - before <= 4 * LINE, steps[0] - before


def test_a_late_timer_times_a_whole_line_out_without_a_walk_for_each(
    steps: list[int],
) -> None:
    """Waits of 10.5 s behind a spent burst, and a timer that comes round 10.4 s
    late (a busy loop, a pause): the heads are admitted at ``now``, so the rest of
    the line cannot make it any more and times out in one batch at one ``now``:
    one walk of the line, not one per timeout."""
    engine = LockEngine(max_waiters=LINE)
    table = engine.throttles
    spender = engine.open_session("spender", b"p")
    for _ in range(RATE.burst):
        table.request(spender, b"k", 0.0, RATE, 0.0)
    line = [
        table.request(engine.open_session(f"w{n}", b"p"), b"k", 0.0, RATE, 10.5)
        for n in range(LINE)
    ]
    assert all(isinstance(w, ThrottleWaiter) for w in line)
    engine.advance(10.4)
    before = steps[0]
    engine.advance(11.0)
    timed_out = [
        w
        for w in line
        if isinstance(w, ThrottleWaiter) and w.verdict is not None and not w.verdict.admitted
    ]
    assert len(timed_out) >= 500 and table.waiting == 0
    assert steps[0] - before <= 4 * LINE, steps[0] - before
    # Each 409 tells a retry no shorter than its true turn behind what is left.
    for waiter in timed_out:
        assert waiter.verdict is not None and waiter.verdict.retry > 0


def walked(line: Iterable[ThrottleWaiter], tat: float, now: float, rate: Rate) -> Verdict:
    """The fold the kept tails stand for, walked step by step."""
    reset = max(tat - now, 0.0)
    when = now
    for waiter in line:
        when = max(when, admit_at(tat, waiter.rate))
        tat = max(tat, when) + waiter.rate.cost * waiter.rate.interval
    return Verdict(False, rate.burst, 0, reset, max(when, admit_at(tat, rate)) - now)


RATES = st.builds(
    lambda calls, period, extra, cost: Rate(calls, period, calls + extra, min(cost, calls + extra)),
    st.integers(1, 5),
    st.sampled_from([0.5, 1.0, 3.0, 0.1]),
    st.integers(0, 3),
    st.integers(1, 4),
)
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["ask", "ask", "ask", "leave", "advance", "late"]),
        st.sampled_from([b"a", b"b"]),
        RATES,
        st.sampled_from([0.0, 0.5, 2.0, 10.0]),
        st.floats(0, 1.5),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(STEPS, RATES)
def test_a_kept_tail_answers_as_the_walk_does(steps: list[Any], probe: Rate) -> None:
    """Whatever came and went, a request behind each line gets, float for float, the
    answer of a walk of the whole line."""
    engine = LockEngine(max_waiters=50)
    table = engine.throttles
    sessions = [engine.open_session(f"s{n}", b"p") for n in range(len(steps))]
    now = 0.0
    for n, (what, key, rate, wait, step) in enumerate(steps):
        if what == "ask":
            table.request(sessions[n], key, now, rate, wait)
        elif what == "leave":
            waiters = list(table.waiters())
            if waiters:
                engine.disconnect(waiters[int(step * 10) % len(waiters)].session, now)
        else:  # time passes; the timer runs now, or comes round late
            now += step
            if what == "advance":
                engine.advance(now)
        for line_key, line in table.lines.items():
            tat = table.tats.get(line_key, -math.inf)
            assert table._behind(line, tat, now, probe) == walked(line, tat, now, probe)
