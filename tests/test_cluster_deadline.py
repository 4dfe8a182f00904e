"""The node's local lease deadline and the checks at the moment of a grant, without
etcd (docs/cluster.md, "What is guaranteed").

A node cut off from etcd must stop confirming what it holds before etcd can expire
its lease and another node grant the same locks. These tests drive the deadline
timer on trio's MockClock, so the instant it fires is exact, and feed the mirror
the watch events a reconnecting watch would replay.
"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from elockd.backend.cluster.etcd.client import EtcdClient, Event, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, Layout, entry_value
from elockd.backend.cluster.lease import CLOCK_RATE_ERROR, LEASE_MARGIN, lease_deadline
from elockd.backend.cluster.ledger import ClusterSession
from elockd.backend.cluster.mirror import GRANTED, WAITING, ClusterWaiter, QueueMirror
from elockd.backend.cluster.space import ClusterLockSpace
from elockd.backend.interface import BackendUnavailable

LAYOUT = Layout(b"/t/")


def put(key: bytes, tag: int, revision: int) -> Event:
    kv = KeyValue(
        LAYOUT.entry(EXCLUSIVE, key, tag), entry_value(1, None, b"o"), revision, revision, 7
    )
    return Event("PUT", kv)


def delete(key: bytes, tag: int, revision: int) -> Event:
    return Event("DELETE", KeyValue(LAYOUT.entry(EXCLUSIVE, key, tag), b"", 0, revision, 0))


def heartbeat(revision: int) -> Event:
    """A write under the root outside the queues (a node's heartbeat key)."""
    return Event("PUT", KeyValue(b"/t/n/x", b"1", revision, revision, 9))


def test_the_deadline_runs_ahead_of_the_earliest_expiry_etcd_can_make() -> None:
    """etcd restarts the TTL when it applies the keepalive, after it was sent: the
    deadline counts from the send, less the clock-rate error and the margin."""
    assert lease_deadline(100.0, 5) == pytest.approx(100.0 + 5 * (1 - CLOCK_RATE_ERROR) - 0.5)
    assert LEASE_MARGIN == 0.5
    for ttl in (2, 5, 30, 600):
        assert lease_deadline(0.0, ttl) < ttl - LEASE_MARGIN + 1e-9
        # A keepalive every TTL/3 keeps it: two may fail before the lease lapses.
        assert lease_deadline(0.0, ttl) > ttl / 3 * 2


def holding_session(space: ClusterLockSpace, key: bytes) -> tuple[ClusterSession, list[str]]:
    """A session of the node that holds ``key`` under the node's lease."""
    session = space.ledger.open_session("s" * 32, b"peer")
    session.tag = 42
    space.ledger.by_tag[42] = session
    space.ledger.record_hold(session, EXCLUSIVE, key, 10, trio.current_time(), 0)
    closed: list[str] = []
    session.abort = lambda: closed.append("closed")
    return session, closed


async def test_sessions_are_lost_the_instant_the_lease_passes_its_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The timer fires at the deadline, whatever the keepalive loop is doing (it
    may be stuck in a call for --etcd-timeout): from then on ``token`` answers
    "not held", the connection is closed, and no grant is confirmed."""
    client = EtcdClient(["http://127.0.0.1:9"])
    space = ClusterLockSpace(client, b"/t/", session_ttl=5)
    lease = space.lease
    session, closed = holding_session(space, b"k")
    start = trio.current_time()
    lease.renewed(7, start, 5)
    deadline = lease_deadline(start, 5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.enforce_deadline)
        await trio.sleep_until(deadline - 0.001)
        assert space.token(session, b"k") is not None and not session.lost
        # A keepalive answered meanwhile moves the deadline on.
        lease.renewed(7, deadline - 1.0, 5)
        moved = lease_deadline(deadline - 1.0, 5)
        await trio.sleep_until(moved - 0.001)
        assert not session.lost and closed == []
        await trio.sleep_until(moved)
        await trio.testing.wait_all_tasks_blocked()
        assert session.lost and closed == ["closed"]
        assert lease.id == 0 and lease.deadline == math.inf
        assert space.token(session, b"k") is None
        with pytest.raises(BackendUnavailable):
            lease.confirm(session)
        nursery.cancel_scope.cancel()
    await client.aclose()


async def test_token_checks_the_deadline_itself(mock_clock: trio.testing.MockClock) -> None:
    """Even with no timer task running yet (a busy loop), ``token`` past the
    deadline does not confirm the hold."""
    client = EtcdClient(["http://127.0.0.1:9"])
    space = ClusterLockSpace(client, b"/t/", session_ttl=5)
    session, _ = holding_session(space, b"k")
    space.lease.renewed(7, trio.current_time(), 5)
    assert space.token(session, b"k") is not None
    await trio.sleep(lease_deadline(0, 5))
    assert space.token(session, b"k") is None and session.lost
    assert not space.renew(session, b"k", trio.current_time(), 10)
    await client.aclose()


def test_a_replayed_watch_grants_nothing_until_it_has_caught_up() -> None:
    """The stale-watch sequence: the delete that lets a waiter in comes from a
    replay after a reconnect; the waiter is granted only once the mirror has
    reached the revision etcd was at when the stream was created, by which time
    the mirror also shows whatever happened to its entry meanwhile."""
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(b"x", 1, 10), put(b"x", 2, 11), put(b"x", 3, 12)])
    waiter = ClusterWaiter([(EXCLUSIVE, b"x")], 1)
    waiter.revision = 11
    mirror.add_waiter(waiter)
    mirror.catch_up_to(16)
    mirror.apply([delete(b"x", 1, 13)])  # history: the holder went
    assert waiter.state == WAITING and not mirror.caught_up()
    mirror.apply([delete(b"x", 2, 14)])  # history: our entry went with our lease
    assert waiter.state != GRANTED


def test_a_replayed_grant_still_comes_once_caught_up() -> None:
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(b"x", 1, 10), put(b"x", 2, 11)])
    waiter = ClusterWaiter([(EXCLUSIVE, b"x")], 1)
    waiter.revision = 11
    woken: list[int] = []
    waiter.wake = lambda: woken.append(mirror.revision)
    mirror.add_waiter(waiter)
    mirror.catch_up_to(15)
    mirror.apply([delete(b"x", 1, 13)])
    assert waiter.state == WAITING
    mirror.apply([heartbeat(15)])
    assert waiter.state == GRANTED and woken == [15]


def test_the_tripwire_sees_a_token_that_would_go_back() -> None:
    """A grant below a revision the mirror has seen hold the key and go."""
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(b"x", 1, 10), put(b"x", 2, 11), put(b"x", 3, 12)])
    assert mirror.granted_after([b"x"], 11) is None
    mirror.apply([delete(b"x", 1, 13)])  # 10 held and went
    assert mirror.granted_after([b"x"], 11) is None
    mirror.apply([delete(b"x", 2, 14)])  # 11 held and went
    assert mirror.granted_after([b"y", b"x"], 11) is None
    assert mirror.granted_after([b"y", b"x"], 10) == b"x"
    # A waiter that leaves from behind the head never held: no high-water mark.
    mirror.apply([put(b"z", 1, 20), put(b"z", 2, 21), delete(b"z", 2, 22)])
    assert mirror.granted_after([b"z"], 19) is None


async def test_while_frozen_nothing_is_confirmed_past_the_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A hand-over's freeze keeps the books as they are (no session is lost while it
    copies them), but a ``token``, a ``renew`` or a grant past the deadline is still
    refused: the freeze starts before the connections park."""
    client = EtcdClient(["http://127.0.0.1:9"])
    space = ClusterLockSpace(client, b"/t/", session_ttl=5)
    session, closed = holding_session(space, b"k")
    space.lease.renewed(7, trio.current_time(), 5)
    space.freeze()
    await trio.sleep(lease_deadline(0, 5))
    assert space.token(session, b"k") is None
    assert not space.renew(session, b"k", trio.current_time(), 10)
    with pytest.raises(BackendUnavailable):
        space.lease.confirm(session)
    # The books are unchanged: the successor finds the lease gone and ends it so.
    assert not session.lost and closed == [] and session.exclusive
    await client.aclose()


def test_a_session_lost_before_its_connection_runs_is_ended_when_it_does() -> None:
    """A successor that finds the node's lease gone as it joins loses the adopted
    sessions before any of their connections is served: each is ended the moment
    its connection task hands it a way to end it."""
    session = ClusterSession("s" * 32, b"peer")
    session.lost = True
    ended: list[str] = []
    session.abort = lambda: ended.append("ended")
    assert ended == ["ended"]
    fresh = ClusterSession("t" * 32, b"peer")
    fresh.abort = lambda: ended.append("not this one")
    assert ended == ["ended"] and fresh.abort is not None
