"""The cluster's grant rule, without etcd: :class:`elockd.backend.cluster.mirror.QueueMirror`
fed with the watch events etcd would send.

A Hypothesis state machine plays etcd: requests enqueue (one revision per txn, an
``mlock`` enters several queues at that revision), entries go away (release,
timeout, lease expiry), ``sg`` entries hold at once, and watch batches arrive late
and in uneven slices. The model keeps etcd's state at every revision and the grant
facts (who was told "granted", at which revision), and checks them against the
promise of docs/protocol.md, not against the mirror's own formula:

* safety: when a waiter is granted, the holders of each of its keys at that
  revision (``sg`` entries, and entries of waiters granted earlier that are still
  there) are fewer than its limit; for an exclusive key, none;
* liveness: once the watch has caught up, no waiter still waits whose every older
  limited entry holds and whose keys have fewer holders than its limit;
* a waiter is told once; one whose entry vanished is told "lost".
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from elockd.backend.cluster.etcd.client import Event, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, Layout, entry_value
from elockd.backend.cluster.mirror import GRANTED, LOST, WAITING, ClusterWaiter, QueueMirror

LAYOUT = Layout(b"/t/")
KEYS = (b"a", b"b", b"c")
NODE_LEASE = 77  # every entry hangs on one node's lease


def put(kind: bytes, key: bytes, tag: int, revision: int, limit: int, marked_at: int = 0) -> Event:
    """An entry created at ``revision``; with ``marked_at``, its mark as held then."""
    value = entry_value(limit, None, b"o", held=bool(marked_at))
    kv = KeyValue(LAYOUT.entry(kind, key, tag), value, revision, marked_at or revision, NODE_LEASE)
    return Event("PUT", kv)


def delete(kind: bytes, key: bytes, tag: int, revision: int) -> Event:
    kv = KeyValue(LAYOUT.entry(kind, key, tag), b"", 0, revision, 0)
    return Event("DELETE", kv)


def test_entries_on_names_a_sessions_entries_bound_to_one_lease() -> None:
    """What a node may free for a session: its entries (by tag) on the node's own
    lease; one re-parented to another node's lease (a takeover) is not among them."""
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(EXCLUSIVE, b"a", 5, 10, 1), put(SHARED, b"b", 5, 11, 0)])
    mirror.apply([put(EXCLUSIVE, b"c", 6, 12, 1)])
    moved = KeyValue(LAYOUT.entry(EXCLUSIVE, b"d", 5), entry_value(1, None, b"o"), 13, 14, 88)
    mirror.apply([Event("PUT", moved)])
    assert sorted(mirror.entries_on(5, NODE_LEASE)) == sorted(
        [(LAYOUT.entry(EXCLUSIVE, b"a", 5), 10), (LAYOUT.entry(SHARED, b"b", 5), 11)]
    )
    assert mirror.entries_on(5, 88) == [(moved.key, 13)]
    mirror.apply([delete(EXCLUSIVE, b"a", 5, 15)])
    assert mirror.entries_on(5, NODE_LEASE) == [(LAYOUT.entry(SHARED, b"b", 5), 11)]
    assert mirror.entries_on(9, NODE_LEASE) == []


def test_tags_on_a_lease_follow_its_entries() -> None:
    """The sessions with entries on a lease (the node's sweep reads these, not every
    session of the cluster): an entry moved to another lease moves its tag there
    once its last entry on the old one has gone."""
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(EXCLUSIVE, b"a", 5, 10, 1), put(SHARED, b"b", 5, 11, 0)])
    mirror.apply([put(EXCLUSIVE, b"c", 6, 12, 1)])
    assert sorted(mirror.tags_on(NODE_LEASE)) == [5, 6] and mirror.tags_on(88) == []
    moved = KeyValue(LAYOUT.entry(EXCLUSIVE, b"a", 5), entry_value(1, None, b"o"), 10, 13, 88)
    mirror.apply([Event("PUT", moved)])
    assert sorted(mirror.tags_on(NODE_LEASE)) == [5, 6] and mirror.tags_on(88) == [5]
    moved = KeyValue(LAYOUT.entry(SHARED, b"b", 5), entry_value(0, None, b"o"), 11, 14, 88)
    mirror.apply([Event("PUT", moved)])
    assert mirror.tags_on(NODE_LEASE) == [6] and mirror.tags_on(88) == [5]
    mirror.apply([delete(EXCLUSIVE, b"c", 6, 15), delete(EXCLUSIVE, b"a", 5, 15)])
    assert mirror.tags_on(NODE_LEASE) == [] and mirror.tags_on(88) == [5]
    mirror.load(20, [])
    assert mirror.tags_on(88) == []


def test_exclusive_handoff_is_fifo() -> None:
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(EXCLUSIVE, b"k", 1, 10, 1)])
    woken: list[int] = []
    waiters = []
    for tag, revision in ((2, 11), (3, 12)):
        mirror.apply([put(EXCLUSIVE, b"k", tag, revision, 1)])
        waiter = ClusterWaiter([(EXCLUSIVE, b"k")], 1)
        waiter.revision = revision
        waiter.wake = lambda r=revision: woken.append(r)
        mirror.add_waiter(waiter)
        waiters.append(waiter)
    assert woken == []
    mirror.apply([delete(EXCLUSIVE, b"k", 1, 13)])
    assert woken == [11]
    assert [w.state for w in waiters] == [GRANTED, WAITING]
    mirror.apply([delete(EXCLUSIVE, b"k", 2, 14)])
    assert woken == [11, 12]


def test_waiter_judged_only_once_the_mirror_reaches_its_revision() -> None:
    mirror = QueueMirror(LAYOUT)
    waiter = ClusterWaiter([(EXCLUSIVE, b"k")], 1)
    waiter.revision = 5
    mirror.add_waiter(waiter)  # its own PUT has not arrived yet: not lost, parked
    assert waiter.state == WAITING
    mirror.apply([put(EXCLUSIVE, b"k", 1, 5, 1)])
    assert waiter.state == GRANTED


def test_a_waiter_on_no_queue_is_woken_once_the_mirror_reaches_its_revision() -> None:
    """How a takeover waits for the mirror to know every entry up to a revision."""
    mirror = QueueMirror(LAYOUT)
    woken: list[int] = []
    waiter = ClusterWaiter([], 0)
    waiter.revision, waiter.wake = 6, lambda: woken.append(mirror.revision)
    mirror.add_waiter(waiter)
    mirror.apply([put(EXCLUSIVE, b"k", 1, 5, 1)])
    assert woken == [] and waiter.state == WAITING
    mirror.apply([put(EXCLUSIVE, b"x", 2, 6, 1)])
    assert woken == [6] and waiter.state == GRANTED
    already = ClusterWaiter([], 0)
    already.revision, already.wake = 6, lambda: woken.append(0)
    mirror.add_waiter(already)  # there already: woken at once
    assert woken == [6, 0]


def test_waiter_whose_entry_vanishes_is_lost() -> None:
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(EXCLUSIVE, b"k", 1, 3, 1), put(EXCLUSIVE, b"k", 2, 4, 1)])
    waiter = ClusterWaiter([(EXCLUSIVE, b"k")], 1)
    waiter.revision = 4
    mirror.add_waiter(waiter)
    mirror.apply([delete(EXCLUSIVE, b"k", 2, 5)])  # its node's lease ran out
    assert waiter.state == LOST


def test_multi_key_waiter_waits_for_every_queue() -> None:
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(EXCLUSIVE, b"x", 1, 2, 1)])
    mirror.apply([put(EXCLUSIVE, b"x", 2, 3, 1), put(EXCLUSIVE, b"y", 2, 3, 1)])
    both = ClusterWaiter([(EXCLUSIVE, b"x"), (EXCLUSIVE, b"y")], 1)
    both.revision = 3
    mirror.add_waiter(both)
    mirror.apply([put(EXCLUSIVE, b"y", 3, 4, 1)])
    later = ClusterWaiter([(EXCLUSIVE, b"y")], 1)
    later.revision = 4
    mirror.add_waiter(later)
    assert (both.state, later.state) == (WAITING, WAITING)  # y's younger waiter queues
    mirror.apply([delete(EXCLUSIVE, b"x", 1, 5)])
    assert (both.state, later.state) == (GRANTED, WAITING)


def test_an_mlock_of_five_thousand_keys_is_granted_in_one_piece() -> None:
    """An ``mlock`` is as many queues deep as it has keys. elockd writes at most 64
    on a cluster, but the mirror reads whatever is in etcd: its grant walks them
    with a stack of its own (it once recursed per key, and 1,000 entries of one
    request, written by a seeding script, took every node down with RecursionError)."""
    mirror = QueueMirror(LAYOUT)
    keys = [b"m%d" % index for index in range(5000)]
    mirror.apply([put(EXCLUSIVE, b"m0", 1, 10, 1)])
    mirror.apply([put(EXCLUSIVE, key, 2, 11, 1) for key in keys])
    waiter = ClusterWaiter([(EXCLUSIVE, key) for key in keys], 1)
    waiter.revision = 11
    mirror.add_waiter(waiter)
    assert waiter.state == WAITING  # m0 is held by tag 1
    mirror.apply([delete(EXCLUSIVE, b"m0", 1, 12)])
    assert waiter.state == GRANTED
    entries = [mirror.entry(LAYOUT.entry(EXCLUSIVE, key, 2)) for key in keys]
    assert all(entry is not None and entry.holding for entry in entries)


class NoWalk(dict[int, object]):
    """A session's requests that must not be walked, only looked up."""

    def items(self):  # type: ignore[no-untyped-def,override]
        raise AssertionError("the session's entries were walked")

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the session's entries were walked")


def test_a_grant_looks_up_its_own_request_not_every_entry_of_its_session() -> None:
    """A session that holds 10,000 locks (--max-holds' default) and is granted one
    more: finding the grant's siblings (an ``mlock``'s other keys) costs its own
    request, not a walk over the session's 10,000 entries on every node."""
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(EXCLUSIVE, b"h%d" % index, 7, 100 + index, 1) for index in range(10_000)])
    mirror.apply([put(EXCLUSIVE, b"busy", 8, 20_000, 1)])
    mirror.apply([put(EXCLUSIVE, b"busy", 7, 20_001, 1)])  # tag 7 waits for it
    mirror.apply([put(EXCLUSIVE, b"p", 7, 20_002, 1), put(EXCLUSIVE, b"q", 7, 20_002, 1)])
    mirror.by_tag[7] = NoWalk(mirror.by_tag[7])
    mirror.apply([delete(EXCLUSIVE, b"busy", 8, 20_003)])
    granted = mirror.entry(LAYOUT.entry(EXCLUSIVE, b"busy", 7))
    assert granted is not None and granted.holding
    # The index it looked in: a request of one key is its key, an mlock's a list.
    assert dict.__getitem__(mirror.by_tag[7], 20_001) == LAYOUT.entry(EXCLUSIVE, b"busy", 7)
    assert dict.__getitem__(mirror.by_tag[7], 20_002) == [
        LAYOUT.entry(EXCLUSIVE, b"p", 7),
        LAYOUT.entry(EXCLUSIVE, b"q", 7),
    ]


def test_counts_for_q() -> None:
    mirror = QueueMirror(LAYOUT)
    mirror.load(
        9,
        [
            put(EXCLUSIVE, b"x", 1, 2, 1).kv,
            put(EXCLUSIVE, b"x", 2, 3, 1).kv,
            put(SHARED, b"s", 1, 4, 2, marked_at=8).kv,
            put(SHARED, b"s", 2, 5, 2).kv,
            put(SHARED, b"s", 3, 6, 2).kv,
            put(SHARED, b"s", 4, 7, 0).kv,
        ],
    )
    assert mirror.exclusive_locks() == 1
    assert mirror.shared_locks() == 1
    # Holders: the marked entry and the sg; the other two limit=2 entries wait.
    assert mirror.shared_holders() == 2
    assert mirror.waiting() == 3


class EtcdAndMirror(RuleBasedStateMachine):
    """etcd's queues (the model) and a mirror that sees them through a lagging watch."""

    def __init__(self) -> None:
        super().__init__()
        self.mirror = QueueMirror(LAYOUT)
        self.revision = 1
        self.mirror.load(1, [])
        # etcd now: (kind, key) -> {revision: limit}; and as of every revision.
        self.queues: dict[tuple[bytes, bytes], dict[int, int]] = {}
        self.history: dict[int, dict[tuple[bytes, bytes], dict[int, int]]] = {1: {}}
        self.undelivered: list[Event] = []
        self.waiters: dict[int, ClusterWaiter] = {}  # by revision
        self.granted: set[int] = set()  # revisions of waiters told "granted"
        self.told: dict[int, int] = {}
        self.violations: list[str] = []

    def _commit(self, events: list[Event]) -> None:
        self.undelivered.extend(events)
        self.history[self.revision] = {q: dict(e) for q, e in self.queues.items() if e}

    def _holders(self, state: dict[int, int], but: int) -> list[int]:
        return [r for r, limit in state.items() if r != but and (limit == 0 or r in self.granted)]

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
        shared=st.booleans(),
        limit=st.integers(min_value=0, max_value=3),
    )
    def enqueue(self, keys: list[bytes], shared: bool, limit: int) -> None:
        kind = SHARED if shared else EXCLUSIVE
        if shared:
            keys = keys[:1]
        else:
            limit = 1
        self.revision += 1
        tag = self._tag_of(self.revision)
        events = []
        for key in keys:
            self.queues.setdefault((kind, key), {})[self.revision] = limit
            events.append(put(kind, key, tag, self.revision, limit))
        self._commit(events)
        if limit:
            waiter = ClusterWaiter([(kind, k) for k in keys], limit)
            waiter.revision = self.revision
            waiter.wake = lambda w=waiter: self._woken(w)
            self.mirror.add_waiter(waiter)
            self.waiters[self.revision] = waiter

    def _woken(self, waiter: ClusterWaiter) -> None:
        self.told[waiter.revision] = self.told.get(waiter.revision, 0) + 1
        if waiter.state != GRANTED:
            return
        # Checked here, reported by an invariant: raising inside the mirror's call
        # would leave it half-updated.
        state = self.history[self.mirror.revision]
        for queue_id in waiter.queues:
            entries = state.get(queue_id, {})
            if waiter.revision not in entries:
                self.violations.append(f"granted {waiter.revision}, gone from {queue_id}")
            holders = self._holders(entries, waiter.revision)
            if len(holders) >= waiter.limit:
                self.violations.append(
                    f"granted {waiter.revision} (limit {waiter.limit}) at revision "
                    f"{self.mirror.revision} beside holders {holders} of {queue_id}: {entries}"
                )
        self.granted.add(waiter.revision)
        (kind, key), *_ = waiter.queues
        if kind == SHARED and waiter.revision in self.queues.get((kind, key), {}):
            # Its node marks it held, in a txn guarded by the entry's revision.
            self.revision += 1
            tag = self._tag_of(waiter.revision)
            event = put(kind, key, tag, waiter.revision, waiter.limit, marked_at=self.revision)
            self._commit([event])

    @precondition(lambda self: any(self.queues.values()))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """A release, a timeout or an expired lease: every entry of one request."""
        revisions = sorted({r for queue in self.queues.values() for r in queue})
        gone = data.draw(st.sampled_from(revisions))
        self.revision += 1
        events = []
        for (kind, key), queue in self.queues.items():
            if gone in queue:
                del queue[gone]
                events.append(delete(kind, key, self._tag_of(gone), self.revision))
        self._commit(events)
        self.granted.discard(gone)

    def _tag_of(self, revision: int) -> int:
        return revision  # the model's session tags: one per request, named by its revision

    @precondition(lambda self: self.undelivered)
    @rule(count=st.integers(min_value=1, max_value=4))
    def deliver(self, count: int) -> None:
        """The watch hands over the next few revisions' events in one batch."""
        revisions = sorted({e.kv.mod_revision for e in self.undelivered})[:count]
        batch = [e for e in self.undelivered if e.kv.mod_revision in revisions]
        self.undelivered = [e for e in self.undelivered if e.kv.mod_revision not in revisions]
        self.mirror.apply(batch)

    @invariant()
    def nobody_waits_for_nothing(self) -> None:
        if self.undelivered:
            return  # judged once the watch has caught up (deliver runs often)
        for revision, waiter in self.waiters.items():
            present = all(revision in self.queues.get(q, {}) for q in waiter.queues)
            if waiter.state == LOST:
                assert not present and self.told[revision] == 1
            if waiter.state != WAITING:
                continue
            assert present, "a waiter whose entry is gone was not told"
            assert revision not in self.told
            eligible = all(
                all(
                    r in self.granted
                    for r, limit in self.queues[q].items()
                    if r < revision and limit
                )
                and len(self._holders(self.queues[q], revision)) < waiter.limit
                for q in waiter.queues
            )
            assert not eligible, "a waiter that could hold was not granted"

    @invariant()
    def grants_keep_limits(self) -> None:
        assert self.violations == []

    @invariant()
    def counts_kept_on_the_way_equal_a_walk_of_every_queue(self) -> None:
        """The O(1) counts `q` and /metrics read match counting every queue."""
        queues = self.mirror.queues.items()
        shared = [queue for (kind, _), queue in queues if kind == SHARED]
        exclusive = [queue for (kind, _), queue in queues if kind != SHARED]
        holding = sum(1 for queue in shared for _ in queue.granted())
        assert self.mirror.exclusive_locks() == len(exclusive)
        assert self.mirror.shared_locks() == len(shared)
        assert self.mirror.shared_holders() == holding
        assert self.mirror.waiting() == sum(len(q.revisions) - 1 for q in exclusive) + sum(
            queue.waiting() for queue in shared
        )

    @invariant()
    def unseen_waiters_are_those_the_mirror_has_not_reached(self) -> None:
        """What ``--max-waiters`` and ``q`` add to the copy (a node reads its own
        writes): each waiter whose entry the mirror does not show yet, in each of
        its queues, and none once it does."""
        unseen = [
            waiter
            for waiter in self.waiters.values()
            if waiter.state == WAITING and waiter.revision > self.mirror.revision
        ]
        for kind in (EXCLUSIVE, SHARED):
            for key in KEYS:
                queue_id = (kind, key)
                expected = sum(1 for waiter in unseen if queue_id in waiter.queues)
                assert self.mirror.unseen_waiting(queue_id) == expected
        assert self.mirror.unseen_waiting_entries() == sum(len(w.queues) for w in unseen)

    @invariant()
    def tags_on_a_lease_are_those_of_its_entries(self) -> None:
        """What the node's sweep reads instead of every session: each lease's tags
        are exactly those of the entries bound to it."""
        expected: dict[int, set[int]] = {}
        for queue in self.mirror.queues.values():
            for entry in queue.entries.values():
                expected.setdefault(entry.lease, set()).add(entry.tag)
        for lease in {NODE_LEASE, 88, *expected}:
            assert sorted(self.mirror.tags_on(lease)) == sorted(expected.get(lease, ()))

    @invariant()
    def told_at_most_once(self) -> None:
        assert all(count == 1 for count in self.told.values())


EtcdAndMirror.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestMirrorAgainstEtcd = EtcdAndMirror.TestCase
