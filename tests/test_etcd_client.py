"""The etcd gateway client against a real 3-member etcd cluster on loopback.

Real time throughout: etcd is an outside process, so a mock clock would only lie.
One cluster serves the whole module. Tests that kill or pause members take the
``whole`` fixture, which restarts and resumes them afterwards; they come last.
"""

from __future__ import annotations

import functools
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import h11
import pytest
import trio

from elockd.backend.cluster.etcd import client as etcd_client
from elockd.backend.cluster.etcd import transport as etcd_transport
from elockd.backend.cluster.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Event,
    Watch,
    WatchCompacted,
    compare_create,
    compare_lease,
    compare_mod,
    delete_op,
    prefix_end,
    put_op,
    range_op,
)
from tests.support.etcd_cluster import EtcdCluster, free_ports
from tests.support.polling import eventually

#: Needs a real etcd cluster: `pytest -m "not cluster"` leaves this module out.
pytestmark = pytest.mark.cluster

# ``etcd`` (conftest.py): a fresh 3-member cluster per module.


@pytest.fixture
def whole(etcd: EtcdCluster) -> Iterator[EtcdCluster]:
    """The module's cluster for a test that kills or pauses members; made whole afterwards."""
    try:
        yield etcd
    finally:
        etcd.heal()


@pytest.fixture
async def client(etcd: EtcdCluster) -> AsyncIterator[EtcdClient]:
    client = EtcdClient(etcd.endpoints)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def prefix() -> bytes:
    """A key prefix no other test touches (with a '/' and a 0xff byte in it)."""
    return b"t/" + uuid.uuid4().hex.encode() + b"/\xff/"


def dead_endpoint() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"


async def collect(watch: Watch, count: int, timeout: float = 5) -> list[Event]:
    """Exactly the first ``count`` events the watch yields (batches are not split)."""
    events: list[Event] = []
    with trio.fail_after(timeout):
        async for batch in watch:
            events.extend(batch)
            if len(events) >= count:
                break
    return events


# -- no cluster needed


def test_prefix_end() -> None:
    assert prefix_end(b"L/q/") == b"L/q0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"a\xfe\xff\xff") == b"a\xff"
    assert prefix_end(b"\xff\xff") == b"\0"
    assert prefix_end(b"") == b"\0"


def test_builders_encode_for_the_gateway() -> None:
    assert put_op(b"k", b"v", lease=2**62 + 1) == {
        "request_put": {"key": "aw==", "value": "dg==", "lease": str(2**62 + 1)}
    }
    assert range_op(b"k", b"l", count_only=True, limit=3, sort_by_create=True, keys_only=True) == {
        "request_range": {
            "key": "aw==",
            "range_end": "bA==",
            "count_only": True,
            "keys_only": True,
            "limit": "3",
            "sort_target": "CREATE",
            "sort_order": "ASCEND",
        }
    }
    assert delete_op(b"k") == {"request_delete_range": {"key": "aw=="}}
    assert compare_create(b"k", "==", 0, b"l") == {
        "key": "aw==",
        "target": "CREATE",
        "result": "EQUAL",
        "create_revision": "0",
        "range_end": "bA==",
    }
    assert compare_mod(b"k", "!=", 7)["result"] == "NOT_EQUAL"
    with pytest.raises(ValueError):
        compare_mod(b"k", "<=", 1)


async def test_watch_advances_only_on_complete_revisions() -> None:
    """A catching-up watch's headers run ahead of its events; resuming from them would skip."""
    client = EtcdClient(["http://127.0.0.1:1"])
    watch = client.watch(b"a", b"b", 5)

    def line(**result: object) -> str:
        return json.dumps({"result": {"header": {"revision": "100"}, **result}})

    kv = {"key": "YQ==", "create_revision": "5", "mod_revision": "5"}
    assert watch._absorb(line(created=True)) == []
    assert watch.last_revision == 4  # not 100: revisions 5..100 are still to come
    events = watch._absorb(line(events=[{"kv": kv}, {"type": "DELETE", "kv": dict(kv)}]))
    assert [event.type for event in events] == ["PUT", "DELETE"]
    assert watch.last_revision == 5
    assert watch._absorb(line(events=[{"kv": kv}])) == []  # already delivered: never twice
    assert watch._absorb(line()) == []  # a progress notification: caught up to 100
    assert watch.last_revision == 100
    with pytest.raises(WatchCompacted) as compacted:
        watch._absorb(line(canceled=True, compact_revision="42"))
    assert compacted.value.compact_revision == 42

    from_now = client.watch(b"a", b"b", 0)
    from_now._absorb(line(created=True))
    assert from_now.last_revision == 100  # a watch from now starts right after its header
    await client.aclose()


async def test_unreachable_endpoints_raise_unavailable_at_the_deadline() -> None:
    client = EtcdClient([dead_endpoint(), dead_endpoint()], deadline=0.5)
    start = trio.current_time()
    with pytest.raises(EtcdUnavailable):
        await client.put(b"k", b"v")
    assert 0.5 <= trio.current_time() - start < 1.0
    await client.aclose()


# -- the keep-alive transport, against fake members on loopback

# How a fake member answers one request: True keeps the connection for the next one.
Behaviour = Callable[[trio.SocketStream, h11.Connection, int], Awaitable[bool]]
REPLY = b'{"header": {"revision": "7"}}'


async def answer(stream: trio.SocketStream, http: h11.Connection, body: bytes = REPLY) -> None:
    headers = [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(body))]
    data = http.send(h11.Response(status_code=200, headers=headers))
    await stream.send_all((data or b"") + (http.send(h11.Data(data=body)) or b""))
    await stream.send_all(http.send(h11.EndOfMessage()) or b"")


async def ok(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
    await answer(stream, http)
    return True


class FakeMember:
    """An HTTP/1.1 server (h11) that answers each POST as ``behave`` says.

    It counts the connections it accepted, how many were open at once, and requests.
    """

    def __init__(self, behave: Behaviour = ok) -> None:
        self.behave = behave
        self.url = ""
        self.connections = self.open = self.most_open = self.requests = 0

    async def start(self, nursery: trio.Nursery) -> FakeMember:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), self._serve, 0
        )
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        return self

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        http = h11.Connection(h11.SERVER)
        try:
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    http.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.EndOfMessage):
                    self.requests += 1
                    if not await self.behave(stream, http, self.requests):
                        return
                    http.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except (trio.BrokenResourceError, h11.ProtocolError):
            pass  # the client gave up on this connection
        finally:
            self.open -= 1
            await stream.aclose()


async def test_unary_calls_reuse_keep_alive_connections(nursery: trio.Nursery) -> None:
    async def slow(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        await trio.sleep(0.02)
        return await ok(stream, http, request)

    member = await FakeMember(slow).start(nursery)
    client = EtcdClient([member.url], max_concurrent=3)
    for i in range(10):
        assert await client.put(b"k", b"%d" % i) == 7
    assert (member.connections, member.requests, client._transport.opened) == (1, 10, 1)

    async with trio.open_nursery() as calls:
        for i in range(12):
            calls.start_soon(client.put, b"k", b"%d" % i)
    assert member.requests == 22
    assert member.connections == member.most_open == 3  # capped at max_concurrent
    for _ in range(10):
        await client.get(b"k")
    assert member.connections == 3 and member.requests == 32  # all kept, none new
    await client.aclose()
    await eventually(lambda: member.open == 0, timeout=1, what="aclose closed the idle ones")


async def test_a_backlog_of_calls_waits_its_turn_and_is_not_read_as_etcd_down(
    nursery: trio.Nursery,
) -> None:
    """Six calls at once through a window of one, each answered in 0.2 s: the last
    is sent after a second, past the deadline, and still succeeds. Before, the
    deadline counted the wait for the window, and the fourth call on failed with
    "no attempt finished" while etcd answered every one it was sent. (The deadline
    gives each call 0.3 s before a second attempt: one connection is enough.)"""

    async def slow(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        await trio.sleep(0.2)
        return await ok(stream, http, request)

    member = await FakeMember(slow).start(nursery)
    client = EtcdClient([member.url], max_concurrent=1, deadline=0.9)
    revisions: list[int] = []

    async def put(i: int) -> None:
        revisions.append(await client.put(b"k", b"%d" % i))

    start = trio.current_time()
    async with trio.open_nursery() as calls:
        for i in range(6):
            calls.start_soon(put, i)
    assert revisions == [7] * 6
    assert member.most_open == 1 and trio.current_time() - start >= 1.2
    await client.aclose()


async def test_a_keepalive_is_not_queued_behind_the_backlog(nursery: trio.Nursery) -> None:
    """Lease keepalives have places of their own: with the window full of calls the
    member holds and more waiting, a keepalive is answered while they all still wait
    (the member lets the puts go only after it; a keepalive queued behind them would
    never be answered, and fail_after says so)."""
    release = trio.Event()

    async def held(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        await release.wait()
        return await keepalive_ok(stream, http, request)

    member = await FakeMember(keepalive_ok).start(nursery)
    client = EtcdClient([member.url], max_concurrent=2, deadline=5)
    assert await client.lease_keepalive(1) == 5  # opens a connection beside the window's
    member.behave = held
    done: list[int] = []

    async def put(i: int) -> None:
        await client.put(b"k", b"%d" % i)
        done.append(i)

    async with trio.open_nursery() as calls:
        for i in range(6):
            calls.start_soon(put, i)
        # The window is full (two puts at the member, after the first keepalive),
        # and four more wait.
        await eventually(lambda: member.requests == 3, timeout=5, what="the window full")
        member.behave = keepalive_ok
        with trio.fail_after(4):  # below the client's deadline: a queued one would fail
            assert await client.lease_keepalive(1) == 5
        assert done == [] and member.requests == 4  # every put still held or waiting
        member.behave = held
        release.set()
    assert sorted(done) == list(range(6))
    await client.aclose()


async def keepalive_ok(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
    """A keepalive's answer (a put reads only the revision, absent here: 0)."""
    await answer(stream, http, b'{"result": {"TTL": "5"}}')
    return True


async def silent(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
    """A member that takes requests and never answers."""
    await trio.sleep_forever()
    return False


async def five_at_once_against_silence(
    call: Callable[[int], Awaitable[object]],
) -> tuple[list[str], float]:
    """Five calls of ``call`` at once to a member that never answers, each failing with
    EtcdUnavailable: their messages, and how long until the last failed."""
    failed: list[str] = []

    async def one(i: int) -> None:
        with pytest.raises(EtcdUnavailable) as error:
            await call(i)
        failed.append(str(error.value))

    start = trio.current_time()
    async with trio.open_nursery() as calls:
        for i in range(5):
            calls.start_soon(one, i)
    return failed, trio.current_time() - start


async def test_when_etcd_is_down_a_backlog_fails_at_once_not_a_deadline_each(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """The member takes requests and never answers. The first call fails at its
    deadline; the four queued behind it were waiting while it did, so they fail at
    once too: a backlog drains in one deadline, not one deadline per call. On a
    MockClock, so ``took`` is exactly one deadline (0.5) whatever the machine's load,
    against 2.5 if each call waited a deadline of its own."""
    member = await FakeMember(silent).start(nursery)
    client = EtcdClient([member.url], max_concurrent=1, deadline=0.5, attempt_timeout=0.2)
    failed, took = await five_at_once_against_silence(lambda i: client.put(b"k", b"%d" % i))
    assert len(failed) == 5
    assert took < 0.9, took
    assert sum("while this one waited" in message for message in failed) == 4, failed
    await client.aclose()


async def test_when_etcd_is_down_txns_queued_for_a_batch_fail_at_once_too(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """The same for txns that wait in the batcher rather than for the window: five
    txns that each write the key the others compare, so each needs a batch of its
    own, and one batch in flight (a quarter of a window of 4). The first fails at
    its deadline; the four queued behind it fail at once, not a deadline each (on a
    MockClock, like the test above)."""
    member = await FakeMember(silent).start(nursery)
    client = EtcdClient([member.url], max_concurrent=4, deadline=0.5, attempt_timeout=0.2)
    nursery.start_soon(client.run_batches)
    await trio.testing.wait_all_tasks_blocked()  # the batcher runs
    failed, took = await five_at_once_against_silence(
        lambda i: client.txn([compare_create(b"k", "==", 0)], [put_op(b"k", b"%d" % i)])
    )
    assert len(failed) == 5
    assert took < 0.9, took
    assert sum("while this one waited" in message for message in failed) == 4, failed
    await client.aclose()


async def test_the_connection_cap_covers_every_endpoint(nursery: trio.Nursery) -> None:
    """Idle connections to the endpoint calls left make room for those to the new one.
    The cap is the window plus the keepalives' own places (URGENT_SLOTS)."""

    async def slow(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        await trio.sleep(0.05)
        return await ok(stream, http, request)

    first = await FakeMember(slow).start(nursery)
    second = await FakeMember(slow).start(nursery)
    window = 4
    cap = window + etcd_client.URGENT_SLOTS
    client = EtcdClient([first.url, second.url], max_concurrent=window)

    async def window_full() -> None:
        async with trio.open_nursery() as calls:
            for i in range(window):
                calls.start_soon(client.put, b"k", b"%d" % i)

    await window_full()
    assert first.most_open == window and client._transport._open == window
    client._current = 1  # as after a failover
    await window_full()
    assert second.most_open == window and client._transport._open == cap
    await eventually(lambda: first.open == cap - window, timeout=1, what="closed to make room")
    await client.aclose()


async def test_an_idle_connection_the_member_closed_is_not_used(nursery: trio.Nursery) -> None:
    """A keep-alive connection closed while idle is replaced, without a failover."""

    async def once(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        await answer(stream, http)
        return False  # close after the reply, without "Connection: close"

    member = await FakeMember(once).start(nursery)
    other = await FakeMember().start(nursery)
    client = EtcdClient([member.url, other.url])
    for _ in range(5):
        await client.put(b"k", b"v")
        # The member closes it (its FIN on the way) while the connection is idle.
        await eventually(lambda: member.open == 0, timeout=1, what="the member closed it")
    assert client.endpoint == member.url and other.requests == 0
    assert member.connections == member.requests == 5
    await client.aclose()


async def test_a_connection_dropped_mid_reply_is_discarded_and_the_call_fails_over(
    nursery: trio.Nursery,
) -> None:
    async def drop_second(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        if request != 2:
            return await ok(stream, http, request)
        headers = [(b"Content-Length", b"%d" % len(REPLY))]
        await stream.send_all(http.send(h11.Response(status_code=200, headers=headers)) or b"")
        await stream.send_all(REPLY[:5])
        return False  # and close, half-way through the body

    flaky = await FakeMember(drop_second).start(nursery)
    good = await FakeMember().start(nursery)
    client = EtcdClient([flaky.url, good.url])
    await client.put(b"k", b"1")  # through flaky: its connection is now idle in the pool
    assert client.endpoint == flaky.url and client._transport._open == 1
    assert await client.put(b"k", b"2") == 7  # flaky breaks off; good answers
    assert client.endpoint == good.url and (flaky.requests, good.requests) == (2, 1)
    assert client._transport._idle[flaky.url] == []  # discarded, not pooled
    assert client._transport._open == 1  # only the one to good
    await client.aclose()

    # One endpoint: the retry goes to the same member, over a new connection.
    flaky = await FakeMember(drop_second).start(nursery)
    client = EtcdClient([flaky.url])
    await client.put(b"k", b"1")
    assert await client.put(b"k", b"2") == 7
    assert flaky.connections == 2 and flaky.requests == 3 and client._transport._open == 1
    await client.aclose()


async def test_a_member_hanging_mid_reply_loses_the_connection(nursery: trio.Nursery) -> None:
    async def hang(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        headers = [(b"Content-Length", b"%d" % len(REPLY))]
        await stream.send_all(http.send(h11.Response(status_code=200, headers=headers)) or b"")
        await stream.send_all(REPLY[:5])
        assert await stream.receive_some() == b""  # until the client closes the connection
        return False

    hung = await FakeMember(hang).start(nursery)
    good = await FakeMember().start(nursery)
    client = EtcdClient([hung.url, good.url], attempt_timeout=0.3)
    start = trio.current_time()
    assert await client.put(b"k", b"v") == 7
    assert 0.3 <= trio.current_time() - start < 1.0
    assert client.endpoint == good.url
    assert client._transport._idle.get(hung.url, []) == [] and client._transport._open == 1
    await eventually(lambda: hung.open == 0, timeout=1, what="the cancelled attempt closed")
    await client.aclose()


async def test_an_oversized_reply_is_refused(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def declared(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        size = b"%d" % (64 * 1024 * 1024 + 1)
        await stream.send_all(
            http.send(h11.Response(status_code=200, headers=[(b"Content-Length", size)])) or b""
        )
        await trio.sleep(math.inf)  # refused on the headers alone: no need to send it
        return False

    async def endless(stream: trio.SocketStream, http: h11.Connection, request: int) -> bool:
        headers = [(b"Transfer-Encoding", b"chunked")]  # no length said up front
        await stream.send_all(http.send(h11.Response(status_code=200, headers=headers)) or b"")
        while True:
            await stream.send_all(http.send(h11.Data(data=b" " * 512)) or b"")
            await trio.sleep(0.001)

    good = await FakeMember().start(nursery)
    big = await FakeMember(declared).start(nursery)
    monkeypatch.setattr(etcd_transport, "_MAX_RESPONSE", 4096)  # for the endless one
    endless_member = await FakeMember(endless).start(nursery)
    for bad in (big, endless_member):
        client = EtcdClient([bad.url, good.url], attempt_timeout=5)
        start = trio.current_time()
        assert await client.put(b"k", b"v") == 7
        assert trio.current_time() - start < 1.0  # refused at once, not at attempt_timeout
        assert client.endpoint == good.url and bad.requests == 1
        assert client._transport._open == 1  # the refused connection was closed
        await client.aclose()


# -- against the cluster


async def test_put_get_round_trip(client: EtcdClient, prefix: bytes) -> None:
    keys = [prefix + b"a/b", prefix + b"a\xff", prefix + b"\xff\xff/x", prefix + b"z"]
    revisions = [await client.put(key, bytes(range(256)) + key) for key in keys]
    assert revisions == sorted(revisions) and len(set(revisions)) == 4

    revision, kvs, count = await client.get(keys[1])
    assert revision >= revisions[-1] and count == 1
    assert kvs[0].key == keys[1] and kvs[0].value == bytes(range(256)) + keys[1]
    assert kvs[0].create_revision == kvs[0].mod_revision == revisions[1] and kvs[0].lease == 0

    end = prefix_end(prefix)
    _, kvs, count = await client.get(prefix, end, sort_by_create=True)
    assert [kv.key for kv in kvs] == keys and count == 4
    _, kvs, count = await client.get(prefix, end, sort_by_create=True, limit=2)
    assert [kv.key for kv in kvs] == keys[:2] and count == 4
    assert (await client.get(prefix, end, count_only=True))[1:] == ([], 4)

    deleted = (await client.txn([], [delete_op(prefix, end)])).responses[0]
    assert deleted["response_delete_range"]["deleted"] == "4"
    assert (await client.get(prefix, end))[1:] == ([], 0)  # gateway omits "count": 0


async def test_calls_share_one_keep_alive_connection(client: EtcdClient, prefix: bytes) -> None:
    for i in range(5):
        await client.put(prefix + b"k", b"%d" % i)
        await client.get(prefix + b"k")
    await client.lease_revoke((await client.lease_grant(5))[0])
    assert client._transport.opened == 1


async def test_txn_success_and_failure(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"k"
    create = [compare_create(key, "==", 0)]
    first = await client.txn(create, [put_op(key, b"1"), range_op(key)], [range_op(key)])
    assert first.succeeded and first.revision > 0
    assert [kv.value for kv in first.kvs(1)] == [b"1"] and first.count(1) == 1
    assert first.kvs(1)[0].create_revision == first.revision

    second = await client.txn(create, [put_op(key, b"2")], [range_op(key)])
    assert second.succeeded is False  # the gateway leaves "succeeded" out when false
    assert [kv.value for kv in second.kvs(0)] == [b"1"] and second.count(0) == 1
    assert second.revision == first.revision  # nothing written

    assert (await client.txn([compare_mod(key, "==", first.revision)], [])).succeeded
    assert (await client.txn([compare_create(key, ">", 0)], [])).succeeded
    assert not (await client.txn([compare_create(key, "<", first.revision)], [])).succeeded
    assert (await client.txn([], [delete_op(key)])).responses[0]["response_delete_range"]


async def test_compare_lease_tells_which_lease_a_key_hangs_on(
    client: EtcdClient, prefix: bytes
) -> None:
    key = prefix + b"k"
    (lease, _), (other, _) = await client.lease_grant(30), await client.lease_grant(30)
    await client.put(key, b"v", lease)
    assert (await client.txn([compare_lease(key, "==", lease)], [])).succeeded
    assert not (await client.txn([compare_lease(key, "==", other)], [])).succeeded
    await client.put(key, b"v", other)  # moved onto another lease, as a takeover does
    assert not (await client.txn([compare_lease(key, "==", lease)], [delete_op(key)])).succeeded
    assert [kv.lease for kv in (await client.get(key))[1]] == [other]


async def test_compare_create_with_range_end_tells_if_a_prefix_is_empty(
    client: EtcdClient, prefix: bytes
) -> None:
    queue = prefix + b"q/"
    empty = [compare_create(queue, "==", 0, prefix_end(queue))]
    count = range_op(queue, prefix_end(queue), count_only=True)
    result = await client.txn(empty, [put_op(queue + b"first", b"")], [count])
    assert result.succeeded
    result = await client.txn(empty, [put_op(queue + b"second", b"")], [count])
    assert not result.succeeded and result.count(0) == 1
    assert (await client.get(queue + b"second"))[1] == []


async def test_leases(client: EtcdClient, prefix: bytes) -> None:
    lease, ttl = await client.lease_grant(5)
    assert isinstance(lease, int) and lease > 0 and ttl == 5
    key = prefix + b"held"
    await client.put(key, b"v", lease=lease)
    assert (await client.get(key))[1][0].lease == lease
    assert await client.lease_keys(lease) == [key]
    assert 0 < await client.lease_keepalive(lease) <= 5

    assert await client.lease_revoke(lease) is True
    assert (await client.get(key))[1] == []  # revoke deletes the lease's keys
    assert await client.lease_keepalive(lease) == 0
    assert await client.lease_keys(lease) is None
    assert await client.lease_revoke(lease) is False


async def test_lease_ids_beyond_2_53_survive(client: EtcdClient, prefix: bytes) -> None:
    """Lease IDs are int64s sent as strings; a float on the way would round 2**62 + 1."""
    lease = 2**62 + 1
    reply = await client.call("lease/grant", {"TTL": "5", "ID": str(lease)})
    assert int(reply["ID"]) == lease
    key = prefix + b"k"
    await client.put(key, b"v", lease=lease)
    assert (await client.get(key))[1][0].lease == lease
    assert await client.lease_keys(lease) == [key]
    assert await client.lease_keepalive(lease) > 0
    assert await client.lease_revoke(lease) is True


async def test_txns_sent_together_are_batched_and_each_answered_as_alone(
    etcd: EtcdCluster, prefix: bytes
) -> None:
    """Group commit against a real etcd: 20 creates of keys of their own, 5 racing
    creates of one key, and a put on a lease etcd does not have, all at once. Each
    gets the answer it would get alone: every own key created, one racer wins and
    the others see its value, and only the put on the missing lease is refused."""
    client = EtcdClient(etcd.endpoints, max_concurrent=4)  # one batch in flight
    results: dict[bytes, object] = {}

    async def create(name: bytes, key: bytes, lease: int = 0) -> None:
        try:
            results[name] = await client.txn(
                [compare_create(key, "==", 0)], [put_op(key, name, lease)], [range_op(key)]
            )
        except EtcdError as error:
            results[name] = error

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run_batches)
            await trio.sleep(0)
            with trio.fail_after(10):
                async with trio.open_nursery() as requests:
                    for i in range(20):
                        requests.start_soon(create, b"own%d" % i, prefix + b"own%d" % i)
                    requests.start_soon(create, b"stray", prefix + b"stray", 2**40 + 7)
                    for i in range(5):
                        requests.start_soon(create, b"race%d" % i, prefix + b"shared")
            nursery.cancel_scope.cancel()
        batches, batched = client.batch_counts
        assert batches >= 1 and batched >= 2, (batches, batched)  # nested replies read
        for i in range(20):
            result = results[b"own%d" % i]
            assert isinstance(result, etcd_client.TxnResult) and result.succeeded
            assert [kv.value for kv in (await client.get(prefix + b"own%d" % i))[1]] == [
                b"own%d" % i
            ]
        stray = results[b"stray"]
        assert isinstance(stray, EtcdError) and "lease not found" in stray.message
        races = [results[b"race%d" % i] for i in range(5)]
        assert all(isinstance(race, etcd_client.TxnResult) for race in races)
        winners = [
            race for race in races if isinstance(race, etcd_client.TxnResult) and race.succeeded
        ]
        assert len(winners) == 1
        _, stored, _ = await client.get(prefix + b"shared")
        for race in races:
            assert isinstance(race, etcd_client.TxnResult)
            if not race.succeeded:
                assert race.kvs(0) == stored  # the winner's, as a later txn alone sees it
    finally:
        await client.aclose()


@pytest.mark.serial  # a wall-clock bound on real etcd: run alone
async def test_error_reply_raises_at_once(client: EtcdClient, prefix: bytes) -> None:
    start = trio.current_time()
    with pytest.raises(EtcdError) as error:
        await client.txn([], [put_op(prefix, b"1"), put_op(prefix, b"2")])
    assert error.value.code == 3 and "duplicate key" in error.value.message
    assert trio.current_time() - start < 0.5


async def test_watch_sees_puts_and_deletes_in_order(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"w"
    start = await client.put(prefix + b"before", b"") + 1
    first = await client.put(key, b"v1")
    await client.put(key, b"v2")
    await client.txn([], [delete_op(key)])
    async with client.watch(prefix, prefix_end(prefix), start) as watch:
        events = await collect(watch, 3)  # history, replayed from start
        await client.put(key, b"v3")
        events += await collect(watch, 1)  # live
    assert [event.type for event in events] == ["PUT", "PUT", "DELETE", "PUT"]
    assert [event.kv.value for event in events] == [b"v1", b"v2", b"", b"v3"]
    assert events[0].kv.mod_revision == first
    assert [event.kv.mod_revision for event in events] == list(range(first, first + 4))
    assert {event.kv.key for event in events} == {key}


async def test_watch_from_now_and_past_a_dead_endpoint(etcd: EtcdCluster, prefix: bytes) -> None:
    client = EtcdClient([dead_endpoint(), *etcd.endpoints])

    async def write_until_seen() -> None:
        while True:  # the watch only sees what comes after it is created
            await client.put(prefix + b"k", b"v")
            await trio.sleep(0.05)

    async with client.watch(prefix, prefix_end(prefix), 0) as watch, trio.open_nursery() as nursery:
        nursery.start_soon(write_until_seen)
        events = await collect(watch, 1)
        nursery.cancel_scope.cancel()
    assert events[0].kv.key == prefix + b"k"
    assert watch.endpoint != client.endpoints[0]
    await client.aclose()


async def test_watch_compacted(client: EtcdClient, prefix: bytes) -> None:
    for i in range(3):
        revision = await client.put(prefix + b"k", b"%d" % i)
    await client.call("kv/compaction", {"revision": str(revision), "physical": True})
    async with client.watch(prefix, prefix_end(prefix), revision - 1) as watch:
        with pytest.raises(WatchCompacted) as compacted:
            await collect(watch, 1)
        assert compacted.value.compact_revision == revision
        with pytest.raises(StopAsyncIteration):
            await watch.__anext__()  # a compacted watch is over; the caller resyncs


# -- destructive: members die or pause (the `whole` fixture brings them back)


def name_of(etcd: EtcdCluster, endpoint: str) -> str:
    return next(m.name for m in etcd.members.values() if m.url == endpoint)


async def test_watch_resumes_without_loss_or_repeat_when_its_member_dies(
    whole: EtcdCluster, prefix: bytes
) -> None:
    """Kill the member serving the watch (the leader, the harder case) amid a stream of puts."""
    etcd = whole
    leader_url = etcd.members[etcd.leader()].url
    watcher = EtcdClient([leader_url, *(url for url in etcd.endpoints if url != leader_url)])
    writer = EtcdClient([url for url in etcd.endpoints if url != leader_url], deadline=10)
    total, kill_at = 60, 20
    start = await writer.put(prefix + b"start", b"") + 1
    expected = [prefix + b"%03d" % i for i in range(total)]
    async with watcher.watch(prefix, prefix_end(prefix), start) as watch:
        events: list[Event] = []
        async with trio.open_nursery() as nursery:

            async def consume() -> None:
                events.extend(await collect(watch, total, timeout=15))

            nursery.start_soon(consume)
            for i, key in enumerate(expected):
                if i == kill_at:
                    assert watch.endpoint == leader_url  # it was serving the stream
                    etcd.kill(name_of(etcd, leader_url))
                await writer.put(key, b"")
                await trio.sleep(0.005)
        assert watch.endpoint != leader_url
    assert [event.kv.key for event in events] == expected  # each exactly once, in order
    revisions = [event.kv.mod_revision for event in events]
    assert revisions == sorted(set(revisions))
    await watcher.aclose()
    await writer.aclose()


async def test_call_fails_over_fast_when_its_member_dies(whole: EtcdCluster) -> None:
    etcd = whole
    follower = etcd.members[etcd.follower()]
    client = EtcdClient([follower.url, *(url for url in etcd.endpoints if url != follower.url)])
    await client.put(b"t/failover", b"1")  # a pooled connection to the follower now exists
    assert client.endpoint == follower.url
    etcd.kill(follower.name)
    start = trio.current_time()
    await client.put(b"t/failover", b"2")
    assert trio.current_time() - start < 1.0
    assert client.endpoint != follower.url
    assert (await client.get(b"t/failover"))[1][0].value == b"2"
    await client.aclose()


async def test_minority_is_unavailable_then_recovers(whole: EtcdCluster) -> None:
    etcd = whole
    client = EtcdClient(etcd.endpoints, attempt_timeout=0.5, deadline=2.0)
    await client.put(b"t/minority", b"1")
    paused = [name for name in etcd.members if etcd.members[name].url != client.endpoint]
    for name in paused:
        etcd.stop(name)
    operations: list[Callable[[], Awaitable[object]]] = [
        lambda: client.put(b"t/minority", b"2"),
        lambda: client.get(b"t/minority"),  # linearizable: a minority member cannot answer
    ]
    for operation in operations:
        start = trio.current_time()
        with pytest.raises(EtcdUnavailable):
            await operation()
        assert client.deadline <= trio.current_time() - start < client.deadline + 1
    for name in paused:
        etcd.cont(name)
    # A fresh key: the refused put of "2" was only ambiguous, not undone. Its copies
    # still queued at the paused members may commit after they resume, even after a
    # later write of the same key (that is why elockd's writes are compare-guarded).
    with trio.fail_after(10):  # an election may be due first
        while True:
            try:
                await client.put(b"t/after-minority", b"3")
                break
            except EtcdUnavailable:
                pass
    assert (await client.get(b"t/after-minority"))[1][0].value == b"3"
    assert (await client.get(b"t/minority"))[1][0].value in (b"1", b"2")
    await client.aclose()
