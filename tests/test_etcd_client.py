"""The etcd gateway client against a real 3-member etcd cluster on loopback.

Real time throughout: etcd is an outside process, so a mock clock would only lie.
One cluster serves the whole module. Tests that kill or pause members take the
``whole`` fixture, which restarts and resumes them afterwards; they come last.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import trio

from elockd.cluster.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    Event,
    Watch,
    WatchCompacted,
    compare_create,
    compare_mod,
    compare_value,
    delete_op,
    prefix_end,
    put_op,
    range_op,
)
from tests.etcd_cluster import EtcdCluster, free_ports


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A fresh 3-member cluster; a missing etcd is a broken test setup, not a skip."""
    if shutil.which("etcd") is None:
        pytest.fail("etcd not found: install etcd-server (see .ci/run)")
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


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
    assert compare_value(b"k", "<", b"v")["value"] == "dg=="
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


# -- against the cluster


async def test_put_get_delete_round_trip(client: EtcdClient, prefix: bytes) -> None:
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

    assert await client.delete(keys[0]) == 1
    assert await client.delete(keys[0]) == 0
    assert await client.delete(prefix, end) == 3
    assert (await client.get(prefix, end))[1:] == ([], 0)  # gateway omits "count": 0


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
    assert (await client.txn([compare_value(key, "==", b"1")], [])).succeeded
    assert not (await client.txn([compare_value(key, "!=", b"1")], [])).succeeded
    assert (await client.txn([], [delete_op(key)])).responses[0]["response_delete_range"]


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


async def test_error_reply_raises_at_once(client: EtcdClient, prefix: bytes) -> None:
    start = trio.current_time()
    with pytest.raises(EtcdError) as error:
        await client.txn([], [put_op(prefix, b"1"), put_op(prefix, b"2")])
    assert error.value.code == 3 and "duplicate key" in error.value.message
    assert trio.current_time() - start < 0.5


async def test_status(client: EtcdClient, etcd: EtcdCluster) -> None:
    status = await client.status(etcd.endpoints[0])
    assert int(status["leader"]) > 0 and int(status["header"]["member_id"]) > 0
    with pytest.raises(EtcdUnavailable):
        await client.status(dead_endpoint())


async def test_watch_sees_puts_and_deletes_in_order(client: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"w"
    start = await client.put(prefix + b"before", b"") + 1
    first = await client.put(key, b"v1")
    await client.put(key, b"v2")
    deleted = await client.delete(key)
    assert deleted == 1
    async with client.watch(prefix, prefix_end(prefix), start) as watch:
        events = await collect(watch, 3)  # history, replayed from start
        await client.put(key, b"v3")
        events += await collect(watch, 1)  # live
    assert [event.type for event in events] == ["PUT", "PUT", "DELETE", "PUT"]
    assert [event.kv.value for event in events] == [b"v1", b"v2", b"", b"v3"]
    assert [event.prev_kv and event.prev_kv.value for event in events] == [
        None,
        b"v1",
        b"v2",
        None,
    ]
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
    with trio.fail_after(10):  # an election may be due first
        while True:
            try:
                await client.put(b"t/minority", b"3")
                break
            except EtcdUnavailable:
                pass
    assert (await client.get(b"t/minority"))[1][0].value == b"3"
    await client.aclose()
