"""The cluster's kept fold of a throttle line (:class:`~elockd.backend.cluster.
throttle_book.Waiters`): the same answers as a walk of the whole line, float for
float, whatever the watch brought and in whatever order; and a request behind a
long line does not walk it.

Work is counted, not timed: every walk of a line iterates its :class:`Waiters`, so
the tests count the waiters iterated."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from elockd.backend.cluster import throttle_book
from elockd.backend.cluster.throttle import ClusterThrottles
from elockd.backend.cluster.throttle_book import (
    NO_TAT,
    Ahead,
    ThrottleBook,
    Waiters,
    behind,
    judge_in_line,
    walk,
)
from elockd.engine.gcra import Rate, Verdict
from tests.support.throttle_copy import (
    KEY,
    LAYOUT,
    RATE,
    WALL,
    copy_node,
    full_book,
    tat_kv,
    waiter_kv,
)


class Model:
    """The book's line as a plain list, by create revision, and its TAT."""

    def __init__(self) -> None:
        self.tat = NO_TAT
        self.line: dict[int, tuple[int, Ahead]] = {}  # revision -> (waiter id, ahead)

    def ahead(self, before: int = 1 << 62) -> list[Ahead]:
        return [self.line[r][1] for r in sorted(self.line) if r < before]


UNITS = st.sampled_from([0.001, 0.1, 0.25, 1.0, 1 / 3, 2.5])
CAPACITIES = st.sampled_from([0.0, 0.001, 0.5, 1.0, 7 / 3, 10.0])
RATES = st.builds(
    Rate,
    st.integers(1, 10),
    st.sampled_from([0.1, 1.0, 3.0]),
    st.integers(1, 10),
    st.integers(0, 4),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), UNITS, CAPACITIES, st.booleans()),
        st.tuples(st.just("leave"), st.integers(0, 1000)),
        st.tuples(st.just("tat"), st.floats(0, 20, allow_subnormal=False)),
        st.tuples(st.just("untat")),
        st.tuples(st.just("reload"), st.randoms(use_true_random=False)),
        st.tuples(st.just("snapshot")),
    ),
    max_size=60,
)


#: When a probe asks: on the head's turn or just either side of it (where the kept
#: fold stops holding), or anywhere.
NEAR = st.sampled_from([-1.0, -0.005, -1e-9, 0.0, 1e-9, 0.005, 1.0])
PROBES = st.lists(
    st.tuples(st.one_of(NEAR, st.floats(0, 30).map(lambda t: (t,))), RATES),
    min_size=1,
    max_size=4,
)


def probe_time(when: float | tuple[float], tat: float, line: list[Ahead]) -> float:
    """A probe's ``now``: an absolute time, or one near the head's turn."""
    if isinstance(when, tuple):
        return when[0]
    if not line or tat == NO_TAT:
        return 10.0 + when
    units, capacity = line[0]
    return tat + units - capacity + when


@settings(max_examples=400, deadline=None)
@given(ops=OPS, probes=PROBES)
def test_the_kept_fold_answers_as_the_walk_does(ops: list[Any], probes: list[Any]) -> None:
    """Joins at the end and out of order, leaves, TATs set and deleted, a reload
    (cleared, then read back in key order): after each, a request behind the whole
    line, and one behind a prefix of it, is answered as a walk of a plain list
    answers; so is a snapshot taken earlier, as the line was then."""
    book, model = ThrottleBook(LAYOUT), Model()
    revision = 10
    snapshots: list[tuple[Waiters, list[Ahead]]] = []
    for op in ops:
        revision += 1
        if op[0] == "join":
            _, units, capacity, out_of_order = op
            # A waiter the watch brings late (a reload's key order) is older
            # than some already in line.
            created = revision - 5 if out_of_order and revision - 5 not in model.line else revision
            if created in model.line:
                continue
            model.line[created] = (revision, (units, capacity))
            book.put(waiter_kv(revision, created, units, capacity))
        elif op[0] == "leave" and model.line:
            revisions = sorted(model.line)
            gone = revisions[op[1] % len(revisions)]
            waiter, _ = model.line.pop(gone)
            book.delete(LAYOUT.throttle_waiter(KEY, waiter))
        elif op[0] == "tat":
            model.tat = op[1]
            book.put(tat_kv(op[1], revision))
        elif op[0] == "untat":
            model.tat = NO_TAT
            book.delete(LAYOUT.tat(KEY))
        elif op[0] == "reload":
            book.clear()
            kvs = [waiter_kv(w, created, *ahead) for created, (w, ahead) in model.line.items()]
            op[1].shuffle(kvs)
            for kv in kvs:
                book.put(kv)
            if model.tat != NO_TAT:
                book.put(tat_kv(model.tat, revision))
        elif op[0] == "snapshot":
            snapshot = book.ahead(KEY)
            if isinstance(snapshot, Waiters):
                snapshots.append((snapshot, model.ahead()))
        found = book.tat(KEY)
        tat = NO_TAT if found is None else found.tat
        assert tat == model.tat
        middle = sorted(model.line)[len(model.line) // 2] if model.line else 0
        for when, rate in probes:
            for kept, walked in (
                (book.ahead(KEY), model.ahead()),
                (book.ahead(KEY, middle), model.ahead(middle)),
                *snapshots,
            ):
                now = probe_time(when, tat, walked)
                assert list(kept) == walked
                if isinstance(kept, Waiters):  # else no line: ()
                    assert kept.end(tat, now) == walk(tat, now, walked)
                assert behind(tat, now, rate, kept) == behind(tat, now, rate, walked)
                assert judge_in_line(tat, now, rate, kept) == judge_in_line(tat, now, rate, walked)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["join", "join", "fold", "fork"]), UNITS, CAPACITIES),
        max_size=30,
    ),
    tat=st.floats(0, 20),
    probes=PROBES,
)
def test_snapshots_grow_fork_and_fold_alone(
    steps: list[Any], tat: float, probes: list[Any]
) -> None:
    """:class:`Waiters` on its own: folded when empty or part-way, grown one join at
    a time, and grown again from an older snapshot (a fork of the shared list):
    every snapshot still holds, and folds, exactly what it held when made."""
    made: list[tuple[Waiters, list[Ahead]]] = [(Waiters(), [])]
    for what, units, capacity in steps:
        if what == "join":
            waiters, plain = made[-1]
            made.append((waiters.joined(units, capacity), [*plain, (units, capacity)]))
        elif what == "fold":
            made[-1][0].fold(tat)
        else:  # an older snapshot grows: the list it shares is already longer
            waiters, plain = made[len(made) // 2]
            made.append((waiters.joined(units, capacity), [*plain, (units, capacity)]))
        for waiters, plain in made:
            assert list(waiters) == plain and len(waiters) == len(plain)
            for when, rate in probes:
                now = probe_time(when, tat, plain)
                assert waiters.end(tat, now) == walk(tat, now, plain)
                assert behind(tat, now, rate, waiters) == behind(tat, now, rate, plain)


# ------------------------------------------------------------------ the work done

LINE = 1000


@pytest.fixture
def iterated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the waiters any walk steps over: of a :class:`Waiters`, or of a list
    (:func:`~elockd.backend.cluster.throttle_book.walk`)."""
    counted = [0]
    iterate = Waiters.__iter__

    def counting(self: Waiters) -> Iterator[Ahead]:
        for waiter in iterate(self):
            counted[0] += 1
            yield waiter

    def counting_walk(tat: float, now: float, ahead: Iterable[Ahead]) -> tuple[float, float]:
        steps = list(ahead)
        counted[0] += len(steps)
        return walk(tat, now, steps)

    monkeypatch.setattr(Waiters, "__iter__", counting)
    monkeypatch.setattr(throttle_book, "walk", counting_walk)
    return counted


def refuse(node: ClusterThrottles, count: int, wait: float = 0.0) -> list[Verdict]:
    async def main() -> list[Verdict]:
        return [await node.throttle(cast(Any, None), KEY, RATE, wait) for _ in range(count)]

    return trio.run(main)


def test_refusals_behind_a_long_line_walk_it_once(iterated: list[int]) -> None:
    """1,000 requests that do not wait, and 1,000 whose wait is shorter than their
    turn, behind 1,000 waiters: one walk of the line in all, not one each."""
    node = copy_node(full_book(LINE))
    assert iterated[0] == 0  # joining at the end walks nothing
    verdicts = refuse(node, 1000) + refuse(node, 1000, wait=0.0005)
    for verdict in verdicts:
        assert not verdict.admitted
        # After every waiter, each a ms apart: its own turn at 1.001 s.
        assert verdict.retry == pytest.approx((LINE + 1) / 1000)
    assert iterated[0] <= LINE, iterated[0]
    assert cast(Any, node.ledger).throttled == 2000


def test_joins_between_refusals_extend_the_fold_without_a_walk(iterated: list[int]) -> None:
    """Waiters joining between the refusals (the watch's events interleave with
    local requests) each add one step: still one walk in all."""
    book = full_book(LINE)
    node = copy_node(book)
    for n in range(LINE):
        (verdict,) = refuse(node, 1)
        assert verdict.retry == pytest.approx((LINE + n + 1) / 1000)
        book.put(waiter_kv(LINE + n + 1, 10 + LINE + n, RATE.interval, RATE.capacity))
    assert iterated[0] <= LINE, iterated[0]


def test_a_leave_or_a_new_tat_costs_one_walk_then_none(iterated: list[int]) -> None:
    book = full_book(LINE)
    node = copy_node(book)
    refuse(node, 10)
    walks = iterated[0]
    book.delete(LAYOUT.throttle_waiter(KEY, 500))  # one from the middle leaves
    (verdict,) = refuse(node, 1)
    assert verdict.retry == pytest.approx(LINE / 1000)
    assert iterated[0] - walks <= LINE
    book.put(tat_kv(WALL + RATE.capacity + 0.5, 6))  # the TAT moved
    refuse(node, 100)
    assert iterated[0] - walks <= 2 * LINE, iterated[0] - walks
