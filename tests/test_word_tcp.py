"""The word family end to end over real TCP, with several clients, on both backends.

Tests that take ``lock_server`` and ``clock`` run on the in-memory server under
``trio.testing.MockClock(autojump_threshold=0)``: the clock jumps only when every
task is blocked, so waits cost nothing, times are exact, and a timeout can only
fire when nothing else could happen first (a stall shows up as a 409, never as a
slow test). They also run on a cluster node over a real etcd, in real time: so
durations are short (what a test needs is "longer than what happens in between"),
and a time is read exactly in memory and within :data:`SLACK` on the cluster.
The test of restarting a real server process is about the in-memory server alone.
"""

from __future__ import annotations

import signal
import socket

import pytest
import trio

from elockd.protocol.config import Config
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import eventually, stats_showing, until_waiting
from tests.support.server_process import SpawnServer

#: How late a cluster node may be, in real time, past a wait, lease or grace end.
SLACK = 0.75
#: A hold long enough for a wrong grant to show up meanwhile.
HOLD = 0.3


def took(backend: str, elapsed: float, seconds: float) -> None:
    """``elapsed`` is ``seconds``: exactly on the MockClock, within SLACK on a cluster."""
    if backend == "memory":
        assert elapsed == pytest.approx(seconds)
    else:
        assert seconds <= elapsed < seconds + SLACK, (elapsed, seconds)


async def info(client: LineClient, key: bytes) -> dict[str, str]:
    reply = (await client.request(b"info " + key)).decode()
    assert reply.startswith("200 ")
    return dict(field.split("=", 1) for field in reply[4:].split(" "))


async def test_three_waiters_are_served_first_come_first_served(
    lock_server: RunningServer, clock: object
) -> None:
    holder, watcher = await lock_server.connect(), await lock_server.connect()
    waiters = [await lock_server.connect() for _ in range(3)]
    assert await holder.request(b"lock job") == b"200 Acquired"
    for count, waiter in enumerate(waiters, start=1):
        await waiter.send(b"lock job 30\n")
        await until_waiting(watcher, b"job", count)
    order: list[int] = []
    holding: list[int] = []  # from after a grant arrived to before its unlock is sent

    async def wait_and_release(index: int) -> None:
        assert await waiters[index].line() == b"200 Acquired\r\n"
        assert holding == [], f"{index} granted while {holding} held the lock"
        holding.append(index)
        order.append(index)
        await trio.sleep(HOLD)  # hold it a while: the next must not be granted meanwhile
        assert int((await info(watcher, b"job"))["waiting"]) == 2 - index
        holding.remove(index)
        assert await waiters[index].request(b"unlock job") == b"200 Unlocked"

    async with trio.open_nursery() as nursery:
        for index in range(3):
            nursery.start_soon(wait_and_release, index)
        await trio.sleep(HOLD)  # a while for a wrong grant to show
        assert order == []  # nobody is granted while the holder holds
        assert await holder.request(b"unlock job") == b"200 Unlocked"
    assert order == [0, 1, 2]


async def test_a_waiter_that_disconnects_leaves_the_queue(
    lock_server: RunningServer, clock: object
) -> None:
    holder, quitter, patient = [await lock_server.connect() for _ in range(3)]
    assert await holder.request(b"lock k") == b"200 Acquired"
    await quitter.send(b"lock k 30\n")
    await until_waiting(holder, b"k", 1)
    await patient.send(b"lock k 30\n")
    await until_waiting(holder, b"k", 2)
    await quitter.aclose()
    await until_waiting(holder, b"k", 1)
    assert await holder.request(b"unlock k") == b"200 Unlocked"
    assert await patient.line() == b"200 Acquired\r\n"
    assert (await info(holder, b"k"))["exclusive"] != "-"
    assert await holder.request(b"lock k") == b"409 Unavailable"


async def test_a_wait_times_out_with_409_and_counts(
    lock_server: RunningServer, clock: object, backend: str
) -> None:
    holder, waiter = await lock_server.connect(), await lock_server.connect()
    assert await holder.request(b"lock k") == b"200 Acquired"
    start = trio.current_time()
    assert await waiter.request(b"lock k 1.5") == b"409 Unavailable"
    took(backend, trio.current_time() - start, 1.5)
    assert (await waiter.stats())["timeouts"] == 1
    assert await holder.request(b"unlock k") == b"200 Unlocked"
    assert (await info(holder, b"k"))["exclusive"] == "-"  # the timed-out waiter got nothing


async def test_a_lease_expires_while_its_owner_is_gone_and_wakes_the_next(
    lock_server: RunningServer, clock: object, backend: str
) -> None:
    owner, waiter = await lock_server.connect(), await lock_server.connect()
    start = trio.current_time()
    assert await owner.request(b"lock k ttl=1") == b"200 Acquired"
    await owner.aclose()
    assert await waiter.request(b"lock k 30") == b"200 Acquired"
    took(backend, trio.current_time() - start, 1)
    stats = await waiter.stats()
    assert (stats["expired"], stats["orphans"], stats["leases"]) == (1, 0, 0)


async def test_renew_keeps_a_lease_alive(
    lock_server: RunningServer, clock: object, backend: str
) -> None:
    owner, other = await lock_server.connect(), await lock_server.connect()
    assert await owner.request(b"lock k ttl=1") == b"200 Acquired"
    for _ in range(3):  # 1.8 s in all, past the first ttl
        await trio.sleep(0.6)
        assert await owner.request(b"renew k ttl=1") == b"200 Renewed"
    assert await other.request(b"lock k") == b"409 Unavailable"
    ttl = (await info(other, b"k"))["ttl"]
    if backend == "memory":
        assert ttl == "1.000"
    else:
        assert 1 - SLACK < float(ttl) <= 1, ttl
    await trio.sleep(1 + SLACK)  # past the last ttl
    assert await owner.request(b"renew k ttl=1") == b"403 Not Locked"
    assert await other.request(b"lock k") == b"200 Acquired"


async def test_takeover_brings_holds_leases_and_name_along(
    lock_server: RunningServer, clock: object
) -> None:
    first = await lock_server.connect()
    assert await first.request(b"set_timeout 1500") == b"200 timeout set"
    assert await first.request(b"iam builder") == b"1 ok"
    assert await first.request(b"lock plain") == b"200 Acquired"
    assert await first.request(b"lock leased ttl=30") == b"200 Acquired"
    assert await first.request(b"lock_shared s limit=3") == b"200 1"
    session_id = (await first.request(b"conn_id"))[4:]
    token = await first.request(b"token plain")
    await first.aclose()
    await trio.sleep(0.5)  # the blip: within the 1.5 s grace
    second = await lock_server.connect()
    assert await second.request(b"conn_id " + session_id) == b"200 conn id set"
    assert await second.request(b"token plain") == token
    assert (await info(second, b"leased"))["exclusive"] == "builder"
    assert await second.request(b"unlock_shared s") == b"200 0"
    await trio.sleep(1.5)  # past the grace it had, which has no hold on it any more
    assert await second.request(b"unlock plain") == b"200 Unlocked"
    stats = await second.stats()
    assert (stats["orphans"], stats["shared_orphans"]) == (0, 0)
    third = await lock_server.connect()
    assert await third.request(b"conn_id " + session_id) == b"403 cannot set conn id"


async def test_grace_ends_frees_holds_as_orphans_and_refuses_the_id(
    lock_server: RunningServer, clock: object, backend: str
) -> None:
    first, watcher = await lock_server.connect(), await lock_server.connect()
    assert await first.request(b"set_timeout 500") == b"200 timeout set"
    assert await first.request(b"lock k") == b"200 Acquired"
    session_id = (await first.request(b"conn_id"))[4:]
    start = trio.current_time()  # the grace starts once the server sees the close
    await first.aclose()
    assert await watcher.request(b"lock k 10") == b"200 Acquired"
    took(backend, trio.current_time() - start, 0.5)
    assert (await watcher.stats())["orphans"] == 1
    late = await lock_server.connect()
    assert await late.request(b"conn_id " + session_id) == b"403 cannot set conn id"


async def test_semaphore_limit_is_never_exceeded_with_sg_in_the_mix(
    lock_server: RunningServer, clock: object
) -> None:
    a, b, c, d = [await lock_server.connect() for _ in range(4)]
    assert await a.request(b"lock_shared api limit=2") == b"200 1"
    assert await b.request(b"sg api") == b"2 Got Lock"
    await c.send(b"lock_shared api 30 limit=2\n")
    await until_waiting(a, b"api", 1)
    await d.send(b"lock_shared api 30 limit=3\n")
    await until_waiting(a, b"api", 2)
    # One release hands over to c (2 of its 2), then to d (3 of its 3), in order.
    assert await a.request(b"unlock_shared api") == b"200 3"
    assert await c.line() == b"200 2\r\n"
    assert await d.line() == b"200 3\r\n"
    assert await b.request(b"sr api") == b"1 Released Lock"
    assert await a.request(b"lock_shared api limit=2") == b"409 2"
    assert await a.request(b"si api") == b"2 Locked"


async def test_mlock_in_opposite_orders_thousands_of_rounds_never_stalls(
    lock_server: RunningServer, clock: object, backend: str
) -> None:
    """Two clients take the same keys in opposite orders, a few thousand times in
    memory, where any stall would let the mock clock jump to the wait's end and give
    a 409. On a cluster node, where each round is several etcd round trips,
    two hundred rounds, and a stall would show as a 409 after 5 s."""
    rounds = 2000 if backend == "memory" else 200
    one, two = await lock_server.connect(), await lock_server.connect()

    async def loop(client: LineClient, keys: bytes) -> None:
        for _ in range(rounds):
            await client.send(b"mlock " + keys + b" wait=5\nunlock_all\n")
            assert await client.line() == b"200 Acquired\r\n"
            assert await client.line() == b"200 OK\r\n"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop, one, b"a b c")
        nursery.start_soon(loop, two, b"c b a")
    stats = await eventually(lambda: stats_showing(one, locks=0), what="every key free")
    assert stats["command_mlock"] == 2 * rounds
    assert stats["timeouts"] == 0


async def test_mlock_waiter_is_not_starved_by_single_key_requests(
    lock_server: RunningServer, clock: object
) -> None:
    hog, multi, stream = [await lock_server.connect() for _ in range(3)]
    assert await hog.request(b"lock hot") == b"200 Acquired"
    await multi.send(b"mlock hot cold wait=30\n")
    await until_waiting(hog, b"hot", 1)
    await stream.send(b"lock hot 30\n")
    await until_waiting(hog, b"hot", 2)
    assert await hog.request(b"unlock hot") == b"200 Unlocked"
    assert await multi.line() == b"200 Acquired\r\n"
    assert await multi.request(b"unlock_all") == b"200 OK"
    assert await stream.line() == b"200 Acquired\r\n"


async def test_mlock_that_gives_up_frees_what_it_took(
    lock_server: RunningServer, clock: object
) -> None:
    holder, multi = await lock_server.connect(), await lock_server.connect()
    assert await holder.request(b"lock y") == b"200 Acquired"
    assert await multi.request(b"mlock x y wait=0.5") == b"409 Unavailable y"
    assert (await info(holder, b"x"))["exclusive"] == "-"


@pytest.mark.parametrize("server_config", [Config(max_waiters=1)])
async def test_waiters_per_key_limit(lock_server: RunningServer, clock: object) -> None:
    holder, first, second = [await lock_server.connect() for _ in range(3)]
    assert await holder.request(b"lock k") == b"200 Acquired"
    await first.send(b"lock k 30\n")
    await until_waiting(holder, b"k", 1)
    assert await second.request(b"lock k 30") == b"413 Too Many Waiters"
    assert await second.request(b"mlock j k wait=30") == b"413 Too Many Waiters"
    assert (await info(holder, b"j"))["exclusive"] == "-"


async def test_stats_and_quit(lock_server: RunningServer, clock: object) -> None:
    client = await lock_server.connect()
    await client.send(b"stats\n")
    lines = await client.lines_until_end()
    assert lines[0] == b"200 STATS\r\n"
    assert lines[1].startswith(b"STAT clients ")
    names = {line.split()[1] for line in lines[1:-1]}
    assert {b"waiting", b"sessions", b"leases", b"expired", b"timeouts"} <= names
    assert await client.request(b"quit") == b"200 Bye"
    assert await client.at_eof()


async def test_requests_after_a_waiting_lock_wait_for_it(
    lock_server: RunningServer, clock: object
) -> None:
    holder, waiter = await lock_server.connect(), await lock_server.connect()
    assert await holder.request(b"lock k") == b"200 Acquired"
    await waiter.send(b"ping\nlock k 10\nping\n")
    assert await waiter.line() == b"200 PONG\r\n"
    await until_waiting(holder, b"k", 1)
    assert await holder.request(b"unlock k") == b"200 Unlocked"
    assert await waiter.line() == b"200 Acquired\r\n"
    assert await waiter.line() == b"200 PONG\r\n"


def test_fencing_tokens_keep_increasing_across_a_restart(spawn_server: SpawnServer) -> None:
    """The in-memory server's own promise (its token floor is the wall clock at
    start); a cluster's tokens live in etcd and outlast any node."""

    def token_of_a_new_grant(port: int) -> int:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"lock fence\ntoken fence\n")
            data = b""
            while data.count(b"\r\n") < 2:
                data += sock.recv(4096)
        lines = data.split(b"\r\n")
        assert lines[0] == b"200 Acquired"
        return int(lines[1].split()[1])

    first_process, port = spawn_server()
    first = [token_of_a_new_grant(port) for _ in range(3)]
    first_process.send_signal(signal.SIGTERM)
    assert first_process.wait(timeout=10) == 0
    _, port = spawn_server()
    second = token_of_a_new_grant(port)
    assert first == sorted(set(first))
    assert second > first[-1]


async def test_quit_frees_holds_as_orphans_or_keeps_them_for_the_grace_time(
    lock_server: RunningServer, clock: object
) -> None:
    """``quit`` ends the connection like any other end: holds follow the grace rule."""
    watcher = await lock_server.connect()
    plain = await lock_server.connect()
    assert await plain.request(b"lock p") == b"200 Acquired"
    assert await plain.request(b"quit") == b"200 Bye"
    assert await plain.at_eof()
    assert await watcher.request(b"lock p 5") == b"200 Acquired"  # freed at once
    assert (await watcher.stats())["orphans"] == 1
    graceful = await lock_server.connect()
    assert await graceful.request(b"set_timeout 10000") == b"200 timeout set"
    assert await graceful.request(b"lock g") == b"200 Acquired"
    session_id = (await graceful.request(b"conn_id"))[4:]
    assert await graceful.request(b"quit") == b"200 Bye"
    assert await graceful.at_eof()
    assert (await info(watcher, b"g"))["exclusive"] != "-"  # kept for a takeover
    resumed = await lock_server.connect()
    assert await resumed.request(b"conn_id " + session_id) == b"200 conn id set"
    assert await resumed.request(b"unlock g") == b"200 Unlocked"
