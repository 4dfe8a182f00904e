"""Who watches which prefix, and the events each has not been sent yet (``watch``).

Pure: no trio, no I/O. A backend reports every grant and every free here, in the
order they happen; each :class:`Watcher` whose prefix the key starts with gets the
event as its wire line (docs/protocol.md, ``watch``), appended to its unsent
events, and its ``wake`` hook is called so that its connection sends them.

Backend-neutral on purpose: the in-memory engine reports from its lock path, and
a cluster node can report from its mirror of etcd in revision order through the
same two calls (:meth:`Watchers.grant`, :meth:`Watchers.free`), which take plain
values (key, owner, kind, token or holder count) and no engine object.

What it costs the lock path:

* no watcher: nothing but the caller's one test of :attr:`Watchers.active`;
* watchers on other prefixes: one slice and one dict lookup per distinct prefix
  *length* (watchers are kept by prefix, prefixes by length), not a test per
  watcher: 100 watchers on ``job/0/`` .. ``job/99/`` cost two lookups per event;
* a matching watcher: the line is formatted once per event, whoever watches.

A watcher's unsent events are bounded (``limit`` bytes, ``--watch-buffer``): past
it the watcher is *overflowed*: its events are dropped, it leaves the registry (it
hears nothing more) and its connection says ``OVERFLOW`` and closes. So a watcher
that never reads holds at most its limit of the server's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

#: Why a hold was freed, as ``-`` lines name it.
RELEASED = b"released"
EXPIRED = b"expired"
ORPHANED = b"orphaned"
KILLED = b"killed"

SYNCED = b"SYNCED\r\n"
OVERFLOW = b"OVERFLOW\r\n"


def grant_line(key: bytes, owner: bytes, shared: bool, number: int) -> bytes:
    """``+ K exclusive OWNER token=T`` or ``+ K shared OWNER holders=N``."""
    if shared:
        return b"+ %s shared %s holders=%d\r\n" % (key, owner, number)
    return b"+ %s exclusive %s token=%d\r\n" % (key, owner, number)


def free_line(key: bytes, owner: bytes, shared: bool, holders: int, why: bytes) -> bytes:
    """``- K exclusive OWNER WHY`` or ``- K shared OWNER holders=N WHY`` (N: after)."""
    if shared:
        return b"- %s shared %s holders=%d %s\r\n" % (key, owner, holders, why)
    return b"- %s exclusive %s %s\r\n" % (key, owner, why)


class Watcher:
    """One ``watch``: its prefix and the event lines not yet sent.

    ``unsent`` counts the bytes of events appended and not yet sent (those in
    ``lines`` and those its connection has taken but not yet seen go out): the
    connection lowers it by :meth:`sent` once a send returns. While the snapshot is
    being sent, ``unsynced`` holds the keys of the batch it read that it has still
    to show, and ``horizon`` the last key of that batch (None: no key is read after
    it): events on those keys, and on keys past the horizon, are dropped, since the
    snapshot shows those keys as they are when their turn comes (see
    :func:`snapshot`)."""

    __slots__ = (
        "horizon",
        "limit",
        "lines",
        "overflowed",
        "prefix",
        "unsent",
        "unsynced",
        "wake",
    )

    def __init__(self, prefix: bytes, limit: int) -> None:
        self.prefix = prefix
        self.limit = limit
        self.lines: list[bytes] = []
        self.unsent = 0
        self.overflowed = False
        self.unsynced: set[bytes] | None = None
        self.horizon: bytes | None = None
        #: Called when the first event of a batch arrives, or on overflow.
        self.wake: Callable[[], None] | None = None

    def sent(self, size: int) -> None:
        """``size`` bytes of taken events went out."""
        self.unsent -= size

    def push(self, key: bytes, line: bytes) -> bool:
        """Append one event on ``key``; False when it overflowed the watcher (the
        caller drops it from the registry)."""
        unsynced = self.unsynced
        if unsynced is not None and (
            key in unsynced or (self.horizon is not None and key > self.horizon)
        ):
            return True  # the snapshot will show this key as it is then
        self.unsent += len(line)
        if self.unsent > self.limit:
            self.overflowed = True
            self.lines = []
            if self.wake is not None:
                self.wake()
            return False
        was_empty = not self.lines
        self.lines.append(line)
        if was_empty and self.wake is not None:
            self.wake()
        return True


class TooManyWatchers(Exception):
    """``--max-watchers`` watch already."""


class Watchers:
    """The registry: every watcher, kept by prefix; see the module docstring."""

    __slots__ = ("_by_prefix", "_head", "_heads", "_lengths", "active", "count")

    def __init__(self) -> None:
        #: The lock path's one test: False while nobody watches.
        self.active = False
        self.count = 0
        self._by_prefix: dict[bytes, list[Watcher]] = {}
        self._lengths: tuple[int, ...] = ()
        # The quick reject: every prefix's first _head bytes (the shortest prefix's
        # length). A key whose head is none of them matches no watcher: one slice
        # and one set lookup, however many watchers and prefix lengths there are.
        self._head = 0
        self._heads: frozenset[bytes] = frozenset({b""})

    def add(self, prefix: bytes, limit: int, most: int) -> Watcher:
        """Register a watcher of ``prefix`` (at most ``most`` at once, else
        :class:`TooManyWatchers`), with at most ``limit`` bytes of unsent events."""
        if self.count >= most:
            raise TooManyWatchers
        watcher = Watcher(prefix, limit)
        self.adopt(watcher)
        return watcher

    def adopt(self, watcher: Watcher) -> None:
        """Register an existing watcher (one a hand-over brought, with its events)."""
        self._by_prefix.setdefault(watcher.prefix, []).append(watcher)
        self.count += 1
        self._reindex()

    def remove(self, watcher: Watcher) -> None:
        """Forget a watcher (its connection ended, or it overflowed); idempotent."""
        group = self._by_prefix.get(watcher.prefix)
        if group is None or watcher not in group:
            return
        group.remove(watcher)
        if not group:
            del self._by_prefix[watcher.prefix]
        self.count -= 1
        self._reindex()

    def all(self) -> list[Watcher]:
        """Every registered watcher (a hand-over moves them)."""
        return [w for group in self._by_prefix.values() for w in group]

    def _reindex(self) -> None:
        self._lengths = tuple(sorted({len(prefix) for prefix in self._by_prefix}))
        self._head = self._lengths[0] if self._lengths else 0
        self._heads = frozenset(prefix[: self._head] for prefix in self._by_prefix)
        self.active = bool(self._by_prefix)

    def matching(self, key: bytes) -> list[Watcher] | None:
        """The watchers of ``key`` (None: nobody), for :meth:`send`. The engine asks
        this first, so that a key nobody watches costs no line and no owner."""
        if key[: self._head] not in self._heads:
            return None
        by_prefix, found = self._by_prefix, None
        size = len(key)
        for length in self._lengths:
            if length > size:
                break
            group = by_prefix.get(key[:length])
            if group is not None:
                found = group if found is None else [*found, *group]
        return found

    def send(self, watchers: list[Watcher], key: bytes, line: bytes) -> None:
        """Queue one event line on ``key`` to ``watchers`` (from :meth:`matching`)."""
        overflowed = [w for w in watchers if not w.push(key, line)]
        for watcher in overflowed:
            self.remove(watcher)

    def grant(self, key: bytes, owner: bytes, shared: bool, number: int) -> None:
        """A hold was granted: ``number`` is its fencing token (exclusive) or the
        holders after it (shared)."""
        watchers = self.matching(key)
        if watchers is not None:
            self.send(watchers, key, grant_line(key, owner, shared, number))

    def free(self, key: bytes, owner: bytes, shared: bool, holders: int, why: bytes) -> None:
        """A hold was freed, for ``why``; ``holders``: shared holders left."""
        watchers = self.matching(key)
        if watchers is not None:
            self.send(watchers, key, free_line(key, owner, shared, holders, why))


#: Keys a snapshot reads at a time: what it holds of the key space meanwhile.
SNAPSHOT_BATCH = 256


def snapshot(
    watcher: Watcher,
    read: Callable[[bytes | None, int], list[bytes]],
    lines_of: Callable[[bytes], Iterable[bytes]],
) -> Iterator[bytes]:
    """The ``+`` lines of the holds under the watcher's prefix, each key's read when
    its turn comes, then ``SYNCED``; call it in the step that registers the watcher.

    ``read(after, count)`` gives up to ``count`` keys under the prefix in byte order
    from just past ``after`` (None: from the first): every key held then among them.
    The snapshot reads :data:`SNAPSHOT_BATCH` keys at a time, so it holds one batch,
    not the key space (a watcher of a million keys would hold tens of MB, outside
    ``--watch-buffer``), and costs the keys under its prefix.

    While it runs, an event on a key it has still to show is dropped: a key of the
    batch not shown yet, or a key past the batch's last one, which a later read
    meets if it is still held. Every other event (a key shown, or new within a
    stretch already read) is queued. So the snapshot and the events after it add
    up to the tables exactly, nothing missed and nothing twice, however long the
    snapshot takes to send."""
    watcher.unsynced, watcher.horizon = set(), b""  # nothing read: every key is ahead
    return _snapshot_lines(watcher, read, lines_of)


def _snapshot_lines(
    watcher: Watcher,
    read: Callable[[bytes | None, int], list[bytes]],
    lines_of: Callable[[bytes], Iterable[bytes]],
) -> Iterator[bytes]:
    after: bytes | None = None
    try:
        while True:
            batch = read(after, SNAPSHOT_BATCH)
            last = len(batch) < SNAPSHOT_BATCH  # no key past it: none is ahead now
            pending = set(batch)
            watcher.unsynced, watcher.horizon = pending, None if last else batch[-1]
            for key in batch:
                pending.discard(key)
                yield from lines_of(key)
            if last:
                break
            after = batch[-1]
    finally:
        watcher.unsynced = watcher.horizon = None
    yield SYNCED
