"""``ls``, ``watch`` and ``kill`` on a cluster node (docs/cluster.md, "Operators on
a cluster").

``ls`` and ``watch`` read the node's mirror of the queues (:mod:`.mirror`); ``ls``
first waits for it to reach etcd's revision (one count-only read), ``watch`` costs
etcd nothing. The mirror says, after each revision its watch brings, which entries
began and stopped holding in it (every node sees the same revisions in the same
order), and this module turns that into:

* the ``+``/``-`` lines of this node's watchers (``books.watchers``), in etcd's
  revision order, whichever node the change came through;
* this node's own holds that etcd freed under it (an operator's ``kill`` through
  any node): dropped from the books and logged, so that the evicted session sees
  the key as not held (``token`` and ``unlock`` answer 403);
* ``ls`` rows and the snapshot a new watcher starts with.

While a hand-over copies the books (``calls.frozen``), the lines are held back and
the books are left alone: the successor goes on from the revision the watchers had
reached (:meth:`ClusterOperators.freeze`), and a failed hand-over sends the lines
held back and drops what was freed meanwhile (:meth:`ClusterOperators.thaw`).

``kill K`` is one etcd txn (:meth:`ClusterOperators.kill`): it does not delete K's
holding entries but rewrites each in place, marked killed (:func:`.layout.killed_value`,
guarded by its create revision, on the lease it had), and writes ``<root>meta/killed``
naming them. A marked entry keeps its place at the head of its queue, so no node
grants the key behind it yet. The node whose lease it is on sees the mark through
its watch (:meth:`ClusterOperators.marked`), drops the hold from its books (the
session sees the key as not held) and only then deletes the entry: that delete is
its acknowledgement, and the next waiter is granted on it. A node cut from etcd
never acknowledges; its entries go when etcd lapses its lease, after the node's own
deadline has passed (docs/cluster.md, "An operator's kill").
"""

from __future__ import annotations

import logging
from dataclasses import replace

import trio

from elockd.backend.cluster.etcd.client import (
    compare_create,
    compare_mod,
    prefix_end,
    put_op,
)
from elockd.backend.cluster.layout import (
    EXCLUSIVE,
    SHARED,
    EntryValue,
    encode_entry_value,
    killed_value,
)
from elockd.backend.cluster.ledger import ClusterHold, Ledger
from elockd.backend.cluster.mirror import (
    ClusterWaiter,
    Entry,
    Freed,
    Granted,
    Queue,
    QueueId,
    QueueMirror,
)
from elockd.backend.cluster.records import SessionRecords
from elockd.backend.cluster.tokens import fencing_token
from elockd.backend.interface import BackendUnavailable, Evicted, KeyRow, KeyRows
from elockd.backend.rows import rows_in_batches
from elockd.engine.watchers import KILLED, free_line, grant_line
from elockd.observe.logs import shown
from elockd.observe.logthrottle import LogThrottle

log = logging.getLogger("elockd.cluster")
#: A node resumed from a pause past its lease sees every entry of it go at once:
#: one line per 10 s, with a count.
evicted_log = LogThrottle(log, logging.WARNING, 10.0)

#: Holds one ``kill`` txn marks: with their compares and the marker, well within
#: etcd's 128 operations per txn (--max-txn-ops). More go in further txns.
KILLS_PER_TXN = 100
#: Attempts of a ``kill`` whose key keeps changing under it before it fails closed.
KILL_TRIES = 16


class ClusterOperators:
    """The operators' view of a cluster node: see the module docstring."""

    def __init__(self, ledger: Ledger, mirror: QueueMirror, records: SessionRecords) -> None:
        self.ledger, self.mirror, self.records = ledger, mirror, records
        self.calls, self.layout = records.calls, records.layout
        mirror.on_changes = self.changed
        mirror.on_killed = self.marked
        #: Killed entries on this node's lease whose holds are dropped here, to be
        #: deleted (the acknowledgement), by (etcd key, create revision).
        self.acks: list[tuple[bytes, int]] = []
        self._ack_wanted = trio.Event()
        #: The entries each ``kill`` running here waits to see go, and its wake-up.
        self._kills: list[tuple[set[tuple[bytes, int]], trio.Event]] = []
        #: Lines held back while a hand-over copies the books: (key, line).
        self.held_back: list[tuple[bytes, bytes]] = []
        #: The revision this node's watchers had reached when the books were frozen:
        #: a successor replays from just after it (see .state).
        self.frozen_at = 0

    # ------------------------------------------------------------- changes

    def changed(self, freed: list[Freed], granted: list[Granted]) -> None:
        """The holds a revision ended and began (the mirror's hook)."""
        if not self.calls.frozen:
            for queue_id, entry, _, why in freed:
                self._evicted(queue_id[0], queue_id[1], entry, why)
        if self._kills:
            self._kills_see(freed)
        watchers = self.ledger.watchers
        if not watchers.active:
            return
        lines: list[tuple[bytes, bytes]] = []
        for (kind, key), entry, left, why in freed:
            if watchers.matching(key) is not None:
                lines.append((key, free_line(key, entry.owner, kind == SHARED, left, why)))
        for (kind, key), entry, holders in granted:
            if watchers.matching(key) is not None:
                number = holders if kind == SHARED else self.token(entry)
                lines.append((key, grant_line(key, entry.owner, kind == SHARED, number)))
        if self.calls.frozen:
            self.held_back.extend(lines)
        else:
            self._send(lines)

    def _send(self, lines: list[tuple[bytes, bytes]]) -> None:
        watchers = self.ledger.watchers
        for key, line in lines:
            matching = watchers.matching(key)
            if matching is not None:
                watchers.send(matching, key, line)

    def _evicted(self, kind: bytes, key: bytes, entry: Entry, why: bytes) -> None:
        """A hold of this node's books whose entry etcd deleted, or a ``kill`` marked,
        without this node freeing it: drop it, so the session sees the key as not
        held. (The log line says "freed in etcd" of both: for a mark, the free
        that follows once this node lets go.)"""
        session = self.ledger.by_tag.get(entry.tag)
        if session is None:
            return
        hold = (session.shared if kind == SHARED else session.exclusive).get(key)
        if not isinstance(hold, ClusterHold) or hold.revision != entry.revision:
            return
        self.ledger.drop(hold, trio.current_time())
        evicted_log(
            "hold on %r of %s (tag %d) freed in etcd while held here (%s): the session "
            "no longer holds it",
            key[:200],
            shown(session.peer),
            session.tag,
            "killed by an operator" if why == KILLED else f"{why.decode()} elsewhere",
        )

    def marked(self, entries: list[tuple[QueueId, Entry]]) -> None:
        """Holding entries a ``kill`` marked in a revision (the mirror's hook): a hold
        of this node's is dropped from the books, and then, the session no longer
        holding it here, the entry on this node's lease is deleted (the
        acknowledgement that lets the next waiter in). While a hand-over copies the
        books nothing happens here: whoever serves next finds the marks
        (:meth:`drop_vanished`)."""
        if self.calls.frozen or self.calls.handed_over:
            return
        lease = self.records.lease.id
        for (kind, key), entry in entries:
            self._evicted(kind, key, entry, KILLED)
            if lease and entry.lease == lease:
                self._acknowledge(entry)

    def _acknowledge(self, entry: Entry) -> None:
        self.acks.append((entry.etcd_key, entry.revision))
        self._ack_wanted.set()

    async def send_acks(self) -> None:
        """A loop of the node's: delete the killed entries whose holds were dropped
        here, each guarded by its create revision and this node's lease. One etcd
        refuses is left to the stray sweep (no hold owns it), at its next round."""
        while True:
            await self._ack_wanted.wait()
            self._ack_wanted = trio.Event()
            acks, self.acks = self.acks, []
            try:
                await self.records.delete_entries(None, acks)
            except BackendUnavailable:
                log.warning("killed entries not deleted (%d): the sweep deletes them", len(acks))

    def drop_vanished(self) -> None:
        """After the mirror was loaded afresh (or a hand-over froze it): drop every
        hold of this node whose entry the mirror, at its revision, no longer has
        (freed while nobody here was told: a lease lapse, a watch that fell behind),
        or has marked killed; the latter are then acknowledged (:meth:`marked`)."""
        mirror, now = self.mirror, trio.current_time()
        lease = self.records.lease.id
        for session in list(self.ledger.sessions.values()):
            if not session.tag or session.lost:
                continue
            for hold in self.ledger.holds(session):
                if hold.revision > mirror.revision:
                    continue  # granted from a txn the mirror has not reached yet
                kind = SHARED if hold.shared else EXCLUSIVE
                entry = mirror.entry(self.layout.entry(kind, hold.key, session.tag))
                ours = entry if entry is not None and entry.revision == hold.revision else None
                if ours is not None and not ours.killed:
                    continue
                self.ledger.drop(hold, now)
                evicted_log(
                    "hold on %r of %s (tag %d) %s while the node was not watching: the "
                    "session no longer holds it",
                    hold.key[:200],
                    shown(session.peer),
                    session.tag,
                    "killed by an operator" if ours is not None else "gone from etcd",
                )
                if ours is not None and lease and ours.lease == lease:
                    self._acknowledge(ours)  # a mark on this node's lease

    # ------------------------------------------------------------ hand-over

    def freeze(self) -> None:
        """A hand-over copies the books: hold the watchers' lines back from here."""
        self.frozen_at = self.mirror.revision
        self.held_back = []

    def thaw(self) -> None:
        """The hand-over failed: send what was held back, drop what went meanwhile."""
        held, self.held_back = self.held_back, []
        self._send(held)
        self.drop_vanished()

    def overflow_all(self) -> None:
        """Every watcher missed events (the watch fell behind etcd's compaction, or a
        successor could not replay from its predecessor's revision): each gets
        ``OVERFLOW`` and is closed, as one that fell behind would be."""
        watchers = self.ledger.watchers
        for watcher in watchers.all():
            watcher.overflowed = True
            watcher.lines = []
            watchers.remove(watcher)
            if watcher.wake is not None:
                watcher.wake()

    # ------------------------------------------------------------- reading

    def token(self, entry: Entry) -> int:
        return fencing_token(self.ledger.token_floor, entry.revision, entry.rank)

    def _queues(self, key: bytes) -> tuple[Queue | None, Queue | None]:
        queues = self.mirror.queues
        return queues.get((EXCLUSIVE, key)), queues.get((SHARED, key))

    def held(self, key: bytes) -> list[tuple[bytes, Entry]]:
        """(kind, entry) of every hold on ``key`` the mirror shows: the exclusive
        holder first, then the shared holders, oldest first."""
        exclusive, shared = self._queues(key)
        found: list[tuple[bytes, Entry]] = []
        if exclusive is not None and exclusive.head().holding:
            found.append((EXCLUSIVE, exclusive.head()))
        if shared is not None and shared.holding:
            found.extend((SHARED, e) for e in shared.in_order() if e.holding)
        return found

    def watch_keys(self, prefix: bytes, after: bytes | None, count: int) -> list[bytes]:
        """The mirror's lock names under ``prefix`` (O(keys under it)); a name with
        waiters and no hold shows no line."""
        return self.mirror.names.keys_after(prefix, after, count)

    def watch_lines(self, key: bytes) -> list[bytes]:
        lines = []
        count = 0
        for kind, entry in self.held(key):
            if kind == SHARED:
                count += 1
                lines.append(grant_line(key, entry.owner, True, count))
            else:
                lines.append(grant_line(key, entry.owner, False, self.token(entry)))
        return lines

    async def listing(self, prefix: bytes, older: float | None, limit: int | None) -> KeyRows:
        """``ls``, once the mirror shows every change etcd had made when the ``ls``
        came (a lock granted a moment ago, here or on another node, is listed). etcd
        tells its current revision in a read only a member with quorum can answer,
        so a node cut from etcd, or whose watch has stalled on a paused member while
        its lease lives, answers ``Backend Unavailable`` after ``--etcd-timeout``
        rather than rows from a copy that stopped moving."""
        current = await self.calls.revision(self.layout.killed)
        await self.reached(max(current, self.calls.latest))
        return rows_in_batches(self.mirror.names.starting_with(prefix), self.row, older, limit)

    def row(self, key: bytes) -> KeyRow | None:
        """The ``ls`` row of ``key`` as the mirror has it (None: no entry). The age is
        on the wall clock, from when each hold began (see :mod:`.mirror`); the
        lease left only for this node's own holds, as ``info`` shows it."""
        exclusive, shared = self._queues(key)
        if exclusive is None and shared is None:
            return None
        row = KeyRow(key, None, 0, 0, None, None, None)
        since: list[float] = []
        if exclusive is not None:
            head = exclusive.head()
            row.waiting = len(exclusive.revisions)
            if head.holding:
                row.waiting -= 1
                row.owner, row.token = head.owner, self.token(head)
                since.append(head.since)
                local = self.ledger.local_hold(head.tag, key)
                deadline = None if local is None else local.lease_deadline
                if deadline is not None and local is not None and local.revision == head.revision:
                    row.ttl = max(0.0, deadline - trio.current_time())
        if shared is not None:
            row.shared = shared.holding
            row.waiting += len(shared.revisions) - shared.holding
            if shared.holding:
                since.append(min(e.since for e in shared.entries.values() if e.holding))
        if since:
            row.age = max(0.0, self.mirror.wall() - min(since))
        return row

    async def reached(self, revision: int) -> None:
        await mirror_reaches(self.mirror, revision, self.calls.deadline)

    # ---------------------------------------------------------------- kill

    async def kill(self, key: bytes) -> list[Evicted]:
        """Mark every hold on ``key`` killed in one txn (a hundred at a time beyond
        that): the holding entries the mirror shows that no kill marked yet, each
        rewritten in place only if still the one created at its revision, and only
        if no entry of the key was written since the mirror's revision (else the
        mirror is let catch up and it is tried again). A key with no such hold costs
        one read-only txn, which proves it.

        Answers once the marked entries are gone from this node's mirror (their
        nodes acknowledged, or etcd lapsed their leases), or ``--etcd-timeout``
        after the mirror has the marks, whichever comes first: the holds are revoked
        either way (their nodes no longer confirm them, or are past their deadline
        by the time etcd lets the key go), and the key is granted to its next waiter
        as soon as they are gone."""
        queues = [self.layout.queue_prefix(kind, key) for kind in (EXCLUSIVE, SHARED)]
        done: dict[tuple[bytes, int], tuple[bytes, Entry]] = {}
        last = failures = 0
        while True:
            held = [
                (k, e)
                for k, e in self.held(key)
                if not e.killed and (e.etcd_key, e.revision) not in done
            ]
            chunk = held[:KILLS_PER_TXN]
            since = self.mirror.revision
            compares = [compare_mod(q, "<", since + 1, prefix_end(q)) for q in queues]
            compares += [compare_create(e.etcd_key, "==", e.revision) for _, e in chunk]
            ops = []
            if chunk:
                named = b"\n".join(e.etcd_key for _, e in chunk)
                ops = [put_op(self.layout.killed, named)]
                ops += [put_op(e.etcd_key, marked_value(e), ignore_lease=True) for _, e in chunk]
            result = await self.calls.txn(compares, ops)
            if result.succeeded:
                last = result.revision
                done.update(((e.etcd_key, e.revision), (k, e)) for k, e in chunk)
                if len(held) <= KILLS_PER_TXN:
                    break
                # The marks wrote into K's queues: the next txn's guard needs the
                # mirror past them.
                await self.reached(last)
                continue
            failures += 1
            if failures == KILL_TRIES:
                raise BackendUnavailable("kill: the key's holds kept changing")
            await self.reached(result.revision)
        self.ledger.killed += len(done)
        if done:
            await self.reached(last)
            await self._until_gone(list(done))
        return [
            Evicted(e.owner, e.peer, kind == SHARED, 0 if kind == SHARED else self.token(e))
            for kind, e in done.values()
        ]

    async def _until_gone(self, entries: list[tuple[bytes, int]]) -> None:
        """Wait until the mirror no longer has ``entries`` (each an etcd key and its
        create revision), or ``--etcd-timeout``."""
        left = set()
        for etcd_key, revision in entries:
            entry = self.mirror.entry(etcd_key)
            if entry is not None and entry.revision == revision:
                left.add((etcd_key, revision))
        if not left:
            return
        gone = trio.Event()
        waiting = (left, gone)
        self._kills.append(waiting)
        try:
            with trio.move_on_after(self.calls.deadline):
                await gone.wait()
        finally:
            self._kills.remove(waiting)

    def _kills_see(self, freed: list[Freed]) -> None:
        for _, entry, _, _ in freed:
            for left, gone in self._kills:
                left.discard((entry.etcd_key, entry.revision))
                if not left:
                    gone.set()


def marked_value(entry: Entry) -> bytes:
    """The value a kill writes over a holding entry: the one it has, as the mirror
    read it (an address-less value gains its owner as address), marked killed."""
    value = EntryValue(entry.held, entry.limit, entry.ttl, entry.owner, entry.rank, entry.peer)
    return killed_value(encode_entry_value(replace(value, at=entry.at)))


async def mirror_reaches(mirror: QueueMirror, revision: int, timeout: float) -> None:
    """Return once ``mirror`` has applied ``revision`` (at once if it has), or fail
    closed after ``timeout`` (``--etcd-timeout``). A waiter on no queue is what the
    mirror wakes then."""
    if mirror.revision >= revision:
        return
    reached = trio.Event()
    waiter = ClusterWaiter([], 0)
    waiter.revision, waiter.wake = revision, reached.set
    mirror.add_waiter(waiter)
    try:
        with trio.move_on_after(timeout):
            await reached.wait()
            return
    finally:
        mirror.remove_waiter(waiter)
    raise BackendUnavailable("this node's watch is behind etcd")
