"""A node's copy of every lock queue, kept current by its one etcd watch.

Pure: no I/O. The node loads it once from a range read and then feeds it every
watch batch in revision order, so at :attr:`QueueMirror.revision` it equals etcd's
queue tables at that revision. Because it is a whole state and not a stream of
deltas, a waiter needs no registration before it enqueues: it is judged as soon as
the mirror has reached the revision of its own entry, and again whenever an entry
ahead of it goes away.

The grant rule, the same for every node because it reads only etcd's state:
entries in a queue are ordered by ``create_revision`` (the revision of the txn that
enqueued them).

* An exclusive entry holds the lock when it is first in every queue it is in
  (``mlock``). Every waits-for edge points from a younger revision to an older
  one, so multi-key waiters cannot deadlock.
* A shared entry without a limit (``sg``) holds from the start.
* A shared entry with ``limit=N`` may be granted when every older entry with a
  limit holds (no overtaking) and fewer than N entries hold. Its node then marks
  it held in etcd (``h`` in its value) before it answers. The mark makes the grant
  a fact every node reads alike, also a node that joins later: "the entries ahead
  hold" alone is not enough, since an ``sg`` that arrives later holds too. While an
  older limited entry waits, no younger one can be granted, so at the moment of a
  grant the entries that hold are exactly the marked and the unlimited ones.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Sequence

from elockd.backend.cluster.etcd.client import Event, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, EntryValue, Layout, parse_entry_value
from elockd.backend.cluster.throttle_book import ThrottleBook
from elockd.engine.keyindex import KeyIndex
from elockd.engine.watchers import KILLED, ORPHANED, RELEASED

QueueId = tuple[bytes, bytes]  # (kind, lock name)

WAITING = 0
GRANTED = 1
LOST = 2  # its entry vanished before the grant (its node's lease ran out)
CANCELLED = 3


class Entry:
    """One queue entry as the mirror knows it."""

    __slots__ = (
        "at",
        "etcd_key",
        "held",
        "holding",
        "killed",
        "lease",
        "limit",
        "owner",
        "peer",
        "rank",
        "revision",
        "since",
        "tag",
        "ttl",
    )

    def __init__(
        self, etcd_key: bytes, revision: int, tag: int, lease: int, value: EntryValue
    ) -> None:
        self.etcd_key = etcd_key
        self.revision = revision
        self.tag = tag  # the session's, from the key
        self.lease = lease  # the etcd lease of the node serving the session
        self.limit = value.limit
        self.held = value.held
        self.ttl = value.ttl
        self.owner = value.owner
        self.peer = value.peer
        self.rank = value.rank
        self.at = value.at  # wall-clock time of its write, if its node wrote one
        #: Revoked by an operator's ``kill``: it keeps its place (and blocks those
        #: behind it) until its node deletes it or its lease runs out.
        self.killed = value.killed
        #: Whether the mirror has reported it holding (see QueueMirror.on_changes),
        #: and since when (wall clock): what ``ls`` and ``watch`` show.
        self.holding = False
        self.since = 0.0

    @property
    def holds_shared(self) -> bool:
        return self.limit == 0 or self.held


class Queue:
    """The entries of one lock, oldest first, and, for an exclusive lock,
    ``held_up_to``: the create revision of the youngest entry seen holding it and
    then go (no entry older than that may be granted after it: its fencing token
    would go back)."""

    __slots__ = ("entries", "held_up_to", "holding", "revisions")

    def __init__(self) -> None:
        self.revisions: list[int] = []
        self.entries: dict[int, Entry] = {}
        self.held_up_to = 0
        self.holding = 0  # entries reported holding (their ``holding`` flag)

    def add(self, entry: Entry) -> Entry | None:
        """Add or replace (a shared entry marked held, an owner renamed, an entry
        moved to another node's lease); the entry it replaced, whose reported state
        the new one keeps."""
        old = self.entries.get(entry.revision)
        if old is None:
            insort(self.revisions, entry.revision)
        else:
            entry.holding, entry.since = old.holding, old.since
        self.entries[entry.revision] = entry
        return old

    def head(self) -> Entry:
        return self.entries[self.revisions[0]]

    def in_order(self) -> Iterator[Entry]:
        """The entries, oldest first."""
        entries = self.entries
        return (entries[revision] for revision in self.revisions)

    def remove(self, revision: int, *, shared: bool) -> Entry | None:
        """Take out the entry at ``revision``; the entry, or None."""
        entry = self.entries.get(revision)
        if entry is None:
            return None
        if not shared and self.revisions[0] == revision:
            self.held_up_to = max(self.held_up_to, revision)
        del self.entries[revision]
        del self.revisions[bisect_left(self.revisions, revision)]
        return entry

    def granted(self) -> Iterator[Entry]:
        """The entries of a shared queue that hold it."""
        return (e for e in self.entries.values() if e.holds_shared)

    def waiting(self) -> int:
        return sum(1 for e in self.entries.values() if not e.holds_shared)

    def may_grant_shared(self, revision: int, limit: int) -> bool:
        """May the shared entry at ``revision`` with ``limit`` be granted now?"""
        entries = self.entries
        return may_grant_shared(
            [(r, entries[r].limit, entries[r].held) for r in self.revisions], revision, limit
        )


def may_grant_shared(queue: Sequence[tuple[int, int, bool]], revision: int, limit: int) -> bool:
    """The rule for a shared entry with a limit, over a queue of (revision, limit,
    held): every older limited entry holds, and fewer than ``limit`` others hold
    (marked held, or unlimited)."""
    holding = 0
    for other, other_limit, held in queue:
        if other == revision:
            continue
        if other < revision and other_limit and not held:
            return False
        if held or other_limit == 0:
            holding += 1
    return holding < limit


# The same rule over a queue as a range read returns it (oldest first), for the
# answers that come straight from a txn, before the watch brings its events.


def shared_rule_input(kvs: list[KeyValue]) -> list[tuple[int, int, bool]]:
    values = [(kv.create_revision, parse_entry_value(kv.value)) for kv in kvs]
    return [(revision, value.limit, value.held) for revision, value in values]


def granted_kvs(kvs: list[KeyValue]) -> list[KeyValue]:
    """The entries of a shared queue that hold it: marked held, or without a limit."""
    holding = []
    for kv in kvs:
        value = parse_entry_value(kv.value)
        if value.held or value.limit == 0:
            holding.append(kv)
    return holding


def holders_after_handover(kvs: list[KeyValue]) -> int:
    """Holders of a shared queue once the waiters that may now be granted are (the
    in-memory engine hands over before it answers; here their nodes do it a few
    milliseconds later, and the reply counts them already)."""
    queue = shared_rule_input(kvs)
    for index, (revision, limit, held) in enumerate(queue):
        if limit and not held:
            if not may_grant_shared(queue, revision, limit):
                break  # FIFO: nobody behind it goes first
            queue[index] = (revision, limit, True)
    return sum(1 for _, limit, held in queue if held or limit == 0)


class ClusterWaiter:
    """A request whose entries are in etcd and that waits for the mirror to grant it.

    ``revision`` is 0 until the enqueue txn has answered. ``wake`` is called once,
    when the state leaves WAITING for GRANTED or LOST.
    """

    __slots__ = ("limit", "queues", "revision", "state", "wake")

    def __init__(self, queues: list[QueueId], limit: int) -> None:
        self.queues = queues
        self.limit = limit
        self.revision = 0
        self.state = WAITING
        self.wake: Callable[[], None] | None = None


#: A hold that went in a revision: its queue, its entry, the holders its queue
#: had left then (shared), and why it went.
Freed = tuple[QueueId, Entry, int, bytes]
#: A hold that began in a revision: its queue, its entry, the holders after it.
Granted = tuple[QueueId, Entry, int]


class QueueMirror:
    """Every queue entry under a layout's root, as of :attr:`revision`."""

    def __init__(self, layout: Layout, on_other: Callable[[Event], None] | None = None) -> None:
        self.layout = layout
        self.revision = 0
        self.queues: dict[QueueId, Queue] = {}
        self._located: dict[bytes, tuple[QueueId, int]] = {}  # etcd key -> where it is
        # Every entry by its session's tag, then by the request that wrote it (its
        # create revision): its etcd key, or the keys of an ``mlock``'s entries. So
        # finding an entry's siblings costs O(its request), not O(the session).
        self.by_tag: dict[int, dict[int, bytes | list[bytes]]] = {}
        #: lease -> {tag: its entries bound to that lease}: the sessions with entries
        #: on a node's lease, found without a walk of every session in the cluster
        #: (:meth:`tags_on`, the node's sweep).
        self._lease_tags: dict[int, dict[int, int]] = {}
        self._waiters: dict[QueueId, set[ClusterWaiter]] = {}
        self._parked: set[ClusterWaiter] = set()  # revision known, mirror not there yet
        # The parked waiters by queue: what the node's own checks add to the copy's
        # counts (:meth:`unseen_waiting`), in O(1).
        self._parked_on: dict[QueueId, int] = {}
        #: The revision etcd was at when the current watch stream was created: the
        #: events before it are a replay of history (a reconnect), and no waiter is
        #: granted until the mirror has caught up with it (see :meth:`catch_up_to`).
        self.replay_until = 0
        self._deferred: set[ClusterWaiter] = set()  # would be granted, once caught up
        self.on_other = on_other  # events on keys that are not queue entries
        #: The throttle keys (``<root>t/``), fed by the same watch.
        self.throttles = ThrottleBook(layout)
        #: The wall clock: when a hold began, as ``ls`` ages it (on every node alike).
        self.wall: Callable[[], float] = time.time
        #: Told of the holds that began and went in each revision, after it (frees
        #: first); see :meth:`_settle`.
        self.on_changes: Callable[[list[Freed], list[Granted]], None] | None = None
        #: The lock names with an entry, in byte order (``ls``, ``watch``): kept
        #: exact, one insertion per new name and one removal per name gone.
        self.names = KeyIndex()
        # What the revision being applied changed, for _settle.
        self._changed: set[QueueId] = set()
        self._gone: list[tuple[QueueId, Entry, int]] = []
        self._killed_now: set[bytes] = set()  # entries a kill names in this revision
        self._marked: list[tuple[QueueId, Entry]] = []  # entries a kill marked in it
        #: Told, after each revision, of the holding entries a ``kill`` marked in it
        #: (:func:`~.layout.killed_value`): their node drops the holds and
        #: acknowledges (see .operators).
        self.on_killed: Callable[[list[tuple[QueueId, Entry]]], None] | None = None
        self._record_gone = False  # a session record was deleted in this revision
        #: Why this node freed an entry, by (etcd key, create revision), from when
        #: it sends the delete until the mirror sees it (:meth:`freeing`).
        self._why: dict[tuple[bytes, int], bytes] = {}
        self._reset_counts()

    def _reset_counts(self) -> None:
        """The counts `q` and /metrics read, kept on every change so that a scrape
        costs O(1) however many queues there are (a walk took 0.21 s at 200,000)."""
        self.exclusive_queues = 0
        self.shared_queues = 0
        self.exclusive_entries = 0
        self.shared_entries = 0
        self.shared_holding = 0  # shared entries that hold (unlimited, or marked held)

    # ------------------------------------------------------------------ state

    def load(self, revision: int, kvs: Iterable[KeyValue]) -> None:
        """Start over from a range read at ``revision``, then judge every waiter."""
        self.queues.clear()
        self._located.clear()
        self.by_tag.clear()
        self._lease_tags.clear()
        self._deferred.clear()  # judged again below, on the fresh state
        self._reset_counts()
        self.throttles.clear()
        self.names = KeyIndex()
        self._changed.clear()
        self._gone.clear()
        self._marked.clear()  # what a reload finds marked, .operators looks for
        self.revision = revision
        for kv in kvs:
            if self.throttles.owns(kv.key):
                self.throttles.put(kv)
            else:
                self._put(kv)
        # Who holds now, with no changes reported (a reload tells its watchers
        # otherwise, see .operators): a hold's age counts from its entry's write.
        self._changed.update(self.queues)
        self._mark_holders(report=False)
        self._changed.clear()
        self._why = {key: why for key, why in self._why.items() if key[0] in self._located}
        for waiters in list(self._waiters.values()):
            for waiter in list(waiters):
                self._judge(waiter)
        self._unpark()

    def apply(self, events: list[Event]) -> None:
        """One watch batch, in revision order; the waiters a revision may move are
        judged after that revision, before the next one is applied, and the holds it
        began and ended are reported then (:meth:`_settle`)."""
        touched: set[QueueId] = set()
        for event in events:
            kv = event.kv
            if kv.mod_revision > self.revision:
                self._settle()
                if touched or self._parked or self._deferred:
                    self._judge_touched(touched)
                self.revision = kv.mod_revision
            if not kv.key.startswith(self.layout.queues):
                if self.throttles.owns(kv.key):
                    if event.type == "DELETE":
                        self.throttles.delete(kv.key, kv.mod_revision)
                    else:
                        self.throttles.put(kv)
                    continue
                if kv.key == self.layout.killed and event.type != "DELETE":
                    self._killed_now.update(kv.value.split(b"\n"))
                elif event.type == "DELETE" and kv.key.startswith(self.layout.sessions):
                    self._record_gone = True
                if self.on_other is not None:
                    self.on_other(event)
                continue
            if event.type == "DELETE":
                where = self._located.pop(kv.key, None)
                if where is not None:
                    queue_id, revision = where
                    self._remove(queue_id, revision)
                    touched.add(queue_id)
                    self._changed.add(queue_id)  # its next entry may hold now
            else:
                put_in = self._put(kv)
                if put_in is not None:
                    self._changed.add(put_in)
                    if kv.mod_revision != kv.create_revision:
                        touched.add(put_in)  # a shared entry marked held
        self._settle()
        self._judge_touched(touched)

    # ------------------------------------------------------- holds, reported

    def freeing(self, etcd_key: bytes, revision: int, why: bytes) -> None:
        """This node is about to delete the entry created at ``revision``: when the
        mirror sees it go, it went for ``why`` (released, expired, orphaned)."""
        self._why[(etcd_key, revision)] = why

    def why(self, entry: Entry) -> bytes:
        """Why a hold went, as this node can tell: marked by a ``kill`` (on every
        node), or named by one in the same revision (an older node's kill); else
        as this node said when it freed it; else (another node freed it)
        ``orphaned`` when a session record went in the same revision (a session
        ended, or a node's lease ran out), ``released`` otherwise (docs/cluster.md,
        "Operators on a cluster")."""
        why = self._why.pop((entry.etcd_key, entry.revision), None)
        if entry.killed or entry.etcd_key in self._killed_now:
            return KILLED
        if why is not None:
            return why
        return ORPHANED if self._record_gone else RELEASED

    def _settle(self) -> None:
        """The revision just applied is complete: report the holds a kill marked in
        it (first: their node drops them before anything else is told), then the
        holds it ended (in the order their deletes came) and those it began."""
        if self._marked:
            marked, self._marked = self._marked, []
            if self.on_killed is not None:
                self.on_killed(marked)
        if not self._changed and not self._gone:
            self._killed_now.clear()
            self._record_gone = False
            return
        freed = [(queue_id, entry, left, self.why(entry)) for queue_id, entry, left in self._gone]
        self._gone.clear()
        self._killed_now.clear()
        self._record_gone = False
        granted = self._mark_holders(report=True)
        if self.on_changes is not None and (freed or granted):
            self.on_changes(freed, granted)

    def _mark_holders(self, *, report: bool) -> list[Granted]:
        """Flag the entries of the changed queues that hold now and did not: the
        head of an exclusive queue once it heads every queue of its request
        (``mlock``), a shared entry without a limit or marked held. ``since`` is
        the time of the entry's write when that write made it hold (or when the
        mirror was loaded), else now."""
        granted: list[Granted] = []
        revision, now = self.revision, self.wall()
        changed, self._changed = self._changed, set()
        seen: set[QueueId] = set()
        for queue_id in sorted(changed):
            for found in self._holds_in(queue_id, seen):
                queue_id_of, entry = found
                queue = self.queues[queue_id_of]
                entry.holding = True
                written_now = not report or entry.revision == revision or entry.held
                entry.since = entry.at if written_now and entry.at is not None else now
                queue.holding += 1
                granted.append((queue_id_of, entry, queue.holding))
        # In key order (an mlock's keys, as one server grants them), each queue's
        # holders counting up.
        granted.sort(key=lambda grant: (grant[0][1], grant[0][0], grant[2]))
        return granted

    def _holds_in(self, queue_id: QueueId, seen: set[QueueId]) -> Iterator[tuple[QueueId, Entry]]:
        """The entries of ``queue_id`` that hold and are not flagged yet (and, for an
        exclusive head that waited for other queues of its request, theirs)."""
        # Depth first, with a stack of its own: an ``mlock`` of N keys is N queues
        # deep, and the mirror reads whatever etcd holds (elockd writes N <= 64; a
        # foreign writer, more than Python's recursion limit).
        stack = [queue_id]
        while stack:
            queue_id = stack.pop()
            if queue_id in seen:
                continue
            seen.add(queue_id)
            queue = self.queues.get(queue_id)
            if queue is None:
                continue
            if queue_id[0] == SHARED:
                for entry in queue.in_order():
                    if entry.holds_shared and not entry.holding:
                        yield queue_id, entry
                continue
            head = queue.head()
            if head.holding:
                continue
            siblings = self._siblings(head, queue_id)
            if all(self.queues[other].head() is entry for other, entry in siblings):
                yield queue_id, head
                stack.extend(other for other, _ in reversed(siblings))

    def _siblings(self, entry: Entry, queue_id: QueueId) -> list[tuple[QueueId, Entry]]:
        """The other entries of an exclusive entry's request: the session's entries
        in other exclusive queues created at the same revision (an ``mlock``)."""
        found: list[tuple[QueueId, Entry]] = []
        request = self.by_tag.get(entry.tag, {}).get(entry.revision)
        if not isinstance(request, list):
            return found  # a request of one key: none
        revision = entry.revision
        for etcd_key in request:
            if etcd_key == entry.etcd_key:
                continue
            where = self._located.get(etcd_key)
            if where is not None and where[0][0] == EXCLUSIVE and where[0] != queue_id:
                found.append((where[0], self.queues[where[0]].entries[revision]))
        return found

    def _judge_touched(self, touched: set[QueueId]) -> None:
        for queue_id in touched:
            for waiter in list(self._waiters.get(queue_id, ())):
                self._judge(waiter)
        touched.clear()
        self._unpark()
        if self._deferred and self.revision >= self.replay_until:
            deferred, self._deferred = self._deferred, set()
            for waiter in deferred:
                self._judge(waiter)

    def catch_up_to(self, revision: int) -> None:
        """The watch (re)connected when etcd was at ``revision``: until the mirror
        reaches it, what it shows is history being replayed, and a grant judged on
        history would be given now for a state that may have ended since (a node
        cut off from etcd sees the delete that let its waiter in only after
        etcd expired its lease and granted the lock elsewhere)."""
        self.replay_until = max(self.replay_until, revision)

    def caught_up(self) -> bool:
        return self.revision >= self.replay_until

    def granted_after(self, keys: Sequence[bytes], revision: int) -> bytes | None:
        """The first of ``keys`` whose exclusive queue has seen a younger entry than
        ``revision`` hold it and go: a grant at ``revision`` would hand out a
        fencing token lower than one already given for that key (a tripwire: the
        grant rule never does that on a mirror that is whole)."""
        for key in keys:
            queue = self.queues.get((EXCLUSIVE, key))
            if queue is not None and queue.held_up_to > revision:
                return key
        return None

    def _put(self, kv: KeyValue) -> QueueId | None:
        name = self.layout.parse_entry(kv.key)
        if name is None:
            return None
        entry = Entry(kv.key, kv.create_revision, name.tag, kv.lease, parse_entry_value(kv.value))
        shared = name.queue[0] == SHARED
        queue = self.queues.get(name.queue)
        if queue is None:
            queue = self.queues[name.queue] = Queue()
            if (EXCLUSIVE if shared else SHARED, name.key) not in self.queues:
                self.names.add(name.key, len(self.names))
            if shared:
                self.shared_queues += 1
            else:
                self.exclusive_queues += 1
        old = queue.add(entry)
        if old is not None:
            self._unbind(old)
            if entry.killed and not old.killed and old.holding:
                self._marked.append((name.queue, entry))
        self._bind(entry)
        if shared:
            self.shared_holding += entry.holds_shared - (old is not None and old.holds_shared)
            self.shared_entries += old is None
        else:
            self.exclusive_entries += old is None
        self._located[kv.key] = (name.queue, kv.create_revision)
        self._index(name.tag, kv.create_revision, kv.key)
        return name.queue

    def _index(self, tag: int, revision: int, etcd_key: bytes) -> None:
        requests = self.by_tag.setdefault(tag, {})
        request = requests.get(revision)
        if request is None:
            requests[revision] = etcd_key  # a request of one key: no list
        elif isinstance(request, list):
            if etcd_key not in request:  # (a put again: a mark of ``held``)
                request.append(etcd_key)
        elif request != etcd_key:
            requests[revision] = [request, etcd_key]

    def _remove(self, queue_id: QueueId, revision: int) -> None:
        queue = self.queues[queue_id]
        shared = queue_id[0] == SHARED
        entry = queue.remove(revision, shared=shared)
        if entry is not None:
            self._unbind(entry)
            self._unindex(entry)
            if entry.holding:
                queue.holding -= 1
                self._gone.append((queue_id, entry, queue.holding))
            else:
                self._why.pop((entry.etcd_key, entry.revision), None)
            if shared:
                self.shared_entries -= 1
                self.shared_holding -= entry.holds_shared
            else:
                self.exclusive_entries -= 1
        if not queue.entries:
            del self.queues[queue_id]
            if (EXCLUSIVE if shared else SHARED, queue_id[1]) not in self.queues:
                self.names.ordered.remove(queue_id[1])
            if shared:
                self.shared_queues -= 1
            else:
                self.exclusive_queues -= 1

    def _bind(self, entry: Entry) -> None:
        tags = self._lease_tags.get(entry.lease)
        if tags is None:
            tags = self._lease_tags[entry.lease] = {}
        tags[entry.tag] = tags.get(entry.tag, 0) + 1

    def _unbind(self, entry: Entry) -> None:
        tags = self._lease_tags[entry.lease]
        left = tags[entry.tag] - 1
        if left:
            tags[entry.tag] = left
        else:
            del tags[entry.tag]
            if not tags:
                del self._lease_tags[entry.lease]

    def tags_on(self, lease: int) -> list[int]:
        """The tags of the sessions with an entry bound to ``lease``: O(those
        sessions), not O(every session of the cluster)."""
        return list(self._lease_tags.get(lease, ()))

    def _unindex(self, entry: Entry) -> None:
        etcd_key, revision = entry.etcd_key, entry.revision
        requests = self.by_tag.get(entry.tag)
        if requests is None:
            return
        request = requests.get(revision)
        if isinstance(request, list):
            if etcd_key in request:
                request.remove(etcd_key)
            if len(request) == 1:
                requests[revision] = request[0]
        elif request == etcd_key:
            del requests[revision]
        if not requests:
            del self.by_tag[entry.tag]

    def entry(self, etcd_key: bytes) -> Entry | None:
        """The entry at ``etcd_key``, as far as the mirror has got."""
        where = self._located.get(etcd_key)
        if where is None:
            return None
        queue = self.queues.get(where[0])
        return None if queue is None else queue.entries.get(where[1])

    def entries_on(self, tag: int, lease: int) -> list[tuple[bytes, int]]:
        """(etcd key, create revision) of every entry of the session ``tag`` that is
        bound to ``lease``: what a node may free for a session of its own."""
        found = []
        for revision, request in self.by_tag.get(tag, {}).items():
            for etcd_key in request if isinstance(request, list) else (request,):
                entry = self.entry(etcd_key)
                if entry is not None and entry.lease == lease:
                    found.append((etcd_key, revision))
        return found

    # ---------------------------------------------------------------- waiters

    def add_waiter(self, waiter: ClusterWaiter) -> None:
        """Judge a waiter whose revision is known, now or once the mirror gets there."""
        for queue_id in waiter.queues:
            self._waiters.setdefault(queue_id, set()).add(waiter)
        if waiter.revision > self.revision:
            self._park(waiter)
        else:
            self._judge(waiter)

    def remove_waiter(self, waiter: ClusterWaiter) -> None:
        """Forget a waiter (granted, lost, timed out or cancelled)."""
        if waiter.state == WAITING:
            waiter.state = CANCELLED
        self._unpark_one(waiter)
        self._deferred.discard(waiter)
        for queue_id in waiter.queues:
            waiters = self._waiters.get(queue_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[queue_id]

    def _unpark(self) -> None:
        if not self._parked:
            return
        for waiter in [w for w in self._parked if w.revision <= self.revision]:
            self._unpark_one(waiter)
            self._judge(waiter)

    def _park(self, waiter: ClusterWaiter) -> None:
        self._parked.add(waiter)
        for queue_id in waiter.queues:
            self._parked_on[queue_id] = self._parked_on.get(queue_id, 0) + 1

    def _unpark_one(self, waiter: ClusterWaiter) -> None:
        if waiter not in self._parked:
            return
        self._parked.discard(waiter)
        for queue_id in waiter.queues:
            left = self._parked_on[queue_id] - 1
            if left:
                self._parked_on[queue_id] = left
            else:
                del self._parked_on[queue_id]

    def unseen_waiting(self, queue_id: QueueId) -> int:
        """This node's waiting requests in ``queue_id`` whose enqueue txn etcd has
        answered but whose entry the mirror has not reached yet (it trails etcd by
        a few milliseconds). A check against the copy adds them, so that the node
        reads its own writes as one server does: ``--max-waiters`` counts a request
        queued here a moment ago (etcd's ``info`` already shows it), and a request
        is counted once, here until the mirror shows its entry, then there.

        Each such request waits: its txn found it not holding. An ``mlock`` counts
        in each of its queues, also one it heads, for those few milliseconds (the
        copy, once it shows the entry, counts it only where it is not first): at
        worst a refusal a moment early, never a queue longer than the flag."""
        return self._parked_on.get(queue_id, 0)

    def unseen_waiting_entries(self) -> int:
        """:meth:`unseen_waiting` over every queue: what ``q``'s ``waiting`` adds to
        the copy's :meth:`waiting`."""
        return sum(self._parked_on.values())

    def _judge(self, waiter: ClusterWaiter) -> None:
        if waiter.state != WAITING or waiter in self._parked:
            return
        for queue_id in waiter.queues:
            queue = self.queues.get(queue_id)
            if queue is None or waiter.revision not in queue.entries:
                self._finish(waiter, LOST)
                return
        for queue_id in waiter.queues:
            if not self.holds(queue_id, waiter.revision, waiter.limit):
                return
        if self.revision < self.replay_until:
            self._deferred.add(waiter)
            return
        self._finish(waiter, GRANTED)

    def holds(self, queue_id: QueueId, revision: int, limit: int = 1) -> bool:
        """May the entry at ``revision`` hold the lock, as of :attr:`revision`?"""
        queue = self.queues.get(queue_id)
        if queue is None or revision not in queue.entries:
            return False
        if queue_id[0] != SHARED:  # exclusive: only the first entry holds
            return queue.revisions[0] == revision
        return queue.may_grant_shared(revision, limit)

    def _finish(self, waiter: ClusterWaiter, state: int) -> None:
        waiter.state = state
        self.remove_waiter(waiter)
        if waiter.wake is not None:
            waiter.wake()

    # ----------------------------------------------------------------- counts

    def exclusive_locks(self) -> int:
        return self.exclusive_queues

    def shared_locks(self) -> int:
        return self.shared_queues

    def shared_holders(self) -> int:
        return self.shared_holding

    def waiting(self) -> int:
        """Entries that wait: all but the first of an exclusive queue, the unmarked
        limited ones of a shared queue."""
        return (self.exclusive_entries - self.exclusive_queues) + (
            self.shared_entries - self.shared_holding
        )
