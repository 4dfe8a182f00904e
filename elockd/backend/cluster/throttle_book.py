"""A node's copy of the cluster's throttle keys, and the cluster's admission rule.

Pure: no I/O, no trio, times passed in. The node's watch feeds :class:`ThrottleBook`
every change under ``<root>t/`` (through :class:`~.mirror.QueueMirror`, which sees
the whole prefix), so it holds, as of the mirror's revision, each key's TAT (on the
wall clock: nodes share no monotonic clock) with the revision that wrote it, and
each key's line of waiters ordered by create revision, as lock queues are.

A line may be ``--max-waiters`` long, so a request behind it does not walk it: each
line's fold (every waiter admitted at its earliest, :class:`Tail`) is kept with the
copy of its waiters (:class:`Waiters`) and extended as waiters join at its end; a
leave, or a join out of order (a reload), sets the copy aside and the next request
that needs it walks the line once, as :mod:`elockd.engine.throttles` does.

The rule, on top of :func:`elockd.engine.gcra.judge` (docs/cluster.md, "Throttles
on a cluster"):

* a request that does not wait is judged by the GCRA only while the line is empty;
  with waiters in line it is refused (it never overtakes them), its ``retry`` the
  time until it would pass after them (:func:`judge_in_line`);
* only the head of the line may be admitted, at :func:`~elockd.engine.gcra.admit_at`
  of its own rate (:func:`head_turn`); a later, cheaper waiter waits behind it.

Whatever this copy says, etcd decides: an admission is a compare-and-swap of the TAT
(and, for a waiter, a compare that it heads its line) in one transaction. The copy
only saves a round trip on a refusal it proves: a key's effective TAT,
``max(TAT, now)``, never goes back, so a TAT that refuses on a copy that trails
etcd refuses on etcd too.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

from elockd.backend.cluster.etcd.client import KeyValue
from elockd.backend.cluster.layout import Layout, parse_tat_value, parse_waiter_value
from elockd.backend.cluster.throttle_lapses import Lapses
from elockd.engine.gcra import Rate, Verdict, admit_at, judge
from elockd.engine.line_grace import Head
from elockd.engine.line_grace import Step as Ahead

#: No state: judged as a TAT in the past.
NO_TAT = float("-inf")


def behind(tat: float, now: float, rate: Rate, ahead: Collection[Ahead]) -> Verdict:
    """The 409 of a request that comes after the waiters ``ahead`` (oldest first),
    each admitted at its earliest: ``retry`` until its own turn, ``reset`` as the
    key is now (the in-memory engine's rule, :mod:`elockd.engine.throttles`).
    O(1) on a :class:`Waiters` whose fold is kept for ``tat``; else it walks them."""
    reset = max(tat - now, 0.0)
    if isinstance(ahead, Waiters):
        when, tat = ahead.end(tat, now)
    else:
        when, tat = walk(tat, now, ahead)
    mine = max(when, admit_at(tat, rate))
    return Verdict(False, rate.burst, 0, reset, mine - now)


def walk(tat: float, now: float, ahead: Iterable[Ahead]) -> tuple[float, float]:
    """The fold itself, from ``now``: (the last waiter's turn, the TAT after it)."""
    when = now
    for units, capacity in ahead:
        when = max(when, tat + units - capacity)
        tat = max(tat, when) + units
    return when, tat


class Tail(NamedTuple):
    """Where a line ends if every waiter is admitted at its earliest, from a key at
    ``tat``: :func:`walk` from ``-inf``. For any ``now`` up to ``first``, the
    head's turn, the walk from ``now`` lands on ``first`` at its first step and then
    takes the same steps, so it ends at (``when``, ``end``) too, float for float."""

    tat: float
    first: float
    when: float
    end: float


class Waiters:
    """A line's waiters as one look saw them, oldest first, with their fold kept.

    A snapshot: it never changes. Snapshots of one line share a list that is only
    ever appended to (each reads its first ``len`` items), so a join makes the next
    snapshot in O(1) and extends the kept :class:`Tail` by one step; anything else
    makes a new list."""

    __slots__ = ("_items", "_length", "_tail")

    def __init__(self, items: list[Ahead] | None = None) -> None:
        self._items: list[Ahead] = [] if items is None else items
        self._length = len(self._items)
        self._tail: Tail | None = None

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Ahead]:
        if len(self._items) == self._length:
            return iter(self._items)
        return islice(self._items, self._length)

    def __contains__(self, item: object) -> bool:
        return any(item == waiter for waiter in self)

    @staticmethod
    def _of(items: list[Ahead], length: int, tail: Tail | None) -> Waiters:
        made = Waiters.__new__(Waiters)
        made._items, made._length, made._tail = items, length, tail
        return made

    def prefix(self, length: int) -> Waiters:
        """The first ``length`` waiters (the ones ahead of a waiter), in O(1)."""
        return self if length >= self._length else Waiters._of(self._items, length, None)

    def joined(self, units: float, capacity: float) -> Waiters:
        """These waiters and one more at the end; the kept fold takes its step."""
        items = self._items
        if len(items) != self._length:  # a later snapshot grew the list: a copy
            items = items[: self._length]
        items.append((units, capacity))
        tail = self._tail
        if tail is not None:
            when = max(tail.when, tail.end + units - capacity)
            first = when if self._length == 0 else tail.first
            tail = Tail(tail.tat, first, when, max(tail.end, when) + units)
        return Waiters._of(items, self._length + 1, tail)

    def fold(self, tat: float) -> Tail:
        """The fold from a key at ``tat``: the kept one, or walked once and kept."""
        tail = self._tail
        if tail is None or tail.tat != tat:
            first: float | None = None
            when, end = -math.inf, tat
            for units, capacity in self:
                when = max(when, end + units - capacity)
                if first is None:
                    first = when
                end = max(end, when) + units
            tail = self._tail = Tail(tat, math.inf if first is None else first, when, end)
        return tail

    def end(self, tat: float, now: float) -> tuple[float, float]:
        """:func:`walk` of these waiters from ``now`` on a key at ``tat``: the kept
        fold while ``now`` is not past the head's turn, else the walk itself (the
        head is late: its node is about to admit it, which changes the TAT)."""
        if not self._length:
            return now, tat
        tail = self._tail
        if tail is None or tail.tat != tat:
            units, capacity = self._items[0]
            if now > tat + units - capacity:  # the head's turn, as the walk has it
                return walk(tat, now, self)
            tail = self.fold(tat)
        if now <= tail.first:
            return tail.when, tail.end
        return walk(tat, now, self)


def judge_in_line(
    tat: float, now: float, rate: Rate, ahead: Collection[Ahead]
) -> tuple[Verdict, float]:
    """A request on a key at ``tat`` whose line holds ``ahead``: (verdict, TAT
    after). With anyone in line it is refused: it never overtakes them. A peek
    answers as :func:`~elockd.engine.gcra.judge` does, whoever waits."""
    if not ahead or rate.cost == 0:
        return judge(tat, now, rate)
    return behind(tat, now, rate, ahead), tat


def head_turn(tat: float, now: float, rate: Rate) -> tuple[Verdict | None, float, float]:
    """The head of a line, at ``now``: (its verdict, the TAT after it, ``now``) if
    admitted now, else (None, ``tat``, the time it is due)."""
    verdict, after = judge(tat, now, rate)
    if verdict.admitted:
        return verdict, after, now
    return None, tat, admit_at(tat, rate)


@dataclass(frozen=True, slots=True)
class Tat:
    """A key's TAT as etcd has it: the value, the revision that wrote it (the
    compare of the next swap), its writer (who deletes it once it lapses)."""

    tat: float
    revision: int
    writer: str
    since: float = NO_TAT  # the writer's wall clock when it wrote (the head's since)


@dataclass(frozen=True, slots=True)
class LineEntry:
    etcd_key: bytes
    revision: int  # create revision: the place in line
    units: float  # N·T of the waiter's own rate
    capacity: float  # B·T of it
    lease: int
    node: str


class Line:
    """One key's waiters, oldest first."""

    __slots__ = ("_waiters", "entries", "revisions")

    def __init__(self) -> None:
        self.revisions: list[int] = []
        self.entries: dict[int, LineEntry] = {}
        #: The waiters as :class:`Waiters` (None: set aside, made again when asked).
        self._waiters: Waiters | None = Waiters()

    def add(self, entry: LineEntry) -> None:
        """A waiter joins: at the end (the watch's order), its step goes on the kept
        fold; anywhere else (a reload reads the line in key order) the kept copy is
        set aside."""
        revisions, revision = self.revisions, entry.revision
        if not revisions or revision > revisions[-1]:
            revisions.append(revision)
            if self._waiters is not None:
                self._waiters = self._waiters.joined(entry.units, entry.capacity)
        else:
            insort(revisions, revision)
            self._waiters = None
        self.entries[revision] = entry

    def remove(self, revision: int) -> None:
        del self.entries[revision]
        del self.revisions[bisect_left(self.revisions, revision)]
        self._waiters = None

    def waiters(self) -> Waiters:
        """Every waiter, as a snapshot later changes leave alone."""
        waiters = self._waiters
        if waiters is None:
            entries = self.entries
            waiters = self._waiters = Waiters(
                [(entries[r].units, entries[r].capacity) for r in self.revisions]
            )
        return waiters

    def heads(self, count: int) -> tuple[Head, ...]:
        """The first ``count`` entries' (etcd key, create revision, node)."""
        entries = self.entries
        return tuple((entries[r].etcd_key, r, entries[r].node) for r in self.revisions[:count])

    def ahead(self, revision: int, *, skip: int = 0) -> Collection[Ahead]:
        """The waiters older than ``revision`` (but ``skip``), oldest first."""
        if not skip:
            return self.waiters().prefix(bisect_left(self.revisions, revision))
        found = []
        for r in self.revisions:
            if r >= revision:
                break
            if r != skip:
                entry = self.entries[r]
                found.append((entry.units, entry.capacity))
        return found


class ThrottleBook:
    """Every throttle key under a layout's root, as of the mirror's revision."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.tats: dict[bytes, Tat] = {}
        self.lines: dict[bytes, Line] = {}
        self._located: dict[bytes, tuple[bytes, int]] = {}  # waiter key -> (key, revision)
        self.waiting = 0
        self._lapses = Lapses()
        self._waiting_only = 0  # keys with a line and no TAT
        #: Waiter entries this node's own txn deleted before the watch showed the
        #: delete (-> its revision): an older put of one the watch brings is not
        #: let back in.
        self._gone: dict[bytes, int] = {}
        #: Called with a key whenever its TAT or line changes: wakes local waiters.
        self.listeners: dict[bytes, set[Callable[[], None]]] = {}

    def clear(self) -> None:
        self.tats.clear()
        self.lines.clear()
        self._located.clear()
        self.waiting = 0
        self._lapses.clear()
        self._waiting_only = 0
        self._gone.clear()
        for key in list(self.listeners):
            self._changed(key)

    def owns(self, etcd_key: bytes) -> bool:
        return etcd_key.startswith(self.layout.throttles)

    def put(self, kv: KeyValue) -> None:
        parsed = self.layout.parse_throttle(kv.key)
        if parsed is None:
            return
        key, waiter = parsed
        if waiter is None:
            tat, writer, since = parse_tat_value(kv.value)
            self.wrote(key, tat, kv.mod_revision, writer, since)
            return
        if kv.key not in self._located and kv.key not in self._gone:
            node, units, capacity = parse_waiter_value(kv.value)
            line = self.lines.get(key)
            if line is None:
                line = self.lines[key] = Line()
                if key not in self.tats:
                    self._waiting_only += 1
            line.add(LineEntry(kv.key, kv.create_revision, units, capacity, kv.lease, node))
            self._located[kv.key] = (key, kv.create_revision)
            self.waiting += 1
        self._changed(key)

    # A node's own writes, noted when etcd answers rather than when the watch brings
    # them: the node's next request on the key, and its counts for --max-throttles
    # and --max-waiters, read its own writes, as one server does. Every change the
    # watch brings is older or newer by its revision, and an older one never undoes
    # a note.

    def wrote(
        self, key: bytes, tat: float, revision: int, writer: str, since: float = NO_TAT
    ) -> None:
        """The TAT written at ``revision`` (at ``since`` by its writer's clock): by
        this node's own txn, or as the watch brings it (:meth:`put`). One older than
        the copy's is left out."""
        found = self.tats.get(key)
        if found is not None and found.revision > revision:
            return
        if found is None and key in self.lines:
            self._waiting_only -= 1
        self.tats[key] = Tat(tat, revision, writer, since)
        self._lapses.set(key, tat)
        self._changed(key)

    def joined(self, kv: KeyValue, seen_up_to: int) -> None:
        """The line entry this node's own txn put; ``seen_up_to``, the revision the
        watch has brought: one it has brought (and maybe its delete) is left alone."""
        if kv.create_revision > seen_up_to:
            self.put(kv)

    def left(self, etcd_key: bytes, revision: int, seen_up_to: int) -> None:
        """The line entry this node's own txn deleted at ``revision``."""
        if revision <= seen_up_to:
            return  # the watch brought the delete already
        self._gone[etcd_key] = revision
        self._drop_waiter(etcd_key)

    def delete(self, etcd_key: bytes, revision: int = 1 << 62) -> None:
        """A delete the watch brought at ``revision`` (a reload's has none)."""
        parsed = self.layout.parse_throttle(etcd_key)
        if parsed is None:
            return
        key, waiter = parsed
        if waiter is None:
            found = self.tats.get(key)
            if found is None or found.revision > revision:
                return  # gone already, or this node's own swap noted a newer TAT
            del self.tats[key]
            self._lapses.forget(key)
            if key in self.lines:
                self._waiting_only += 1
            self._changed(key)
        else:
            self._gone.pop(etcd_key, None)
            self._drop_waiter(etcd_key)

    def _drop_waiter(self, etcd_key: bytes) -> None:
        where = self._located.pop(etcd_key, None)
        if where is None:
            return
        key = where[0]
        line = self.lines[key]
        line.remove(where[1])
        if not line.revisions:
            del self.lines[key]
            if key not in self.tats:
                self._waiting_only -= 1
        self.waiting -= 1
        self._changed(key)

    def _changed(self, key: bytes) -> None:
        for wake in list(self.listeners.get(key, ())):
            wake()

    def listen(self, key: bytes, wake: Callable[[], None]) -> None:
        self.listeners.setdefault(key, set()).add(wake)

    def unlisten(self, key: bytes, wake: Callable[[], None]) -> None:
        listeners = self.listeners.get(key)
        if listeners is not None:
            listeners.discard(wake)
            if not listeners:
                del self.listeners[key]

    # ----------------------------------------------------------------- reads

    def tat(self, key: bytes) -> Tat | None:
        return self.tats.get(key)

    def ahead(self, key: bytes, before: int = 1 << 62, *, skip: int = 0) -> Collection[Ahead]:
        """``key``'s waiters older than ``before`` (all by default; but ``skip``): a
        :class:`Waiters` whose fold is kept, unless ``skip`` is given."""
        line = self.lines.get(key)
        return () if line is None else line.ahead(before, skip=skip)

    def heads(self, key: bytes, count: int) -> tuple[Head, ...]:
        """``key``'s first ``count`` waiters: (etcd key, create revision, node),
        oldest first."""
        line = self.lines.get(key)
        return () if line is None else line.heads(count)

    def line_length(self, key: bytes) -> int:
        line = self.lines.get(key)
        return 0 if line is None else len(line.revisions)

    def head(self, key: bytes) -> LineEntry | None:
        line = self.lines.get(key)
        return None if line is None else line.entries[line.revisions[0]]

    def size(self) -> int:
        """Throttle keys with state (``q``'s ``throttles``): TATs not swept yet
        (lapsed ones go within a second or two) and keys with waiters only."""
        return len(self.tats) + self._waiting_only

    def has_waiter(self, etcd_key: bytes) -> bool:
        return etcd_key in self._located

    def live(self, wall: float) -> int:
        """Keys with state at ``wall``: a TAT not yet lapsed, or waiters. Costs the
        TATs that lapsed since the last call, not the whole copy."""
        self._advance(wall)
        return len(self.tats) - len(self._lapses.lapsed) + self._waiting_only

    def _advance(self, wall: float) -> None:
        tats = self.tats

        def tat_of(key: bytes) -> float | None:
            found = tats.get(key)
            return None if found is None else found.tat

        self._lapses.advance(wall, tat_of)

    def has_state(self, key: bytes, wall: float) -> bool:
        found = self.tats.get(key)
        return (found is not None and found.tat > wall) or key in self.lines

    def lapsed(self, wall: float, node_id: str, orphaned_after: float) -> list[tuple[bytes, Tat]]:
        """TATs to delete at ``wall``: lapsed ones this node wrote, and any lapsed
        for ``orphaned_after`` seconds (their writer may be gone). Reads only the
        lapsed keys."""
        self._advance(wall)
        tats = self.tats
        return [
            (key, found)
            for key in self._lapses.lapsed
            if (found := tats[key]).writer == node_id or found.tat + orphaned_after <= wall
        ]

    def waiters_on(self, lease: int) -> list[LineEntry]:
        return [
            line.entries[revision]
            for line in self.lines.values()
            for revision in line.revisions
            if line.entries[revision].lease == lease
        ]
