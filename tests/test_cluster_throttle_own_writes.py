"""A cluster node reads its own throttle writes before its watch brings them: the
TAT its txn swapped counts at once for ``--max-throttles`` and judges the node's
next request on the key; a waiter it put or deleted is in or out of its line at
once; and no older event the watch brings undoes such a note. (CI once saw a
fourth key admitted at ``--max-throttles 3``: the mirror had not yet shown the
first three.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

from elockd.backend.cluster.etcd.client import KeyValue, TxnResult
from elockd.backend.cluster.layout import tat_value, waiter_value
from elockd.backend.cluster.throttle import ClusterThrottles
from elockd.backend.cluster.throttle_book import ThrottleBook
from elockd.engine.gcra import Rate
from elockd.engine.throttles import TooManyThrottles
from tests.support.throttle_copy import LAYOUT, WALL

ONE_A_MINUTE = Rate(1, 60.0, 1, 1)


class EtcdWithoutWatch:
    """Every txn succeeds at the next revision; its watch never arrives, so the
    node's copy learns only what the node notes itself."""

    def __init__(self) -> None:
        self.revision = 100
        self.txns = 0

    async def txn(self, *_: object) -> TxnResult:
        self.txns += 1
        self.revision += 1
        return TxnResult(True, self.revision, [])


def node_over(etcd: EtcdWithoutWatch, book: ThrottleBook) -> ClusterThrottles:
    return ClusterThrottles(
        cast(Any, etcd),
        cast(Any, SimpleNamespace(admitted=0, throttled=0)),
        LAYOUT,
        book,
        lambda: 100,
        cast(Any, None),  # nothing here waits
        "n1",
        max_throttles=3,
        max_waiters=10,
        wall=lambda: WALL,
    )


def test_admitted_keys_count_before_the_watch_shows_them() -> None:
    etcd, book = EtcdWithoutWatch(), ThrottleBook(LAYOUT)
    node = node_over(etcd, book)

    async def main() -> None:
        for key in (b"a", b"b", b"c"):
            verdict = await node.throttle(cast(Any, None), key, ONE_A_MINUTE, 0)
            assert verdict.admitted
        with pytest.raises(TooManyThrottles):
            await node.throttle(cast(Any, None), b"d", ONE_A_MINUTE, 0)
        # The same key again: refused on the node's own note, with no txn.
        txns = etcd.txns
        again = await node.throttle(cast(Any, None), b"a", ONE_A_MINUTE, 0)
        assert not again.admitted
        assert again.retry == pytest.approx(60.0)
        assert etcd.txns == txns

    trio.run(main)
    assert book.live(WALL) == 3
    assert book.tat(b"a") is not None and book.tat(b"a").revision == 101  # type: ignore[union-attr]


def test_a_late_note_never_replaces_a_newer_write() -> None:
    book = ThrottleBook(LAYOUT)
    book.wrote(b"k", WALL + 60, 50, "n1")
    book.wrote(b"k", WALL + 30, 40, "n1")  # an older swap's note, answered late
    found = book.tat(b"k")
    assert found is not None and (found.tat, found.revision) == (WALL + 60, 50)
    book.wrote(b"k", WALL + 90, 60, "n2")
    found = book.tat(b"k")
    assert found is not None and (found.tat, found.revision) == (WALL + 90, 60)


def waiter(n: int, revision: int) -> KeyValue:
    value = waiter_value("n1", 60.0, 60.0)
    return KeyValue(LAYOUT.throttle_waiter(b"k", n), value, revision, revision, 7)


def test_a_waiter_this_node_let_through_leaves_its_line_at_once() -> None:
    """The node's own txn deleted its waiter (admitted, or left): the copy drops it
    before the watch shows the delete, and a put of it the watch brings late (the
    copy trailed by more than the entry's whole life) does not bring it back."""
    book = ThrottleBook(LAYOUT)
    book.put(waiter(1, 20))
    book.put(waiter(2, 21))
    book.left(waiter(1, 20).key, 25, seen_up_to=21)
    assert book.line_length(b"k") == 1 and book.waiting == 1
    assert book.head(b"k") is not None and book.head(b"k").revision == 21  # type: ignore[union-attr]
    # One the node joined and left before the watch showed either.
    book.left(waiter(3, 30).key, 31, seen_up_to=21)
    book.put(waiter(3, 30))  # the watch, late
    assert book.line_length(b"k") == 1
    book.delete(waiter(3, 30).key, 31)
    book.delete(waiter(1, 20).key, 25)
    assert book.line_length(b"k") == 1 and book.waiting == 1
    assert not book._gone  # every note is let go once the watch shows its delete


def test_a_note_the_watch_already_passed_changes_nothing() -> None:
    book = ThrottleBook(LAYOUT)
    book.put(waiter(1, 20))
    book.delete(waiter(1, 20).key, 22)
    book.joined(waiter(1, 20), seen_up_to=22)  # put and deleted, both shown
    assert book.line_length(b"k") == 0
    book.left(waiter(1, 20).key, 22, seen_up_to=22)
    assert not book._gone
    book.joined(waiter(2, 30), seen_up_to=22)  # not shown yet: noted
    assert book.line_length(b"k") == 1
    book.put(waiter(2, 30))  # the watch brings it: once
    assert book.line_length(b"k") == 1 and book.waiting == 1


def test_an_older_tat_event_never_undoes_a_newer_note() -> None:
    book = ThrottleBook(LAYOUT)
    book.wrote(b"k", WALL + 60, 50, "n1")
    book.put(KeyValue(LAYOUT.tat(b"k"), tat_value(WALL + 5, "n2"), 1, 40, 0))
    book.delete(LAYOUT.tat(b"k"), 45)  # the sweep of the TAT before ours
    found = book.tat(b"k")
    assert found is not None and (found.tat, found.revision) == (WALL + 60, 50)
    assert book.live(WALL) == 1
    book.delete(LAYOUT.tat(b"k"), 70)  # a later delete does remove it
    assert book.tat(b"k") is None and book.live(WALL) == 0
