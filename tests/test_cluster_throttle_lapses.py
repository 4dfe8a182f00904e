"""The cluster throttle copy's count of keys with state (``--max-throttles``) and its
list of lapsed TATs (the sweep), kept as the wall clock passes: the same answers as
a count over every key, whatever the watch brought and however the clock moved
(backwards too), and no pass over every key on each check."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from elockd.backend.cluster.etcd.client import KeyValue
from elockd.backend.cluster.layout import tat_value, waiter_value
from elockd.backend.cluster.throttle_book import ThrottleBook
from tests.support.throttle_copy import LAYOUT

KEYS = [b"a", b"b", b"c", b"d"]
NODES = ["n1", "n2"]


def tat_kv(key: bytes, tat: float, revision: int, writer: str) -> KeyValue:
    return KeyValue(LAYOUT.tat(key), tat_value(tat, writer), 1, revision, 0)


def waiter_kv(key: bytes, waiter: int, revision: int) -> KeyValue:
    value = waiter_value("n1", 1.0, 1.0)
    return KeyValue(LAYOUT.throttle_waiter(key, waiter), value, revision, revision, 7)


def counted(book: ThrottleBook, wall: float) -> int:
    """The count as a pass over every key gives it."""
    lapsed = sum(1 for t in book.tats.values() if t.tat <= wall)
    waiting_only = sum(1 for key in book.lines if key not in book.tats)
    return len(book.tats) - lapsed + waiting_only


def listed(book: ThrottleBook, wall: float, node: str, orphaned_after: float) -> set[bytes]:
    return {
        key
        for key, t in book.tats.items()
        if t.tat <= wall and (t.writer == node or t.tat + orphaned_after <= wall)
    }


TIMES = st.integers(0, 40).map(float)
OPS = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), TIMES, st.sampled_from(NODES)),
    st.tuples(st.just("wrote"), st.sampled_from(KEYS), TIMES, st.sampled_from(NODES)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("join"), st.sampled_from(KEYS), st.integers(1, 3)),
    st.tuples(st.just("leave"), st.sampled_from(KEYS), st.integers(1, 3)),
    st.tuples(st.just("clear")),
    st.tuples(st.just("check"), TIMES),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(OPS, max_size=60))
def test_the_kept_count_and_list_match_a_pass_over_every_key(ops: list[Any]) -> None:
    book, revision = ThrottleBook(LAYOUT), 10
    for op in ops:
        revision += 1
        match op:
            case ("put", key, tat, node):
                book.put(tat_kv(key, tat, revision, node))
            case ("wrote", key, tat, node):
                # Sometimes an older swap's note, answered late.
                book.wrote(key, tat, revision - 5 * (tat > 30), node)
            case ("delete", key):
                book.delete(LAYOUT.tat(key))
            case ("join", key, waiter):
                book.put(waiter_kv(key, waiter, revision))
            case ("leave", key, waiter):
                book.delete(LAYOUT.throttle_waiter(key, waiter))
            case ("clear",):
                book.clear()
            case ("check", wall):
                assert book.live(wall) == counted(book, wall)
                assert book.size() == len(book.tats) + len(set(book.lines) - set(book.tats))
                for node in NODES:
                    got = {key for key, _ in book.lapsed(wall, node, 10.0)}
                    assert got == listed(book, wall, node, 10.0)


class CountingDict(dict[bytes, Any]):
    """Counts the passes over every key."""

    passes = 0

    def values(self) -> Any:
        CountingDict.passes += 1
        return super().values()

    def items(self) -> Any:
        CountingDict.passes += 1
        return super().items()

    def __iter__(self) -> Any:
        CountingDict.passes += 1
        return super().__iter__()


def test_checks_do_not_pass_over_every_key() -> None:
    """100,000 TATs: a thousand checks of the count and the sweep's list (whose
    deletes the watch brings back) read only the keys that lapsed, never every key
    (24 ms a check at a million keys, before)."""
    book = ThrottleBook(LAYOUT)
    book.tats = CountingDict()
    for n in range(100_000):
        book.put(tat_kv(b"k%d" % n, 1000.0 + n / 100, n + 1, "n1"))
    CountingDict.passes = 0
    swept = 0
    for step in range(1000):
        wall = 1000.0 + step  # the keys lapse a hundred a second
        assert book.live(wall) == 100_000 - (100 * step + 1)
        lapsed = book.lapsed(wall, "n1", 10.0)
        assert len(lapsed) == 100 * step + 1 - swept
        for key, _ in lapsed:
            book.delete(LAYOUT.tat(key))
        swept += len(lapsed)
    assert CountingDict.passes == 0
