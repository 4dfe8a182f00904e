"""Several elockd nodes over one real 3-member etcd cluster (docs/cluster.md, "Tests").

Real time here: etcd and the nodes are separate processes, so MockClock cannot
reach them. Every wait is bounded, and the bounds are generous multiples of what
etcd needs on this machine (a few ms per txn).
"""

from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest
import trio

from elockd.backend.cluster.etcd.client import EtcdClient, KeyValue, prefix_end
from tests.support.cluster_nodes import TEST_SESSION_TTL, Node, Nodes
from tests.support.etcd_cluster import EtcdCluster, free_ports
from tests.support.line_client import LineClient
from tests.support.polling import eventually, nothing_arrives, resumed, stats_showing, until_waiting
from tests.support.server_process import start_server, stop_server
from tests.test_metrics import parse, tool, value

#: Needs a real etcd cluster: `pytest -m "not cluster"` leaves this module out.
pytestmark = pytest.mark.cluster


@pytest.mark.serial  # sub-second hand-off bound on real processes: run alone
async def test_exclusive_across_nodes_and_fifo_handoff(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    first, second = await a.connect(), await b.connect()
    assert await first.request(b"lock job") == b"200 Acquired"
    assert await second.request(b"g job") == b"0 Cannot Get Lock"
    first_token = int((await first.request(b"token job")).split()[1])
    await second.send(b"lock job 5\n")
    await until_waiting(first, b"job")
    assert await first.request(b"unlock job") == b"200 Unlocked"
    start = trio.current_time()
    assert await second.line() == b"200 Acquired\r\n"
    assert trio.current_time() - start < 0.5
    second_token = int((await second.request(b"token job")).split()[1])
    assert second_token > first_token


# ----------------------------------------------------------------- helpers


async def token_of(client: LineClient, key: bytes) -> int:
    """The fencing token of ``client``'s exclusive hold on ``key`` (asserts it holds it)."""
    reply = await client.request(b"token " + key)
    code, _, value = reply.partition(b" ")
    assert code == b"200", reply
    return int(value)


async def info_of(client: LineClient, key: bytes) -> dict[bytes, bytes]:
    """The fields of ``info KEY`` (``key``, ``exclusive``, ``shared``, ...)."""
    reply = await client.request(b"info " + key)
    assert reply.startswith(b"200 "), reply
    return dict(field.split(b"=", 1) for field in reply[4:].split(b" "))


async def named(node: Node, name: bytes) -> LineClient:
    """A connection whose holds show up as ``name`` in ``d``, ``sd`` and ``info``."""
    client = await node.connect()
    assert await client.request(b"iam " + name) == b"1 ok"
    return client


async def etcd_kvs(etcd: EtcdCluster, prefix: bytes) -> list[KeyValue]:
    """Every key-value under ``prefix`` in etcd, read directly (not through a node)."""
    client = EtcdClient(etcd.endpoints)
    try:
        _, kvs, _ = await client.get(prefix, prefix_end(prefix))
    finally:
        await client.aclose()
    return kvs


async def etcd_keys(etcd: EtcdCluster, prefix: bytes) -> list[bytes]:
    """Every key under ``prefix`` in etcd, read directly (not through a node)."""
    return [kv.key for kv in await etcd_kvs(etcd, prefix)]


# ------------------------------------------------------------------- FIFO


async def test_fifo_order_and_increasing_tokens_over_two_nodes(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    holder = await named(a, b"holder")
    assert await holder.request(b"lock K") == b"200 Acquired"
    tokens = [await token_of(holder, b"K")]
    waiters = []
    for i in range(4):
        waiter = await named((b, a)[i % 2], b"w%d" % i)
        await waiter.send(b"lock K 10\n")
        waiters.append(waiter)
        await until_waiting(holder, b"K", i + 1)  # each lands before the next is sent
    with trio.fail_after(5):
        info = await info_of(holder, b"K")
        assert (info[b"exclusive"], info[b"waiting"]) == (b"holder", b"4")
        releasing = holder
        for i, waiter in enumerate(waiters):
            assert await releasing.request(b"unlock K") == b"200 Unlocked"
            assert await waiter.line() == b"200 Acquired\r\n"
            for later in waiters[i + 1 :]:
                await nothing_arrives(later, 0.02)
            info = await info_of(waiter, b"K")
            assert info[b"exclusive"] == b"w%d" % i
            assert info[b"waiting"] == b"%d" % (3 - i)
            tokens.append(await token_of(waiter, b"K"))
            # A waited grant's token, here as in info on its node, is its entry's:
            # revision and the rank its node gave it.
            assert info[b"token"] == b"%d" % tokens[-1], info
            releasing = waiter
        assert await releasing.request(b"unlock K") == b"200 Unlocked"
    assert tokens == sorted(set(tokens)), tokens  # strictly increasing


# ----------------------------------------------------------------- shared


async def test_shared_with_limit_and_unlimited_across_nodes(nodes: Nodes) -> None:
    a, b, c = nodes.start(), nodes.start(), nodes.start()
    s1, s2, s3 = await named(a, b"s1"), await named(b, b"s2"), await named(c, b"s3")
    with trio.fail_after(5):
        assert await s1.request(b"lock_shared K 5 limit=2") == b"200 1"
        assert await s2.request(b"lock_shared K 5 limit=2") == b"200 2"
        await s3.send(b"lock_shared K 5 limit=2\n")
        await nothing_arrives(s3, 0.3)
        assert (await info_of(s1, b"K"))[b"waiting"] == b"1"
        assert await s1.request(b"unlock_shared K") == b"200 2"
        assert await s3.line() == b"200 2\r\n"
        assert await s1.request(b"si K") == b"2 Locked"
        await s1.send(b"sd K\n")
        assert sorted(await s1.lines_until_end()) == [b"END\r\n", b"K: s2\r\n", b"K: s3\r\n"]

        # Unlimited: everyone is granted at once, and every node counts them all.
        assert await s1.request(b"sg U") == b"1 Got Lock"
        assert await s2.request(b"sg U") == b"2 Got Lock"
        assert await s2.request(b"sg U") == b"2 Got Lock"  # a repeat adds no hold
        assert await s3.request(b"sg U") == b"3 Got Lock"
        observer = await c.connect()
        assert await observer.request(b"si U") == b"3 Locked"
        await observer.send(b"sd U\n")
        assert sorted(await observer.lines_until_end()) == [
            b"END\r\n",
            b"U: s1\r\n",
            b"U: s2\r\n",
            b"U: s3\r\n",
        ]
        assert await s2.request(b"sr U") == b"1 Released Lock"
        assert await observer.request(b"si U") == b"2 Locked"


# -------------------------------------------------------------- multi-key


async def test_multi_key_waiter_is_served_before_a_later_single_key_waiter(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    first, second, third = await named(a, b"A"), await named(b, b"B"), await named(a, b"C")
    with trio.fail_after(5):
        assert await first.request(b"lock x") == b"200 Acquired"
        await second.send(b"mlock x y wait=5\n")
        await until_waiting(first, b"x")
        await third.send(b"lock y 5\n")
        await until_waiting(first, b"y")  # behind B, the head of y that does not hold it
        # B waits for x and is queued on y ahead of C, so C does not get the free y.
        await nothing_arrives(third, 0.1)
        assert await first.request(b"unlock x") == b"200 Unlocked"
        assert await second.line() == b"200 Acquired\r\n"
        await nothing_arrives(third, 0.15)
        token_x, token_y = await token_of(second, b"x"), await token_of(second, b"y")
        assert token_y == token_x + 1  # one request: its keys ranked in byte order
        assert await second.request(b"unlock_all") == b"200 OK"
        assert await third.line() == b"200 Acquired\r\n"
        assert await token_of(third, b"y") > token_y


async def test_multi_key_waiters_never_deadlock(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    patterns = [b"p q", b"q p", b"q r p", b"p"]
    holders: dict[bytes, int] = {}  # key -> worker holding it, as the clients see it
    tokens: dict[bytes, list[int]] = {b"p": [], b"q": [], b"r": []}
    rounds = 15
    done = []

    async def worker(index: int, node: Node) -> None:
        client = await node.connect()
        keys = patterns[index].split()
        for _ in range(rounds):
            assert await client.request(b"mlock %s wait=5" % patterns[index]) == b"200 Acquired"
            for key in keys:
                assert key not in holders, f"{key!r} granted to {index} and {holders[key]}"
                holders[key] = index
            mine = {key: await token_of(client, key) for key in keys}
            # One request, one revision: its keys' tokens follow each other.
            first = min(mine.values())
            assert [mine[key] for key in sorted(keys)] == list(range(first, first + len(keys)))
            for key, token in mine.items():
                tokens[key].append(token)
            for key in keys:
                del holders[key]
            assert await client.request(b"unlock_all") == b"200 OK"
        done.append(index)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for index in range(4):
                nursery.start_soon(worker, index, (a, b)[index % 2])
    assert sorted(done) == [0, 1, 2, 3]
    for key, seen in tokens.items():
        assert seen == sorted(set(seen)), (key, seen)  # grants of a key in token order
    assert len(tokens[b"p"]) == 4 * rounds


# ---------------------------------------------------------------- timeout


@pytest.mark.serial  # sub-second bounds on real processes: run alone
async def test_wait_timeout_leaves_no_entry_behind(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    holder, waiter = await a.connect(), await b.connect()
    with trio.fail_after(5):
        assert await holder.request(b"lock K") == b"200 Acquired"
        start = trio.current_time()
        assert await waiter.request(b"lock K 0.3") == b"409 Unavailable"
        elapsed = trio.current_time() - start
        assert 0.29 <= elapsed < 1.0, elapsed
        assert (await info_of(holder, b"K"))[b"waiting"] == b"0"
        assert (await info_of(waiter, b"K"))[b"waiting"] == b"0"
        assert (await waiter.stats())["timeouts"] == 1
        later = await a.connect()
        await later.send(b"lock K 5\n")
        await until_waiting(holder, b"K")
        assert await holder.request(b"unlock K") == b"200 Unlocked"
        start = trio.current_time()
        assert await later.line() == b"200 Acquired\r\n"
        assert trio.current_time() - start < 0.3


# --------------------------------------------------------- try-lock multi


async def test_try_mlock_is_all_or_nothing(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    holder, other = await named(a, b"holder"), await named(b, b"other")
    with trio.fail_after(5):
        assert await holder.request(b"lock b") == b"200 Acquired"
        assert await other.request(b"mlock a b c") == b"409 Unavailable b"
        observer = await a.connect()
        await observer.send(b"d\n")
        assert await observer.lines_until_end() == [b"b: holder\r\n", b"END\r\n"]
        for key in (b"a", b"c"):
            assert await observer.request(b"info " + key) == (
                b"200 key=%s exclusive=- shared=0 waiting=0 ttl=- token=-" % key
            )
        assert await other.request(b"token a") == b"403 Not Locked"
        # Free keys: all granted, each with a token of its own.
        assert await other.request(b"mlock d e f") == b"200 Acquired"
        tokens = [await token_of(other, key) for key in (b"d", b"e", b"f")]
        assert tokens == sorted(set(tokens))
        assert await holder.request(b"unlock b") == b"200 Unlocked"
        assert await other.request(b"mlock a b c") == b"200 Acquired"
        tokens = [await token_of(other, key) for key in (b"a", b"b", b"c")]
        assert tokens == sorted(set(tokens))
        await observer.send(b"d\n")
        assert sorted(await observer.lines_until_end()) == [
            b"END\r\n",
            *(b"%s: other\r\n" % key for key in (b"a", b"b", b"c", b"d", b"e", b"f")),
        ]


# -------------------------------------------------------------------- iam


async def test_iam_names_a_hold_granted_just_before(nodes: Nodes) -> None:
    """A try answers from its own txn, before the node's mirror has the new entry;
    an ``iam`` right after must still rename that hold, on every node. Fifty rounds:
    when ``iam`` read the mirror, about one in ten kept the address."""
    a, b = nodes.start(), nodes.start()
    observer = await b.connect()
    with trio.fail_after(20):
        for index in range(50):
            client = await a.connect()
            key, name = b"k%d" % index, b"worker-%d" % index
            assert await client.request(b"g " + key) == b"1 Got Lock"
            assert await client.request(b"iam " + name) == b"1 ok"
            await client.send(b"d " + key + b"\n")
            assert await client.lines_until_end() == [b"%s: %s\r\n" % (key, name), b"END\r\n"]
            assert (await info_of(observer, key))[b"exclusive"] == name
            await client.aclose()


# ------------------------------------------------------------- disconnect


@pytest.mark.serial  # sub-second bound on real processes: run alone
async def test_disconnect_frees_holds_and_waits_at_once(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    holder, blocker = await named(a, b"holder"), await named(b, b"blocker")
    waiter = await named(b, b"waiter")
    with trio.fail_after(5):
        assert await blocker.request(b"lock Z") == b"200 Acquired"
        assert await holder.request(b"lock K") == b"200 Acquired"
        assert await holder.request(b"sg S") == b"1 Got Lock"
        await holder.send(b"lock Z 10\n")  # the holder also waits, on Z
        await waiter.send(b"lock K 5\n")
        await until_waiting(blocker, b"Z")
        await until_waiting(blocker, b"K")
        await holder.aclose()
        start = trio.current_time()
        assert await waiter.line() == b"200 Acquired\r\n"
        assert trio.current_time() - start < 0.2
        await blocker.send(b"d\n")
        assert await blocker.lines_until_end() == [b"K: waiter\r\n", b"Z: blocker\r\n", b"END\r\n"]
        await blocker.send(b"sd\n")
        assert await blocker.lines_until_end() == [b"END\r\n"]
        for key in (b"K", b"Z"):
            assert (await info_of(blocker, key))[b"waiting"] == b"0"
        assert await blocker.request(b"si S") == b"0 Not Locked"


# ------------------------------------------------------------ token floor


async def test_locks_granted_together_get_tokens_of_their_own(
    nodes: Nodes, etcd: EtcdCluster
) -> None:
    """Requests that reach a node together go to etcd in one txn (group commit) and
    so share a revision; the entries' ranks still give every hold a token of its
    own, and an mlock's keys consecutive ones. The floor is a multiple of 64 here, so
    a token tells its revision: the test also sees that holds did share one."""
    floor = 64 * 10**16
    client = EtcdClient(etcd.endpoints)
    try:
        await client.put(nodes.prefix.encode() + b"meta/token_floor", b"%d" % floor)
    finally:
        await client.aclose()
    node = nodes.start()
    clients = [await node.connect() for _ in range(40)]
    requests = [b"lock own%d" % i for i in range(38)] + [b"mlock m1 m2 m3", b"mlock m4 m5"]
    with trio.fail_after(10):
        for connection, request in zip(clients, requests, strict=True):
            await connection.send(request + b"\n")
        for connection in clients:
            assert await connection.line() == b"200 Acquired\r\n"
        tokens = [await token_of(c, b"own%d" % i) for i, c in enumerate(clients[:38])]
        for connection, keys in ((clients[38], b"m1 m2 m3"), (clients[39], b"m4 m5")):
            mine = [await token_of(connection, key) for key in keys.split()]
            assert mine == list(range(mine[0], mine[0] + len(mine)))
            tokens += mine
    assert len(set(tokens)) == len(tokens), sorted(tokens)
    # One token per request: an mlock's own keys share a revision in any case.
    revisions = [(token - floor) // 64 for token in tokens[:38] + [tokens[38], tokens[41]]]
    assert len(set(revisions)) < len(revisions), "no two requests shared a revision"


async def test_tokens_start_above_the_recorded_floor(nodes: Nodes, etcd: EtcdCluster) -> None:
    floor = 10**18 + 12345
    client = EtcdClient(etcd.endpoints)
    try:
        await client.put(nodes.prefix.encode() + b"meta/token_floor", b"%d" % floor)
    finally:
        await client.aclose()
    a, b = nodes.start(), nodes.start()
    first, second = await a.connect(), await b.connect()
    with trio.fail_after(5):
        assert await first.request(b"lock K") == b"200 Acquired"
        first_token = await token_of(first, b"K")
        assert floor < first_token < floor + 10**9
        assert await second.request(b"g L") == b"1 Got Lock"
        assert await token_of(second, b"L") > first_token
        info = await info_of(second, b"K")
        assert info[b"token"] == b"%d" % first_token

    # A prefix created later (its floor is the wall clock) issues larger tokens
    # than one created earlier: here two fresh prefixes one after the other.
    earlier, later = Nodes(etcd), Nodes(etcd)
    try:
        old = await earlier.start().connect()
        with trio.fail_after(5):
            assert await old.request(b"lock K") == b"200 Acquired"
            old_token = await token_of(old, b"K")
        assert old_token > first_token  # the wall clock in ns is above 10**18 + 12345
        new = await later.start().connect()
        with trio.fail_after(5):
            assert await new.request(b"lock K") == b"200 Acquired"
            new_token = await token_of(new, b"K")
        assert new_token > old_token
        floors = []
        for prefix in (earlier.prefix, later.prefix):
            client = EtcdClient(etcd.endpoints)
            try:
                _, kvs, _ = await client.get(prefix.encode() + b"meta/token_floor")
            finally:
                await client.aclose()
            floors.append(int(kvs[0].value))
        # The floors are wall-clock readings (ns), and each token is its floor plus
        # an etcd revision times 64 (plus the key's rank in an mlock).
        assert floors[0] < floors[1]
        assert abs(floors[1] / 1e9 - time.time()) < 60
        assert floors[0] < old_token < floors[0] + 10**9
        assert floors[1] < new_token < floors[1] + 10**9
    finally:
        earlier.close()
        later.close()


# --------------------------------------------------------------- lock TTL


async def test_lock_ttl_is_enforced_by_the_owner_node(nodes: Nodes) -> None:
    a, b = nodes.start(), nodes.start()
    owner, waiter = await a.connect(), await b.connect()
    with trio.fail_after(6):
        assert await owner.request(b"lock K 0 ttl=1") == b"200 Acquired"
        start = trio.current_time()
        assert await waiter.request(b"lock K 5") == b"200 Acquired"
        elapsed = trio.current_time() - start
        # The session lease (TTL 2, kept alive) would take 2 s or more: the node did it.
        assert 0.8 <= elapsed < 1.6, elapsed
        assert await owner.request(b"ping") == b"200 PONG"  # its connection stayed open
        assert await owner.request(b"token K") == b"403 Not Locked"
        assert (await owner.stats())["expired"] == 1

        # renew pushes the end out.
        assert await owner.request(b"lock R 0 ttl=0.5") == b"200 Acquired"
        assert await owner.request(b"renew R ttl=1.5") == b"200 Renewed"
        start = trio.current_time()
        ttl = float((await info_of(owner, b"R"))[b"ttl"])
        assert 1.2 < ttl <= 1.5, ttl
        assert await waiter.request(b"lock R 5") == b"200 Acquired"
        elapsed = trio.current_time() - start
        assert 1.3 <= elapsed < 2.2, elapsed
        assert (await owner.stats())["expired"] == 2


# ----------------------------------------------------------- one lease per node


async def test_a_nodes_sessions_hang_on_one_lease_and_a_disconnect_frees_at_once(
    nodes: Nodes, etcd: EtcdCluster
) -> None:
    """40 sessions of one node, each holding a lock: their 40 entries and 40 records
    hang on one etcd lease (one keepalive for all), not the heartbeat's. Closing
    half of them deletes exactly their entries and records, at once. Session TTL
    30: no sweep round (every TTL/3) comes in time to do it instead."""
    node = nodes.start("--session-ttl", "30")
    root = nodes.prefix.encode()
    clients = [await node.connect() for _ in range(40)]
    with trio.fail_after(20):
        for n, client in enumerate(clients):
            assert await client.request(b"g k%d" % n) == b"1 Got Lock"
        entries = await etcd_kvs(etcd, root + b"q/")
        records = await etcd_kvs(etcd, root + b"s/")
        (heartbeat,) = await etcd_kvs(etcd, root + b"n/")
    assert len(entries) == len(records) == 40
    leases = {kv.lease for kv in entries + records}
    assert len(leases) == 1 and 0 not in leases and heartbeat.lease not in leases
    for client in clients[:20]:
        await client.aclose()

    async def half_freed() -> bool:
        return len(await etcd_keys(etcd, root + b"q/")) == 20

    await eventually(half_freed, timeout=3, interval=0.05)
    with trio.fail_after(10):
        assert len(await etcd_keys(etcd, root + b"s/")) == 20
        for n, client in enumerate(clients[20:], start=20):
            assert await client.request(b"i k%d" % n) == b"1 Locked"
        other = await node.connect()
        assert await other.request(b"g k0") == b"1 Got Lock"
        assert await other.request(b"g k20") == b"0 Cannot Get Lock"


async def test_a_session_that_takes_no_lock_writes_nothing_to_etcd(
    nodes: Nodes, etcd: EtcdCluster
) -> None:
    """Connections that ping, read and set a grace, but take nothing: no record, no
    entry; the first lock writes its record."""
    node = nodes.start()
    root = nodes.prefix.encode()
    with trio.fail_after(10):
        holder = await node.connect()
        assert await holder.request(b"g busy") == b"1 Got Lock"
        # The mirror, which q counts from, trails etcd by a few ms.
        await eventually(lambda: stats_showing(holder, locks=1), what="the lock counted")
        idle = [await node.connect() for _ in range(5)]
        for client in idle:
            assert await client.request(b"set_timeout 5000") == b"200 timeout set"
            assert await client.request(b"i busy") == b"1 Locked"
            assert (await client.stats())["locks"] == 1
        assert len(await etcd_keys(etcd, root + b"s/")) == 1
        for client in idle:
            await client.aclose()

    # Ended at once, grace or not: nothing to resume (docs/cluster.md).
    await eventually(
        lambda: stats_showing(holder, sessions=1), timeout=3, interval=0.05, what="idle ended"
    )
    with trio.fail_after(10):
        assert len(await etcd_keys(etcd, root + b"s/")) == 1
        late = await node.connect()
        assert await late.request(b"g mine") == b"1 Got Lock"
        assert len(await etcd_keys(etcd, root + b"s/")) == 2


# ------------------------------------------------------ conn_id failover


async def test_conn_id_takes_over_a_session_of_a_dead_node(nodes: Nodes, etcd: EtcdCluster) -> None:
    # Session TTL 6 s gives a node heartbeat of 3 s: there is a window after the
    # node dies in which its sessions still live but its heartbeat is gone.
    a, b = nodes.start("--session-ttl", "6"), nodes.start("--session-ttl", "6")
    root = nodes.prefix.encode()
    owner, other = await a.connect(), await b.connect()
    with trio.fail_after(5):
        # A session that is still connected, on a live node, cannot be taken.
        live = await b.connect()
        assert await live.request(b"lock L") == b"200 Acquired"
        live_id = (await live.request(b"conn_id")).split()[1]
        assert await owner.request(b"conn_id " + live_id) == b"403 cannot set conn id"
        assert await token_of(live, b"L") > 0

        assert await owner.request(b"set_timeout 10000") == b"200 timeout set"
        # J first: K's entry then has a rank above 0, which its token is made of too.
        assert await owner.request(b"lock J") == b"200 Acquired"
        assert await owner.request(b"lock K") == b"200 Acquired"
        token, j_token = await token_of(owner, b"K"), await token_of(owner, b"J")
        session_id = (await owner.request(b"conn_id")).split()[1]
    a.kill()
    killed = trio.current_time()
    heir = await b.connect()

    async def taken_over() -> bool:  # and until then, nobody else gets K
        if await resumed(heir, session_id):
            return True
        assert await other.request(b"g K") == b"0 Cannot Get Lock"
        return False

    await eventually(taken_over, timeout=6, interval=0.1)
    # Taken over before the session's lease (6 s) could have run out.
    assert trio.current_time() - killed < 5.5
    with trio.fail_after(5):
        assert await heir.request(b"conn_id") == b"200 " + session_id
        # A token is the same for the life of the hold (docs/word-family.md,
        # "Fencing tokens"), moved or not.
        assert await token_of(heir, b"K") == token
        assert await token_of(heir, b"J") == j_token
        assert (await info_of(other, b"K"))[b"token"] == b"%d" % token
        # Its entry moved onto node b's lease, beside the entry of b's own session
        # on L, keeping its create revision (hence its token).
        entries = {kv.key.split(b"/")[-2]: kv for kv in await etcd_kvs(etcd, root + b"q/x/")}
        assert entries[b"K".hex().encode()].lease == entries[b"L".hex().encode()].lease
        assert await other.request(b"g K") == b"0 Cannot Get Lock"
        assert await other.request(b"lock K 0") == b"409 Unavailable"
        assert await heir.request(b"unlock K") == b"200 Unlocked"
        assert await other.request(b"g K") == b"1 Got Lock"
        assert await token_of(other, b"K") > token


# ------------------------------------------- parsing and byte-identical replies


BAD_REQUESTS = [
    b"lock K abc",
    b"lock K -1",
    b"lock K 1 bogus=2",
    b"lock",
    b"unlock",
    b"lock_shared K 1 limit=x",
    b"lock_shared K 1 limit=-2",
    b"mlock",
    b"mlock a b wait=x",
    b"renew K",
    b"renew K ttl=-1",
    b"token",
    b"info",
    b"set_timeout abc",
    b"conn_id a b",
    b"unlock_all extra",
    b"frobnicate K",
    b"",
]

COMMON_REQUESTS = [
    (0, b"iam one"),
    (1, b"iam two"),
    (0, b"g a"),
    (0, b"g a"),
    (1, b"g a"),
    (1, b"i a"),
    (1, b"r a"),
    (0, b"r a"),
    (0, b"r a"),
    (1, b"i a"),
    (0, b"g  spaced   key "),
    (1, b"i spaced key"),
    (0, b"sg s"),
    (1, b"sg s"),
    (1, b"sg s"),
    (0, b"si s"),
    (0, b"sr s"),
    (0, b"sr s"),
    (1, b"si s"),
    (1, b"sr s"),
    (1, b"si s"),
    (0, b"lock k"),
    (0, b"lock k"),
    (1, b"lock k"),
    (1, b"g k"),
    (1, b"unlock k"),
    (1, b"mlock k m"),
    (1, b"mlock m n"),
    (1, b"token s"),
    (0, b"token m"),
    (0, b"unlock k"),
    (0, b"unlock k"),
    (0, b"lock_shared t 0 limit=1"),
    (1, b"lock_shared t 0 limit=1"),
    (1, b"lock_shared t 0 limit=2"),
    (0, b"unlock_shared t"),
    (0, b"unlock_shared t"),
    (1, b"info free"),
    (0, b"renew nothing ttl=1"),
    (0, b"ping"),
    (1, b"unlock_all"),
    (0, b"i m"),
    (0, b"sg z"),
    (1, b"sg z"),
]


async def test_bad_requests_and_common_replies_match_the_in_memory_server(
    nodes: Nodes, etcd: EtcdCluster
) -> None:
    process, port = start_server()
    try:
        node = nodes.start()
        plain = [LineClient(await trio.open_tcp_stream("127.0.0.1", port)) for _ in range(2)]
        cluster = [await node.connect() for _ in range(2)]
        with trio.fail_after(10):
            for line in BAD_REQUESTS:
                expected = await plain[0].request(line)
                assert expected.startswith((b"400 ", b"0 Invalid Command")), (line, expected)
                assert await cluster[0].request(line) == expected, line
            # Nothing reached etcd: no entry, no session record, no lease.
            root = nodes.prefix.encode()
            assert await etcd_keys(etcd, root + b"q/") == []
            assert await etcd_keys(etcd, root + b"s/") == []
            for which, line in COMMON_REQUESTS:
                expected = await plain[which].request(line)
                got = await cluster[which].request(line)
                assert got == expected, (which, line)
            for line in (b"d", b"sd", b"dump", b"dump shared", b"d m", b"who nobody"):
                await plain[0].send(line + b"\n")
                await cluster[0].send(line + b"\n")
                expected_lines = await plain[0].lines_until_end()
                assert await cluster[0].lines_until_end() == expected_lines, line
    finally:
        stop_server(process)


async def test_a_paused_node_cannot_free_a_session_taken_over_elsewhere(nodes: Nodes) -> None:
    """Node A freezes while its session holds K; the client resumes the session on
    B once A's heartbeat is gone. When A thaws, the old connection's end and any
    timer it had must not free what B's connection now holds (every free carries
    the session record's revision), and A lets go of the session."""
    a, b = nodes.start("--session-ttl", "8"), nodes.start("--session-ttl", "8")
    old = await a.connect()
    with trio.fail_after(5):
        assert await old.request(b"lock K") == b"200 Acquired"
        token = await token_of(old, b"K")
        session_id = (await old.request(b"conn_id")).split()[1]
    a.stop()
    await old.aclose()  # the client gives up on the frozen node
    heir, other = await b.connect(), await b.connect()
    # A's heartbeat (4 s) runs out, its session (8 s) not.
    await eventually(lambda: resumed(heir, session_id), timeout=7, interval=0.1)
    a.cont()
    with trio.fail_after(5):
        probe = await a.connect()  # A answers again: it has run its backlog
        assert await probe.request(b"ping") == b"200 PONG"
        # A while for A to go wrong, if it would: it sees the old connection end and
        # runs a keepalive meanwhile, and neither may free what the heir holds.
        await trio.sleep(1.5)
        assert await other.request(b"g K") == b"0 Cannot Get Lock"
        assert await token_of(heir, b"K") == token
        assert await heir.request(b"unlock K") == b"200 Unlocked"
        assert await other.request(b"g K") == b"1 Got Lock"


async def test_sigterm_frees_the_locks_of_connected_clients_at_once(nodes: Nodes) -> None:
    a, b = nodes.start("--session-ttl", "10"), nodes.start("--session-ttl", "10")
    holders = [await a.connect() for _ in range(3)]
    observer = await b.connect()
    with trio.fail_after(5):
        for index, holder in enumerate(holders):
            assert await holder.request(b"lock K%d" % index) == b"200 Acquired"
    a.process.terminate()
    start = trio.current_time()
    left = [b"K0", b"K1", b"K2"]

    async def all_taken() -> bool:
        while left and await observer.request(b"g " + left[0]) == b"1 Got Lock":
            left.pop(0)
        return not left

    await eventually(all_taken, timeout=3, interval=0.02)  # not after the 10 s session TTL
    assert trio.current_time() - start < 2
    assert a.process.wait(timeout=5) == 0


# ---------------------------------------------------------------- monitoring


async def test_q_and_metrics_show_node_counters_and_cluster_counts(nodes: Nodes) -> None:
    metrics_port = free_ports(1)[0]
    a = nodes.start("--metrics-port", str(metrics_port))
    b = nodes.start()
    here, there = await a.connect(), await b.connect()
    with trio.fail_after(5):
        assert await there.request(b"lock K") == b"200 Acquired"
        assert await there.request(b"lock_shared S 0 limit=3") == b"200 1"
        assert await here.request(b"lock_shared S 0 limit=3") == b"200 2"
        assert await here.request(b"lock K 0.2") == b"409 Unavailable"
        # The mirror trails etcd by a few ms.
        stats = await eventually(
            lambda: stats_showing(here, locks=1, shared_locks=1, shared_holders=2),
            what="the locks counted",
        )
    # Cluster-wide: the lock taken through the other node. This node's own: its
    # one timeout, its one connection, no unavailability.
    assert (stats["locks"], stats["shared_locks"], stats["shared_holders"]) == (1, 1, 2)
    assert (stats["timeouts"], stats["connections"], stats["backend_unavailable"]) == (1, 1, 0)
    assert stats["sessions_lost"] == 0
    text = await trio.to_thread.run_sync(scrape, metrics_port)
    samples = parse(text)
    assert value(samples, "elockd_keys", kind="exclusive") == 1
    assert value(samples, "elockd_holders", kind="shared") == 2
    assert value(samples, "elockd_backend_unavailable_total") == 0
    assert value(samples, "elockd_sessions_lost_total") == 0
    assert value(samples, "elockd_local_waiters") == 0
    assert value(samples, "elockd_wait_timeouts_total") == 1
    result = subprocess.run(
        [tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()  # type: ignore[no-any-return]


async def test_many_holds_are_freed_and_taken_over_whole(nodes: Nodes) -> None:
    """More holds than etcd allows operations in one txn (128): unlock_all frees them
    all, and a conn_id takeover on another node keeps them all (the stray sweep
    must not take a session's entries while the takeover adopts them)."""
    a, b = nodes.start("--session-ttl", "6"), nodes.start("--session-ttl", "6")
    owner, other = await a.connect(), await b.connect()
    keys = [b"k%d" % i for i in range(150)]
    with trio.fail_after(30):
        await owner.send(b"".join(b"lock %s\n" % key for key in keys))
        assert [await owner.line() for _ in keys] == [b"200 Acquired\r\n"] * len(keys)
        assert await owner.request(b"unlock_all") == b"200 OK"
        await other.send(b"".join(b"g %s\n" % key for key in keys))
        assert {await other.line() for _ in keys} == {b"1 Got Lock\r\n"}
        assert await other.request(b"set_timeout 20000") == b"200 timeout set"
        session_id = (await other.request(b"conn_id")).split()[1]
        await other.aclose()
        heir, probe = await a.connect(), await a.connect()
        # Once B has written "disconnected".
        await eventually(lambda: resumed(heir, session_id), interval=0.05)
        # A while for A to go wrong, if it would: a keepalive round and its stray
        # sweep, which must not take the entries the takeover adopted.
        await trio.sleep(2.5)
        await probe.send(b"".join(b"g %s\n" % key for key in keys))
        assert {await probe.line() for _ in keys} == {b"0 Cannot Get Lock\r\n"}
        await heir.send(b"".join(b"token %s\n" % key for key in keys))
        replies = [await heir.line() for _ in keys]
        assert all(reply.startswith(b"200 ") for reply in replies), replies


async def test_repeats_renew_of_shared_and_quit_follow_protocol(nodes: Nodes) -> None:
    """Rules of docs/word-family.md that the cluster verbs reimplement: a holder
    asking again gets no second hold (a ttl then sets its lease), `renew` works on a
    shared hold, and `quit` ends the session by the grace rule (0: freed at once,
    everywhere)."""
    a, b = nodes.start(), nodes.start()
    holder, other = await a.connect(), await b.connect()
    with trio.fail_after(5):
        assert await holder.request(b"lock K") == b"200 Acquired"
        token = await token_of(holder, b"K")
        assert await holder.request(b"lock K 0 ttl=30") == b"200 Acquired"
        assert await token_of(holder, b"K") == token
        assert float((await info_of(holder, b"K"))[b"ttl"]) > 29
        assert await holder.request(b"lock_shared S") == b"200 1"
        assert await holder.request(b"lock_shared S 0 limit=1") == b"200 1"  # no second hold
        assert await other.request(b"si S") == b"1 Locked"
        assert await holder.request(b"renew S ttl=30") == b"200 Renewed"
        assert await holder.request(b"renew Z ttl=30") == b"403 Not Locked"
        assert (await holder.stats())["leases"] == 2
        assert await holder.request(b"lock P") == b"200 Acquired"  # a plain hold
        assert await holder.request(b"quit") == b"200 Bye"
        assert await holder.at_eof()
        # The ttl= leases outlive the connection, as on one server; nothing else does.
        assert await other.request(b"g K") == b"0 Cannot Get Lock"
        assert await other.request(b"lock_shared S 0 limit=1") == b"409 1"

        async def freed() -> bool:  # as an orphan
            return await other.request(b"g P") == b"1 Got Lock"

        await eventually(freed, interval=0.02)


async def test_a_session_living_on_its_lease_is_taken_over_on_another_live_node(
    nodes: Nodes,
) -> None:
    """docs/word-family.md, "Sessions and takeover": a session whose connection
    ended lives on while it still owns a lease, and meanwhile ``conn_id ID`` can
    take it over. In a cluster, also from another node while its own runs: the
    hold, its token and its lease timer move there, and the old node's keeper rounds
    (every TTL/3) free nothing of it."""
    a, b = nodes.start(), nodes.start()
    holder, probe, heir = await a.connect(), await a.connect(), await b.connect()
    with trio.fail_after(5):
        assert await holder.request(b"lock K ttl=30") == b"200 Acquired"
        token = await token_of(holder, b"K")
        session_id = (await holder.request(b"conn_id")).split()[1]
        assert await holder.request(b"quit") == b"200 Bye"
    await eventually(lambda: resumed(heir, session_id), timeout=5, interval=0.05)
    with trio.fail_after(5):
        assert await token_of(heir, b"K") == token
        assert float((await info_of(heir, b"K"))[b"ttl"]) > 25
    # Two of node a's keeper rounds and sweeps (TTL 2): the wait is the assertion.
    await trio.sleep(2 * TEST_SESSION_TTL / 3 + 0.5)
    with trio.fail_after(5):
        assert await probe.request(b"g K") == b"0 Cannot Get Lock"
        assert await heir.request(b"renew K ttl=60") == b"200 Renewed"
        assert await heir.request(b"unlock K") == b"200 Unlocked"
        assert await probe.request(b"g K") == b"1 Got Lock"
        assert await token_of(probe, b"K") > token
