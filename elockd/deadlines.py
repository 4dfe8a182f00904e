"""A heap of deadlines, shared by both lock backends (lease ends, grace ends).

Entries are never removed from the middle: an entry whose target was renewed or
freed stays until it reaches the top, where the caller recognises it as stale (its
target no longer carries that deadline) and skips it. Renewing is then O(log n) and
nothing ever scans.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Deadlines(Generic[T]):
    """(deadline, target) pairs, earliest first; ties in the order they were added."""

    __slots__ = ("_heap", "_tiebreak")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._tiebreak = itertools.count()

    def add(self, deadline: float, target: T) -> bool:
        """Add one; True when it is now the earliest (a timer must re-arm)."""
        heap = self._heap
        earlier = not heap or deadline < heap[0][0]
        heapq.heappush(heap, (deadline, next(self._tiebreak), target))
        return earlier

    def next(self) -> float | None:
        """The earliest deadline (possibly a stale entry's), or None."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterator[tuple[float, T]]:
        """Take out every entry due by ``now``; entries added meanwhile count too."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, target = heapq.heappop(heap)
            yield deadline, target
