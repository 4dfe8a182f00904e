"""A slow link between a node and etcd, shorter than the node's deadlines, costs the
node nothing (docs/cluster.md, "When etcd answers slowly").

etcd answers every call, 1.5 s late: later than a third of ``--etcd-timeout``, the
share one attempt has before the next member is asked too, but well within the
deadline of the call and within the lease's local deadline. Every attempt to every
member is as slow (it is the node's link that is slow), so the node must wait for
an answer rather than cut attempts short and fail over, or it gives up a lease
etcd is still renewing and every client of the node loses its locks. A scripted
transport stands in for etcd, on trio's MockClock, so the delay is exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import h11
import pytest
import trio
import trio.testing

from elockd.backend.cluster.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Event,
    KeyValue,
)
from elockd.backend.cluster.layout import EXCLUSIVE, Layout, entry_value
from elockd.backend.cluster.lease import lease_deadline
from elockd.backend.cluster.space import ClusterLockSpace
from tests.test_cluster_deadline import holding_session
from tests.test_etcd_client import FakeMember, ok

DELAY = 1.5
LEASE = 7
TTL = 5


def _answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What etcd would answer, enough for the node: the lease lives on, reads find
    nothing, writes succeed."""
    header = {"header": {"revision": "10"}}
    if path == "lease/keepalive":
        return header | {"result": {"ID": body["ID"], "TTL": str(TTL)}}
    if path == "lease/grant":
        return header | {"ID": str(LEASE + 1), "TTL": str(TTL)}
    if path == "kv/range":
        return header | {"kvs": [], "count": "0"}
    if path == "kv/txn":
        responses = [
            {"response_range": {"kvs": [], "count": "0"}} if "request_range" in op else {}
            for op in body.get("success", [])
        ]
        return header | {"succeeded": True, "responses": responses}
    return header


class SlowLink:
    """The client's transport: every member answers ``delay`` seconds after the
    request was sent (the node's link is slow), and keeps count of what it was
    asked. A request is sent at once; its answer may be waited for in pieces."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.asked: list[tuple[str, str]] = []
        #: Members that never answer (hung).
        self.hung: set[str] = set()
        #: How many of the next requests are never answered (stuck in a member).
        self.stuck = 0
        #: Seconds the next send takes to go out (a slow connect), then 0.
        self.slow_send = 0.0
        #: An error body etcd answers the requests after the first with, if any.
        self.error: bytes | None = None

    async def send(self, endpoint: str, path: str, payload: bytes) -> Sent:
        going_out, self.slow_send = self.slow_send, 0.0
        await trio.sleep(going_out)
        self.asked.append((endpoint, path))
        answer = json.dumps(_answer(path, json.loads(payload))).encode()
        if self.error is not None and len(self.asked) > 1:
            answer = self.error
        due = trio.current_time() + self.delay
        if endpoint in self.hung or self.stuck > 0:
            self.stuck -= 1
            due = math.inf
        return Sent(endpoint, due, answer)

    async def receive(self, sent: Sent) -> tuple[int, bytes]:
        await trio.sleep_until(sent.due)
        return (200 if sent.answer != self.error else 400), sent.answer

    finish = receive

    async def post(self, endpoint: str, path: str, payload: bytes) -> tuple[int, bytes]:
        return await self.receive(await self.send(endpoint, path, payload))

    def discard(self, sent: Sent) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Sent:
    """A request on its way: its answer comes at ``due``."""

    endpoint: str
    due: float
    answer: bytes


def stray(key: bytes, tag: int, revision: int, lease: int) -> Event:
    """An entry of a session this node does not have, on ``lease``."""
    layout = Layout(b"/t/")
    value = entry_value(1, None, b"o")
    kv = KeyValue(layout.entry(EXCLUSIVE, key, tag), value, revision, revision, lease)
    return Event("PUT", kv)


def slow_client(endpoints: int, delay: float = DELAY) -> tuple[EtcdClient, SlowLink]:
    client = EtcdClient([f"http://etcd{i}.test:2379" for i in range(endpoints)], deadline=3.0)
    link = SlowLink(delay)
    client._transport = link  # type: ignore[assignment]
    return client, link


async def keeper_runs(space: ClusterLockSpace, seconds: float) -> None:
    """The node's keeper (keepalives and sweeps) and deadline timer, for ``seconds``."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(space.node._keep_alive)
        nursery.start_soon(space.lease.enforce_deadline)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("endpoints", [1, 3])
async def test_a_node_keeps_its_lease_and_sessions_when_etcd_answers_late(
    endpoints: int, autojump_clock: trio.testing.MockClock
) -> None:
    """For 30 s of etcd answering 1.5 s late, the node's keeper keeps its lease (a
    keepalive every TTL/3), its session keeps its lock and ``token`` confirms it,
    and the requests' reads and writes (``info``, a txn) are answered, not failed
    as etcd unavailable."""
    client, link = slow_client(endpoints)
    space = ClusterLockSpace(client, b"/t/", session_ttl=TTL)
    session, closed = holding_session(space, b"k")
    space.lease.renewed(LEASE, trio.current_time(), TTL)
    answered: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(space.node._keep_alive)
        nursery.start_soon(space.lease.enforce_deadline)
        end = trio.current_time() + 30
        while trio.current_time() < end:
            sent = trio.current_time()
            await space.info(b"k", sent).run()
            await space.calls.txn([], [{"request_range": {"key": "aw=="}}])
            answered.append(trio.current_time() - sent)
            assert space.token(session, b"k") == space.ledger.holds(session)[0].token
            await trio.sleep(0.7)
        nursery.cancel_scope.cancel()
    assert not session.lost and closed == [] and space.lease.id == LEASE
    assert space.calls.backend_unavailable == 0
    keepalives = [path for _, path in link.asked if path == "lease/keepalive"]
    assert len(keepalives) >= 30 / (TTL / 3) - 1
    assert all(took >= 2 * DELAY for took in answered) and len(answered) >= 5
    await client.aclose()


async def test_the_sweep_of_stray_entries_never_holds_up_a_keepalive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Stray entries on the node's lease (here 40 of them, one delete txn each 1.5 s
    late, still there in the node's copy every round) are swept beside the
    keepalives, not between them: the lease lives on."""
    client, link = slow_client(1)
    space = ClusterLockSpace(client, b"/t/", session_ttl=TTL)
    session, closed = holding_session(space, b"k")
    space.mirror.apply([stray(b"s%d" % n, 1000 + n, 20 + n, LEASE) for n in range(40)])
    space.lease.renewed(LEASE, trio.current_time(), TTL)
    await keeper_runs(space, 30)
    assert not session.lost and closed == [] and space.lease.id == LEASE
    assert [path for _, path in link.asked].count("kv/txn") >= 10  # it did sweep
    await client.aclose()


@pytest.mark.parametrize("delay", [2.1, 2.3])
async def test_the_lease_lives_through_delays_under_half_its_span(
    delay: float, autojump_clock: trio.testing.MockClock
) -> None:
    """The bound docs/cluster.md gives: a keepalive every TTL/3, each sent once the
    last was answered, keeps the lease while the delay is under half its span,
    ``(TTL x 0.98 - 0.5) / 2`` (2.2 s at TTL 5); past it the node fails closed."""
    span = lease_deadline(0, TTL)
    assert span / 2 == pytest.approx(2.2)
    client, _ = slow_client(1, delay)
    space = ClusterLockSpace(client, b"/t/", session_ttl=TTL)
    session, closed = holding_session(space, b"k")
    space.lease.renewed(LEASE, trio.current_time(), TTL)
    await keeper_runs(space, 30)
    kept = delay < span / 2
    assert session.lost is not kept and closed == ([] if kept else ["closed"])
    await client.aclose()


async def test_a_keepalive_waits_for_its_answer_until_the_lease_s_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A keepalive answered later than --etcd-timeout but before the lease's local
    deadline still moves the deadline on: it is waited for until then."""
    client, _ = slow_client(1, delay=3.5)  # over the 3 s deadline, under TTL 5's 4.4 s
    space = ClusterLockSpace(client, b"/t/", session_ttl=TTL)
    start = trio.current_time()
    space.lease.renewed(LEASE, start, TTL)
    await space.lease.keep_alive()
    assert space.lease.id == LEASE
    assert space.lease.deadline == pytest.approx(lease_deadline(start, TTL))
    # A request's call has only --etcd-timeout.
    with pytest.raises(EtcdUnavailable, match="within 3s"):
        await client.get(b"k")
    await client.aclose()


async def test_a_hung_member_costs_a_call_one_third_of_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The next member is asked beside a member that does not answer once a third of
    the deadline has passed, and its answer is the call's; calls stick to it."""
    client, link = slow_client(3, delay=0.2)
    link.hung.add(client.endpoints[0])
    start = trio.current_time()
    await client.get(b"k")
    assert trio.current_time() - start == pytest.approx(1.0 + 0.2)
    assert client.endpoint == client.endpoints[1]
    await client.aclose()


async def test_a_request_stuck_in_a_member_is_sent_again_beside_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One endpoint, and the first request stays stuck in it (as one that reached a
    member during an election may, after the election is over): a third of the
    deadline later the same request goes again, and its answer is the call's."""
    client, link = slow_client(1, delay=0.2)
    link.stuck = 1
    start = trio.current_time()
    await client.get(b"k")
    assert trio.current_time() - start == pytest.approx(1.0 + 0.2)
    assert len(link.asked) == 2
    await client.aclose()


async def test_a_first_attempt_not_sent_in_its_third_is_followed_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first request could not even go out within its third (a slow connect):
    it is dropped, and the next attempt goes at the third itself, with no pause
    meant for a round of refusals (none refused)."""
    client, link = slow_client(1, delay=0.2)
    link.slow_send = 5.0
    start = trio.current_time()
    await client.get(b"k")
    assert trio.current_time() - start == pytest.approx(1.0 + 0.2)
    assert len(link.asked) == 1  # the first never went out
    await client.aclose()


async def test_an_error_answer_of_a_later_attempt_ends_the_call_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first request is stuck; the one sent beside it a third later is answered
    with an error etcd means (not "not now"): the call ends with that error then,
    not with Backend Unavailable at its deadline."""
    client, link = slow_client(1, delay=0.2)
    link.stuck = 1
    link.error = b'{"error": "etcdserver: key is not provided", "code": 3}'
    start = trio.current_time()
    with pytest.raises(EtcdError, match="key is not provided"):
        await client.get(b"k")
    assert trio.current_time() - start == pytest.approx(1.0 + 0.2)
    await client.aclose()


async def test_a_watch_connects_over_a_link_slower_than_its_first_try(
    nursery: trio.Nursery,
) -> None:
    """etcd's "created" reply comes 1.5 s after the request (three members, all as
    slow), later than the watch's first try (1 s, a third of --etcd-timeout): the
    next try, on the next member, has twice as long, and the watch connects and
    delivers, where a fixed bound would retry for ever (real time, fake members)."""

    async def late(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        await trio.sleep(DELAY)
        headers = [(b"Transfer-Encoding", b"chunked")]
        await stream.send_all(http.send(h11.Response(status_code=200, headers=headers)) or b"")
        kv = {"key": "YTE=", "value": "", "create_revision": "6", "mod_revision": "6"}
        for result in ({"header": {"revision": "5"}, "created": True}, {"events": [{"kv": kv}]}):
            line = json.dumps({"result": result}).encode() + b"\n"
            await stream.send_all(http.send(h11.Data(data=line)) or b"")
        await trio.sleep_forever()
        return False

    members = [await FakeMember(late).start(nursery) for _ in range(3)]
    client = EtcdClient([member.url for member in members], deadline=3.0)
    start = trio.current_time()
    with trio.fail_after(6):
        async with client.watch(b"a", b"b", 0, silence=TTL) as watch:
            events = await watch.__anext__()
    assert [event.kv.key for event in events] == [b"a1"]
    assert [member.requests for member in members] == [1, 1, 0]
    assert 1.0 + DELAY <= trio.current_time() - start < 1.0 + 2.0
    await client.aclose()


async def test_the_first_attempt_is_read_on_past_its_part_of_the_deadline(
    nursery: trio.Nursery,
) -> None:
    """Over the real transport: a member that answers in 0.5 s, a call with a fresh
    attempt every 0.3 s. The first attempt's reply is still read when it comes (the
    call ends at 0.5 s, not at 0.8 s with the second's), on a connection fit to use
    again; the second attempt's is closed."""

    async def late(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        if request <= 2:  # the first call's two attempts; the next call's is quick
            await trio.sleep(0.5)
        return await ok(stream, http, request)

    member = await FakeMember(late).start(nursery)
    client = EtcdClient([member.url], deadline=0.9)
    start = trio.current_time()
    assert await client.put(b"k", b"v") == 7
    assert 0.5 <= trio.current_time() - start < 0.75
    assert member.connections == 2  # the second attempt's, at 0.3 s
    transport = client._transport
    assert len(transport._idle[member.url]) == 1 and transport._open == 1
    assert await client.put(b"k", b"v") == 7  # on the first attempt's connection
    assert member.connections == 2
    await client.aclose()
