"""A cluster node reads its own throttle writes before its watch brings them: the
TAT its txn swapped counts at once for ``--max-throttles`` and judges the node's
next request on the key. (CI once saw a fourth key admitted at ``--max-throttles 3``
because the mirror had not yet shown the first three.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

from elockd.backend.cluster.etcd.client import TxnResult
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
