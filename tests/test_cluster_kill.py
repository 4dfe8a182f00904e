"""``kill`` on a cluster never makes two holders (docs/cluster.md, "kill on a cluster").

Two in-process nodes over one etcd in memory (:mod:`tests.support.txn_etcd`), whose
watches the test delivers by hand, on a clock it moves by hand. A client of node A
holds K, a client of node B waits for it, an operator kills K through B. The waiter
must not be granted while A may still confirm the hold: it is granted once A has
dropped the hold and deleted the killed entry (its acknowledgement), or, if A never
hears of the kill (cut from etcd), once etcd lapses A's lease, which is after A's
own deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable

import pytest
import trio
import trio.testing

from elockd.backend.cluster.etcd.client import EtcdClient, Event
from elockd.backend.cluster.layout import (
    EXCLUSIVE,
    SHARED,
    SessionRecord,
    encode_record,
    entry_value,
    killed_value,
    parse_entry_value,
)
from elockd.backend.cluster.mirror import GRANTED, WAITING, ClusterWaiter
from elockd.backend.cluster.space import ClusterLockSpace
from elockd.backend.cluster.tokens import fencing_token
from elockd.backend.interface import Evicted
from elockd.engine.watchers import KILLED
from tests.support.txn_etcd import TxnEtcd

TTL = 5
A_LEASE, B_LEASE = 7, 9
HOLDER_TAG, WAITER_TAG = 0x42, 0x43
KEY = b"k"


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Time moves only when the test moves it."""
    return trio.testing.MockClock()


class Scene:
    """Nodes A and B on one :class:`TxnEtcd`: A's session holds K, B's waits for it.
    Exclusive: ``lock K`` and ``lock K 30``; shared: ``sg K`` and ``lock_shared K 30
    limit=1`` (the holder counts against the limit)."""

    def __init__(self, kind: bytes) -> None:
        self.kind = kind
        self.etcd = TxnEtcd()
        self.clients: list[EtcdClient] = []
        self.a, self.b = self.node(A_LEASE), self.node(B_LEASE)
        layout = self.a.layout
        self.holder_entry = layout.entry(kind, KEY, HOLDER_TAG)
        holder_limit = 0 if kind == SHARED else 1
        held_at = self.etcd.put(
            self.holder_entry, entry_value(holder_limit, None, b"holder"), A_LEASE
        )
        self.holder = self.a.ledger.open_session("h" * 32, b"10.0.0.1:1")
        self.holder.tag = HOLDER_TAG
        self.a.ledger.by_tag[HOLDER_TAG] = self.holder
        self.a.ledger.record_hold(self.holder, kind, KEY, held_at, trio.current_time(), 0)
        waiting_at = self.etcd.put(
            layout.entry(kind, KEY, WAITER_TAG), entry_value(1, None, b"waiter"), B_LEASE
        )
        self.etcd.deliver(self.a)
        self.etcd.deliver(self.b)
        self.waiter = ClusterWaiter([(kind, KEY)], 1)
        self.waiter.revision = waiting_at
        self.b.mirror.add_waiter(self.waiter)
        self.connected: list[ClusterLockSpace] = [self.b]  # A's watch is not delivered
        self.killed: list[Evicted] | None = None
        self.freed_on_b: list[bytes] = []
        self.b.mirror.on_changes = self.heard_on_b(self.b.mirror.on_changes)

    def node(self, lease: int) -> ClusterLockSpace:
        client = EtcdClient(["http://127.0.0.1:9"])  # never called: TxnEtcd answers
        self.clients.append(client)
        space = ClusterLockSpace(client, b"/t/", session_ttl=TTL)
        self.etcd.attach(space)
        space.lease.renewed(lease, trio.current_time(), TTL)
        return space

    def heard_on_b(self, hook: Callable[..., None] | None) -> Callable[..., None]:
        def heard(freed: list[tuple[object, object, int, bytes]], granted: list[object]) -> None:
            self.freed_on_b.extend(why for _, _, _, why in freed)
            if hook is not None:
                hook(freed, granted)

        return heard

    def run_loops(self, nursery: trio.Nursery) -> None:
        """A's and B's own loops beside the node's (but the throttles', which this
        etcd does not serve): what acknowledges a kill."""
        for space in (self.a, self.b):
            for loop in space.node.loops:
                if loop != space.throttles.run:
                    nursery.start_soon(loop)

    def a_confirms(self) -> bool:
        """Does A still answer ``200 <token>`` to its client's ``token K`` (shared:
        does A's books still show the hold, within A's deadline)?"""
        if self.kind == SHARED:
            return not self.a.lease.past_deadline() and KEY in self.holder.shared
        return self.a.token(self.holder, KEY) is not None

    async def kill_through_b(self) -> None:
        self.killed = await self.b.operators.kill(KEY)

    async def settle(self) -> None:
        """Let every task run, delivering the connected nodes' watches, until quiet."""
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if not any(self.etcd.mailboxes[id(space)] for space in self.connected):
                return
            for space in self.connected:
                self.etcd.deliver(space)

    def check_never_two_holders(self) -> None:
        """The invariant, at any moment: B's waiter granted means A no longer
        confirms the hold."""
        if self.waiter.state == GRANTED:
            assert not self.a_confirms(), "B granted K while A still confirms it"

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


@pytest.fixture(params=[EXCLUSIVE, SHARED], ids=["exclusive", "shared"])
async def scene(request: pytest.FixtureRequest) -> AsyncIterator[Scene]:
    built = Scene(request.param)
    yield built
    await built.aclose()


def deletes_of(events: Iterable[Event], key: bytes) -> bool:
    return any(e.type == "DELETE" and e.kv.key == key for e in events)


async def test_the_next_grant_waits_for_the_holders_node_to_acknowledge(
    clock: trio.testing.MockClock, scene: Scene
) -> None:
    confirmed_at_delete: list[bool] = []
    scene.etcd.on_commit = lambda events: (
        confirmed_at_delete.append(scene.a_confirms())
        if deletes_of(events, scene.holder_entry)
        else None
    )
    async with trio.open_nursery() as nursery:
        scene.run_loops(nursery)
        nursery.start_soon(scene.kill_through_b)
        await scene.settle()
        # The kill is in etcd and B has seen it; A has not heard of it yet.
        scene.check_never_two_holders()
        assert scene.waiter.state == WAITING, "granted before the holder's node acknowledged"
        assert scene.a_confirms()
        kv = scene.etcd.kvs[scene.holder_entry]
        assert parse_entry_value(kv.value).killed and kv.lease == A_LEASE
        assert scene.killed is None  # the kill answers once the entry is gone
        # A's watch delivers: A drops the hold, then deletes the entry.
        scene.connected.append(scene.a)
        await scene.settle()
        scene.check_never_two_holders()
        assert confirmed_at_delete == [False], "A acknowledged before dropping the hold"
        assert scene.waiter.state == GRANTED
        shared = scene.kind == SHARED
        token = 0 if shared else fencing_token(0, kv.create_revision, 0)
        assert scene.killed == [Evicted(b"holder", b"holder", shared, token)]
        assert scene.freed_on_b == [KILLED]  # B's watchers hear "killed", at the grant
        assert scene.holder_entry not in scene.etcd.kvs
        nursery.cancel_scope.cancel()


async def test_a_holders_node_cut_from_etcd_is_past_its_deadline_before_the_next_grant(
    clock: trio.testing.MockClock, scene: Scene
) -> None:
    """A never hears of the kill: its entry stays, marked, at the head of K's queue
    until etcd lapses A's lease (no earlier than TTL after A's last keepalive was
    sent, here at 0); A stops confirming at its own deadline, before that."""
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        scene.run_loops(nursery)
        nursery.start_soon(scene.kill_through_b)
        await scene.settle()
        confirmed_while_waiting = False
        while trio.current_time() < start + TTL:
            scene.check_never_two_holders()
            assert scene.waiter.state == WAITING, "granted while A's lease is alive in etcd"
            confirmed_while_waiting |= scene.a_confirms()
            clock.jump(0.05)
            await scene.settle()
        assert confirmed_while_waiting  # A confirmed the hold for a while after the kill
        # The kill answered after --etcd-timeout, the entry still there.
        assert scene.killed is not None and len(scene.killed) == 1
        assert scene.holder_entry in scene.etcd.kvs
        scene.etcd.lapse(A_LEASE)
        await scene.settle()
        scene.check_never_two_holders()
        assert scene.waiter.state == GRANTED
        assert scene.freed_on_b == [KILLED]
        nursery.cancel_scope.cancel()


async def test_a_node_that_reloads_its_mirror_drops_and_acknowledges_what_was_killed(
    clock: trio.testing.MockClock, scene: Scene
) -> None:
    """A missed the mark (its watch fell behind and it reloads every queue): the
    reload finds its hold marked, drops it and deletes the entry."""
    async with trio.open_nursery() as nursery:
        scene.run_loops(nursery)
        nursery.start_soon(scene.kill_through_b)
        await scene.settle()
        assert scene.waiter.state == WAITING and scene.a_confirms()
        scene.etcd.mailboxes[id(scene.a)].clear()  # what the reload reads instead
        scene.a.mirror.load(scene.etcd.revision, list(scene.etcd.kvs.values()))
        scene.a.operators.drop_vanished()
        assert not scene.a_confirms()
        await scene.settle()
        scene.check_never_two_holders()
        assert scene.holder_entry not in scene.etcd.kvs
        assert scene.waiter.state == GRANTED
        nursery.cancel_scope.cancel()


async def test_a_second_kill_of_a_revoked_hold_marks_nothing(
    clock: trio.testing.MockClock, scene: Scene
) -> None:
    async with trio.open_nursery() as nursery:
        scene.run_loops(nursery)
        nursery.start_soon(scene.kill_through_b)
        await scene.settle()
        marked = scene.etcd.kvs[scene.holder_entry]
        assert parse_entry_value(marked.value).killed
        assert await scene.b.operators.kill(KEY) == []
        assert scene.etcd.kvs[scene.holder_entry] == marked
        assert scene.waiter.state == WAITING
        nursery.cancel_scope.cancel()


async def test_a_takeover_of_the_killed_holders_session_leaves_the_mark_to_the_lease(
    clock: trio.testing.MockClock, scene: Scene
) -> None:
    """The holder's client resumes its session on B (``conn_id``) while A is cut:
    B takes none of the killed holds, and the marked entry stays on A's lease until
    etcd lapses it (A may still answer the old connection until its deadline)."""
    record = encode_record(SessionRecord("node-a", False, 0, HOLDER_TAG))
    scene.etcd.put(scene.b.layout.session_record(scene.holder.id), record, A_LEASE)
    async with trio.open_nursery() as nursery:
        scene.run_loops(nursery)
        nursery.start_soon(scene.kill_through_b)
        await scene.settle()
        current = scene.b.ledger.open_session("c" * 32, b"10.0.0.2:2")
        taken = []

        async def take_over() -> None:
            taken.append(await scene.b.takeover.take_over(scene.holder.id, current))

        nursery.start_soon(take_over)
        await scene.settle()
        assert taken and taken[0] is not None, "the session was not taken over"
        assert scene.b.ledger.holds(taken[0]) == []
        assert scene.etcd.kvs[scene.holder_entry].lease == A_LEASE
        assert scene.waiter.state == WAITING
        clock.jump(TTL)
        scene.etcd.lapse(A_LEASE)
        await scene.settle()
        scene.check_never_two_holders()
        assert scene.waiter.state == GRANTED
        nursery.cancel_scope.cancel()


async def test_a_kill_of_many_shared_holds_marks_a_hundred_a_txn_each_guard_current(
    clock: trio.testing.MockClock,
) -> None:
    """151 shared holds (over etcd's operations per txn): two txns of marks, the
    second guarded at the revision of the first (never refused for its marks)."""
    scene = Scene(SHARED)
    for tag in range(0x100, 0x100 + 150):
        entry = scene.a.layout.entry(SHARED, KEY, tag)
        scene.etcd.put(entry, entry_value(0, None, b"o%d" % tag), A_LEASE)
    scene.connected.append(scene.a)
    try:
        async with trio.open_nursery() as nursery:
            scene.run_loops(nursery)
            await scene.settle()  # both nodes have the holds
            nursery.start_soon(scene.kill_through_b)
            await scene.settle()
            assert scene.killed is not None and len(scene.killed) == 151
            assert scene.etcd.refused == 0
            assert scene.waiter.state == GRANTED and not scene.a_confirms()
            nursery.cancel_scope.cancel()
    finally:
        await scene.aclose()


@pytest.mark.parametrize("wait", [0.0, 5.0], ids=["try", "wait"])
async def test_a_grant_whose_entry_was_killed_before_the_answer_is_not_given(
    clock: trio.testing.MockClock, wait: float
) -> None:
    """A's watch brings a kill's mark of a new entry (B saw it hold and killed it)
    before A acts on its enqueue txn's answer: A acknowledges the kill, so the
    request must not be granted (``lock j``: refused; ``lock j 5``: not granted)."""
    scene = Scene(EXCLUSIVE)
    scene.connected.append(scene.a)
    queue = scene.a.layout.queue_prefix(EXCLUSIVE, b"j")
    marked: list[bytes] = []

    def killed_at_once(events: list[Event]) -> None:
        for event in events:
            kv = event.kv
            if event.type == "PUT" and kv.key.startswith(queue) and not marked:
                marked.append(kv.key)
                scene.etcd.put(kv.key, killed_value(kv.value), A_LEASE)
                scene.etcd.deliver(scene.a)

    scene.etcd.on_commit = killed_at_once
    session = scene.a.ledger.open_session("s" * 32, b"10.0.0.3:3")
    try:
        async with trio.open_nursery() as nursery:
            scene.run_loops(nursery)
            grant = await scene.a.recipe.acquire(
                session, EXCLUSIVE, [b"j"], limit=1, ttl=None, wait=wait
            )
            await scene.settle()
            assert marked, "the request's entry was never written"
            assert not grant.granted
            assert scene.a.token(session, b"j") is None
            assert not any(key.startswith(queue) for key in scene.etcd.kvs)
            nursery.cancel_scope.cancel()
    finally:
        await scene.aclose()
