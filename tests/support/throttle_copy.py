"""A cluster node's throttle verb on its copy of one key, with no etcd behind it:
enough for what the copy alone decides (a refusal it proves), counted in the tests
and timed in ``bench/throttle_line.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from elockd.backend.cluster.etcd.client import KeyValue
from elockd.backend.cluster.layout import Layout, tat_value, waiter_value
from elockd.backend.cluster.throttle import ClusterThrottles
from elockd.backend.cluster.throttle_book import ThrottleBook
from elockd.engine.gcra import Rate

LAYOUT = Layout(b"/copy/")
KEY = b"k"
RATE = Rate(1000, 1.0, 1000, 1)  # a unit every ms, a burst of 1000
WALL = 1_000_000.0  # the node's wall clock, stopped


def tat_kv(tat: float, revision: int) -> KeyValue:
    return KeyValue(LAYOUT.tat(KEY), tat_value(tat, "n1"), 1, revision, 0)


def waiter_kv(waiter: int, revision: int, units: float, capacity: float) -> KeyValue:
    """A waiter's entry as the watch brings it: created at ``revision``."""
    value = waiter_value("n1", units, capacity)
    return KeyValue(LAYOUT.throttle_waiter(KEY, waiter), value, revision, revision, 7)


def full_book(line: int) -> ThrottleBook:
    """The burst spent at WALL, then ``line`` waiters of RATE joined in the watch's
    order (waiter ``n`` created at revision ``9 + n``)."""
    book = ThrottleBook(LAYOUT)
    book.put(tat_kv(WALL + RATE.capacity, 5))
    for n in range(1, line + 1):
        book.put(waiter_kv(n, 9 + n, RATE.cost * RATE.interval, RATE.capacity))
    return book


class NoEtcd:
    """A refusal the node's copy proves sends nothing to etcd."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"etcd asked ({name}) for a refusal the copy proves")


def copy_node(book: ThrottleBook) -> ClusterThrottles:
    """The verb on ``book``; its ``ledger`` counts only ``admitted`` and ``throttled``."""
    return ClusterThrottles(
        cast(Any, NoEtcd()),
        cast(Any, SimpleNamespace(admitted=0, throttled=0)),
        LAYOUT,
        book,
        lambda: 1 << 40,
        cast(Any, None),  # no lease: nothing here waits
        "n1",
        max_throttles=10,
        max_waiters=1 << 30,
        wall=lambda: WALL,
    )
