"""What a cluster node's ``--max-throttles`` check and its sweep's lapsed list cost
with many throttle keys, without etcd.

A node's copy (:class:`~elockd.backend.cluster.throttle_book.ThrottleBook`) holds N
TATs, due in a minute; each check asks the count of keys with state (made on every
request for a new key) and the sweep's list of lapsed TATs. Timed twice in the same
process: as shipped (kept as the clock passes) and as a pass over every key (as
before).

    .venv/bin/python bench/throttle_count.py                 # 10,000, 100,000, 1,000,000 keys
    .venv/bin/python bench/throttle_count.py --keys 50000 --checks 100
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from elockd.backend.cluster.etcd.client import KeyValue
from elockd.backend.cluster.layout import Layout, tat_value
from elockd.backend.cluster.throttle_book import ThrottleBook

LAYOUT = Layout(b"/bench/")
WALL = 1_000_000.0


def filled(keys: int) -> ThrottleBook:
    book = ThrottleBook(LAYOUT)
    for n in range(keys):
        book.put(KeyValue(LAYOUT.tat(b"k%d" % n), tat_value(WALL + 60, "n1"), 1, n + 1, 0))
    return book


def kept(book: ThrottleBook, wall: float) -> None:
    book.live(wall)
    book.lapsed(wall, "n1", 10.0)


def every_key(book: ThrottleBook, wall: float) -> None:
    lapsed = sum(1 for t in book.tats.values() if t.tat <= wall)
    waiting_only = sum(1 for key in book.lines if key not in book.tats)
    _ = len(book.tats) - lapsed + waiting_only
    _ = [k for k, t in book.tats.items() if t.tat <= wall and t.writer == "n1"]


def per_check(book: ThrottleBook, check: Callable[[ThrottleBook, float], None], n: int) -> float:
    start = time.perf_counter()
    for step in range(n):
        check(book, WALL + step / 1000)
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, action="append", help="TATs in the copy")
    parser.add_argument("--checks", type=int, default=20)
    args = parser.parse_args()
    for keys in args.keys or [10_000, 100_000, 1_000_000]:
        book = filled(keys)
        shipped = per_check(book, kept, args.checks)
        before = per_check(book, every_key, args.checks)
        print(
            f"{keys:>9,} keys: kept {shipped * 1e6:9.1f} µs a check, "
            f"a pass over every key {before * 1e6:9.1f} µs ({before / shipped:,.0f}x)"
        )


if __name__ == "__main__":
    main()
