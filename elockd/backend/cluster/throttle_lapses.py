"""Which TATs of a node's throttle copy have lapsed, kept up as the wall clock passes
rather than counted over every key each time.

``--max-throttles`` is checked on every request for a key with no state, and the
sweep looks for lapsed TATs every second. Counting them over the whole copy took
24 ms of the node's only thread per check at a million keys (2.3 ms at 100,000),
so a client sending new keys stalled every other client of the node. Here each
check costs the keys that lapsed since the last one, and the sweep reads only the
lapsed keys.

Pure: no I/O, times passed in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class Lapses:
    """The keys whose TAT had passed at the latest wall time :meth:`advance` was
    given (:attr:`lapsed`), and when each other key's TAT comes due.

    The book tells it every TAT it sets (:meth:`set`) and drops (:meth:`forget`).
    At most one entry per key is due at a time, unless a key's TAT went back (an
    older write applied after a newer note), which leaves one stale entry behind.
    """

    def __init__(self) -> None:
        self._due: list[tuple[float, bytes]] = []  # a heap of (TAT, key)
        self._queued: dict[bytes, float] = {}  # key -> the TAT of its live heap entry
        self.lapsed: set[bytes] = set()
        self._wall = -math.inf  # the latest wall time advanced to

    def clear(self) -> None:
        self._due.clear()
        self._queued.clear()
        self.lapsed.clear()

    def set(self, key: bytes, tat: float) -> None:
        """``key``'s TAT is now ``tat``."""
        if tat <= self._wall:
            self.lapsed.add(key)
            return
        self.lapsed.discard(key)
        queued = self._queued.get(key)
        if queued is None or tat < queued:
            # A later TAT than the queued one is found when that entry comes due.
            heapq.heappush(self._due, (tat, key))
            self._queued[key] = tat

    def forget(self, key: bytes) -> None:
        """``key`` has no TAT any more (its heap entry is dropped when it comes due)."""
        self.lapsed.discard(key)

    def advance(self, wall: float, tat_of: Callable[[bytes], float | None]) -> None:
        """Bring :attr:`lapsed` to ``wall``; ``tat_of`` gives a key's TAT now, None
        for a key with none. A wall clock stepped back returns the keys whose TAT
        is later than ``wall`` to the heap."""
        if wall < self._wall:
            self._wall = wall
            for key in list(self.lapsed):
                tat = tat_of(key)
                if tat is not None and tat > wall:
                    self.set(key, tat)
        self._wall = wall
        due, queued = self._due, self._queued
        while due and due[0][0] <= wall:
            entry_tat, key = heapq.heappop(due)
            if queued.get(key) != entry_tat:
                continue  # superseded by an earlier entry, or already handled
            del queued[key]
            tat = tat_of(key)
            if tat is None:
                continue
            if tat <= wall:
                self.lapsed.add(key)
            else:
                heapq.heappush(due, (tat, key))
                queued[key] = tat
