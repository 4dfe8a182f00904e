"""What a refused ``throttle`` costs a cluster node behind a long line, without etcd.

A node's copy of one key (:class:`~elockd.backend.cluster.throttle_book.ThrottleBook`)
holds a spent burst and a line of N waiters; R requests that do not wait are then
refused by :meth:`~elockd.backend.cluster.throttle.ClusterThrottles.throttle` on
that copy (no etcd call: the copy proves each refusal), in one trio run. Timed twice
in the same process: with the line's kept fold (as shipped), and walking the whole
line for each request (as before: the line copied out and folded every time).

    .venv/bin/python bench/throttle_line.py                  # 1,000 waiters, 10,000 refusals
    .venv/bin/python bench/throttle_line.py --line 10000 --requests 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, cast

import trio

from elockd.backend.cluster.throttle_book import Ahead, ThrottleBook

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.throttle_copy import KEY, RATE, copy_node, full_book


def walking(book: ThrottleBook) -> None:
    """Make ``book`` answer as before the kept fold: every look copies the line
    out as a list (the old loop, which the ``skip`` path still is), and every
    request behind it folds that list."""
    line = book.lines[KEY]

    def ahead(key: bytes, before: int = 1 << 62, *, skip: int = 0) -> Collection[Ahead]:
        return line.ahead(before, skip=skip or -1)

    book.ahead = ahead  # type: ignore[method-assign]


def seconds(book: ThrottleBook, requests: int) -> float:
    node = copy_node(book)

    async def main() -> float:
        start = time.perf_counter()
        for _ in range(requests):
            verdict = await node.throttle(cast(Any, None), KEY, RATE, 0.0)
            assert not verdict.admitted
        return time.perf_counter() - start

    return trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--line", type=int, default=1000, help="waiters in line")
    parser.add_argument("--requests", type=int, default=10_000, help="refusals timed")
    parser.add_argument("--runs", type=int, default=3, help="best of this many")
    args = parser.parse_args()
    kept = min(seconds(full_book(args.line), args.requests) for _ in range(args.runs))
    walked_book = full_book(args.line)
    walking(walked_book)
    walked = min(seconds(walked_book, args.requests) for _ in range(args.runs))
    for name, took in (("kept fold", kept), ("walk each time", walked)):
        print(
            f"{name:>15}: {args.requests:,} refusals behind {args.line:,} waiters in "
            f"{took:.3f} s, {took / args.requests * 1e6:.1f} µs each"
        )
    print(f"{'':>15}  {walked / kept:.0f}x")


if __name__ == "__main__":
    main()
