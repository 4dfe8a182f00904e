"""The ordered index of keys that ``ls`` reads: keys by byte order, kept lazily.

``ls jobs/`` must cost O(keys under ``jobs/``), not O(every key), so the keys with a
hold are kept sorted (a :class:`sortedcontainers.SortedList`: a prefix is two
bisections away). Keeping it exact would put an insertion into it on every grant
and a removal on every release, a few microseconds each, on the path that ``g``/``r``
run a hundred thousand times a second. So it is kept lazily:

* a key whose table loses its last hold on it stays in the index, noted *stale*
  in :attr:`KeyIndex.stale` (a dict store, inline, without asking the other table:
  the note means "may be gone"); a key granted again takes its note out (a dict
  ``pop``), and only a key neither noted nor held is inserted (:meth:`KeyIndex.add`).
  So a key used over and over costs two dict operations a hold, and the index
  costs 8 bytes a live key: no set of every key beside the list (that set cost
  about 42 bytes a lock). Every key of the index is live or noted;
* whoever reads the index asks the tables whether each key it meets is still live;
* stale keys are swept away once they outnumber the live keys (plus
  :data:`SWEEP_SLACK`): the engine's deadline timer runs the sweep a slice at a time
  (:meth:`sweep`), so no one request pays for it. A sweep takes each stale key out of
  the list once, so its cost, spread over the new keys that made it due, is a
  constant per new key.

After a hand-over the successor does not sort its million keys inside the pause: the
index is marked :attr:`rebuild` and is built from the tables by the first reader
(:meth:`ensure`).

Pure: no trio, no clock; the engine tells it which keys are live.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from sortedcontainers import SortedList

#: Stale keys tolerated beyond the live ones before a sweep is due: a small table is
#: never swept for a handful of keys.
SWEEP_SLACK = 4096
#: Keys read from the index at a time: what a reader holds between two looks, so a
#: reader streaming a million keys holds this many, not a million.
BATCH = 256


class KeyIndex:
    """Keys that had a hold since the last sweep, in byte order (see the module
    docstring): the live keys and the :attr:`stale` ones."""

    __slots__ = ("ordered", "rebuild", "stale", "sweeping")

    def __init__(self) -> None:
        self.ordered: SortedList[bytes] = SortedList()
        #: Keys in :attr:`ordered` that may have no hold now (the engine stores
        #: them inline as a table lets a key go, and pops them as one takes it).
        self.stale: dict[bytes, None] = {}
        #: The index must be built from the tables before it is read (a hand-over's
        #: successor: its tables were restored without it).
        self.rebuild = False
        #: A sweep is under way (:meth:`sweep` takes stale keys out a slice a time).
        self.sweeping = False

    def __len__(self) -> int:
        return len(self.ordered)

    def add(self, key: bytes, live: int) -> bool:
        """Index a key that is neither in the index nor stale; ``live``: how many keys
        are live now. True when this made a sweep due (the caller wakes its timer)."""
        self.ordered.add(key)
        if self.sweeping or len(self.stale) <= live + SWEEP_SLACK:
            return False
        self.sweeping = True
        return True

    def ensure(self, keys: Callable[[], Iterable[bytes]]) -> None:
        """Build the index from ``keys()`` (every live key) if it is marked
        :attr:`rebuild`; a no-op otherwise."""
        if self.rebuild:
            self.rebuild = False
            self.stale.clear()  # in place: the engine holds this dict
            self.ordered = SortedList(keys())
            self.sweeping = False

    def starting_with(self, prefix: bytes) -> Iterator[list[bytes]]:
        """The indexed keys that start with ``prefix``, in byte order, a batch at a
        time. Each batch is read afresh after the one before (from just past its last
        key), so the index may change between batches: a key present throughout is
        met exactly once, as with ``d``."""
        ordered_after = self.ordered.irange
        batch = list(itertools.islice(ordered_after(prefix), BATCH))
        while batch:
            if not batch[-1].startswith(prefix):
                yield [key for key in batch if key.startswith(prefix)]
                return
            yield batch
            last = batch[-1]
            batch = list(
                itertools.islice(self.ordered.irange(last, inclusive=(False, True)), BATCH)
            )

    def keys_after(self, prefix: bytes, after: bytes | None, count: int) -> list[bytes]:
        """Up to ``count`` indexed keys that start with ``prefix``, in byte order, from
        the first (``after`` None) or just past ``after``: a reader that goes on from
        its last key meets every key indexed before it gets there, one batch held at
        a time (a ``watch`` snapshot, :func:`elockd.engine.watchers.snapshot`)."""
        ordered = self.ordered
        start = (
            ordered.irange(prefix)
            if after is None
            else ordered.irange(after, inclusive=(False, True))
        )
        within = itertools.takewhile(lambda key: key.startswith(prefix), start)
        return list(itertools.islice(within, count))

    def sweep(self, is_live: Callable[[bytes], bool], budget: int) -> bool:
        """Take up to ``budget`` stale keys out of the index; True while the sweep
        has more to do."""
        if not self.sweeping:
            return False
        stale, ordered = self.stale, self.ordered
        while stale and budget:
            key = next(iter(stale))
            del stale[key]
            if not is_live(key):  # a note may be of a key the other table holds
                ordered.discard(key)  # absent while a rebuild is pending
            budget -= 1
        if stale:
            return True
        self.sweeping = False
        return False
