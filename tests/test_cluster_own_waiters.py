"""A cluster node counts its own waiting requests for ``--max-waiters`` as soon as
etcd has answered their enqueue, before its watch shows their entries (docs/cluster.md,
"Running it"), without etcd.

The node's copy of the queues trails etcd by a few milliseconds. A request queued
through this node a moment ago is in etcd (``info`` shows it), so the next request
on the same node must count it, as one server does: here the copy is fed by hand,
the earlier request waits in the node's real wait path, and the check under test
is the one a new waiting request makes before it writes anything.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from elockd.backend.cluster.etcd.client import EtcdClient, Event, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, entry_value
from elockd.backend.cluster.ledger import ClusterWait
from elockd.backend.cluster.space import ClusterLockSpace
from elockd.backend.interface import QueueFull

NODE_LEASE = 7


class PassedTheCheck(Exception):
    """The request went past the ``--max-waiters`` check, on to write its entry."""


def put(space: ClusterLockSpace, kind: bytes, tag: int, revision: int, limit: int) -> Event:
    kv = KeyValue(
        space.layout.entry(kind, b"k", tag),
        entry_value(limit, None, b"o"),
        revision,
        revision,
        NODE_LEASE,
    )
    return Event("PUT", kv)


def delete(space: ClusterLockSpace, kind: bytes, tag: int, revision: int) -> Event:
    return Event("DELETE", KeyValue(space.layout.entry(kind, b"k", tag), b"", 0, revision, 0))


def own_wait(space: ClusterLockSpace, kind: bytes, limit: int, wait: float) -> ClusterWait:
    """A request of this node's session (tag 3) enqueued at revision 12: etcd has
    answered, the copy may not show it."""
    session = space.ledger.open_session("w" * 32, b"peer")
    session.tag = 3
    space.ledger.by_tag[3] = session
    now = trio.current_time()
    entry = space.layout.entry(kind, b"k", 3)
    return ClusterWait(session, kind, [b"k"], [entry], 12, limit, None, now + wait, now)


async def new_waiting_request(space: ClusterLockSpace, kind: bytes) -> None:
    """A fresh session asks for ``k``, willing to wait: QueueFull, or PassedTheCheck."""
    session = space.ledger.open_session("n" * 32, b"peer")
    await space.recipe.acquire(session, kind, [b"k"], limit=1, ttl=None, wait=30)


@pytest.mark.parametrize("kind", [EXCLUSIVE, SHARED], ids=["exclusive", "shared"])
async def test_a_waiter_of_this_node_counts_before_its_entry_shows_and_once_after(
    kind: bytes, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--max-waiters 2``; ``k`` is held (revision 10) and another node's request
    waits (11). A request of this node enqueued at 12 (etcd answered) waits, but the
    copy is still at 11: a new waiting request is refused (413), as one server
    would. When the copy shows the entry, it is counted once, not twice: with the
    other node's waiter gone, a new request has room again."""
    client = EtcdClient(["http://127.0.0.1:9"])  # nothing listens: never called
    space = ClusterLockSpace(client, b"/t/", max_waiters=2)
    space.lease.renewed(NODE_LEASE, trio.current_time(), 5)

    async def no_etcd(*args: object) -> None:
        raise PassedTheCheck

    async def nothing_to_delete(*args: object) -> bool:
        return True

    monkeypatch.setattr(space.records, "ensure_record", no_etcd)
    monkeypatch.setattr(space.records, "delete_entries", nothing_to_delete)
    mirror = space.mirror
    waiter_limit = 1  # a shared waiter behind an unlimited holder: it waits
    holder_limit = 0 if kind == SHARED else 1
    holder, other = put(space, kind, 1, 10, holder_limit), put(space, kind, 2, 11, waiter_limit)
    mirror.apply([holder, other])  # the holder, another node's waiter
    assert mirror.revision == 11

    # This node's own request: enqueued at 12, now waiting in the node's wait path.
    state = own_wait(space, kind, waiter_limit, 60)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(space.recipe.wait_for, state)
        await trio.testing.wait_all_tasks_blocked()
        assert space.ledger.local_waiting == 1
        with pytest.raises(QueueFull):
            await new_waiting_request(space, kind)
        assert mirror.unseen_waiting((kind, b"k")) == 1
        assert space.ledger.sizes().waiting == 2  # q: the copy's one, and ours

        # The watch brings our entry: counted from the copy now, once.
        mirror.apply([put(space, kind, 3, 12, waiter_limit)])
        assert mirror.unseen_waiting((kind, b"k")) == 0
        assert space.ledger.sizes().waiting == 2
        with pytest.raises(QueueFull):
            await new_waiting_request(space, kind)
        # The other node's waiter gives up: one waits (ours), room for one more.
        mirror.apply([delete(space, kind, 2, 13)])
        assert space.ledger.sizes().waiting == 1
        with pytest.raises(PassedTheCheck):
            await new_waiting_request(space, kind)
        assert space.ledger.local_waiting == 1  # ours still waits
        nursery.cancel_scope.cancel()
    assert space.ledger.local_waiting == 0
    assert mirror.unseen_waiting((kind, b"k")) == 0
    await client.aclose()


async def test_a_waiter_that_ends_before_its_entry_shows_stops_counting(
    mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of this node that times out (or is cancelled) while the copy has
    not reached its entry leaves nothing counted behind: its entry is deleted, and
    the copy never shows it."""
    client = EtcdClient(["http://127.0.0.1:9"])
    space = ClusterLockSpace(client, b"/t/", max_waiters=1)
    space.lease.renewed(NODE_LEASE, trio.current_time(), 5)

    async def nothing_to_delete(*args: object) -> bool:
        return True

    monkeypatch.setattr(space.records, "delete_entries", nothing_to_delete)
    space.mirror.apply([put(space, EXCLUSIVE, 1, 10, 1)])
    grant = await space.recipe.wait_for(own_wait(space, EXCLUSIVE, 1, 1))
    assert not grant.granted and space.ledger.timeouts == 1
    assert space.mirror.unseen_waiting((EXCLUSIVE, b"k")) == 0
    assert space.ledger.sizes().waiting == 0
    await client.aclose()
