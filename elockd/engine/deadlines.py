"""A heap of deadlines, shared by both lock backends (lease, grace and wait ends).

Entries are never removed from the middle: when a lease is renewed or freed, a wait
granted, or a session taken over, its old entry stays in the heap, *stale*: its
target no longer carries that deadline. ``is_current`` (given by the backend) tells
the two apart, and :meth:`Deadlines.due` skips stale entries. Renewing is then
O(log n) and nothing scans on the hot path.

Stale entries must not pile up, though: 500,000 ``renew`` of one lease would
otherwise keep 500,000 entries until they fire, a day later. So whenever the heap
has doubled since it was last known to hold only current entries, it is compacted
(the stale ones filtered out, the rest heapified). Each compaction costs O(n) and
happens only after n more additions, so adding stays amortised O(log n), and the
heap holds at most about twice the peak of live deadlines (:data:`COMPACT_FLOOR`
entries at least, so small heaps are never rebuilt).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

#: Below this many entries the heap is never compacted: rebuilding it would cost
#: more than the memory it frees.
COMPACT_FLOOR = 1024


class Deadlines(Generic[T]):
    """(deadline, target) pairs, earliest first; ties in the order they were added.

    ``is_current(deadline, target)`` is True while ``target`` still carries
    ``deadline``; entries for which it is False are stale and never come out of
    :meth:`due`.
    """

    __slots__ = ("_compact_at", "_heap", "_tiebreak", "is_current")

    def __init__(self, is_current: Callable[[float, T], bool]) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._tiebreak = itertools.count()
        self._compact_at = COMPACT_FLOOR
        self.is_current = is_current

    def __len__(self) -> int:
        """Entries in the heap, stale ones included (what it costs in memory)."""
        return len(self._heap)

    def add(self, deadline: float, target: T) -> bool:
        """Add one; True when it is now the earliest (a timer must re-arm)."""
        if len(self._heap) >= self._compact_at:
            self.compact()
        heap = self._heap
        earlier = not heap or deadline < heap[0][0]
        heapq.heappush(heap, (deadline, next(self._tiebreak), target))
        return earlier

    def compact(self) -> None:
        """Drop every stale entry; the next compaction waits until the heap doubles.

        One entry is kept per target and deadline: a lease renewed from A to B and
        back to A has two entries at A that both read as current, and a flood of
        such renews must not pile up either. (A throttle waiter carries two
        deadlines at once, its turn and its timeout: both are kept.)"""
        is_current = self.is_current
        kept: list[tuple[float, int, T]] = []
        seen: set[tuple[int, float]] = set()
        for entry in sorted(self._heap):  # by deadline, then order of adding
            target = entry[2]
            mark = (id(target), entry[0])
            if mark not in seen and is_current(entry[0], target):
                seen.add(mark)
                kept.append(entry)
        self._heap = kept  # sorted, hence a heap already
        self._compact_at = max(COMPACT_FLOOR, 2 * len(self._heap))

    def set_order(self) -> dict[T, int]:
        """When each target's current deadline was set, as its entry's tie-break
        count (the first live entry of a target is the one that runs). One pass over
        the heap, no sort: a hand-over sets the deadlines again in this order."""
        is_current = self.is_current
        order: dict[T, int] = {}
        for deadline, tiebreak, target in self._heap:
            if is_current(deadline, target) and tiebreak < order.get(target, tiebreak + 1):
                order[target] = tiebreak
        return order

    def next(self) -> float | None:
        """The earliest deadline (possibly a stale entry's), or None."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterator[tuple[float, T]]:
        """Take out every current entry due by ``now`` (stale ones are dropped on the
        way); entries added meanwhile count too."""
        heap = self._heap
        is_current = self.is_current
        while heap and heap[0][0] <= now:
            deadline, _, target = heapq.heappop(heap)
            if is_current(deadline, target):
                yield deadline, target
