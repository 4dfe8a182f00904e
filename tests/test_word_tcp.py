"""The word family end to end over real TCP, with several clients.

Tests that take ``mock_clock`` run the server in the test's own trio run under
``trio.testing.MockClock(autojump_threshold=0)``: the clock jumps only when every
task is blocked, so a 30-second wait costs nothing and a timeout can only fire when
nothing else could happen first (a stall shows up as a 409, never as a slow test).
"""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Callable

import pytest
import trio
import trio.testing

from elockd.config import Config
from tests.conftest import LineClient, RunningServer

SpawnServer = Callable[..., tuple[subprocess.Popen[str], int]]


async def info(client: LineClient, key: bytes) -> dict[str, str]:
    reply = (await client.request(b"info " + key)).decode()
    assert reply.startswith("200 ")
    return dict(field.split("=", 1) for field in reply[4:].split(" "))


async def queued(watcher: LineClient, key: bytes, count: int) -> None:
    """Until ``count`` requests wait for ``key`` (the server answers in order, so this
    is how a test knows a waiter has queued before it sends the next one)."""
    while int((await info(watcher, key))["waiting"]) != count:
        await trio.sleep(0.001)


async def test_three_waiters_are_served_first_come_first_served(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    holder, watcher = await server.connect(), await server.connect()
    waiters = [await server.connect() for _ in range(3)]
    assert await holder.request(b"lock job") == b"200 Acquired"
    for count, waiter in enumerate(waiters, start=1):
        await waiter.send(b"lock job 30\n")
        await queued(watcher, b"job", count)
    order: list[int] = []

    async def wait_and_release(index: int) -> None:
        assert await waiters[index].line() == b"200 Acquired\r\n"
        order.append(index)
        await trio.sleep(1)  # hold it a while: the next must not be granted meanwhile
        assert int((await info(watcher, b"job"))["waiting"]) == 2 - index
        assert await waiters[index].request(b"unlock job") == b"200 Unlocked"

    async with trio.open_nursery() as nursery:
        for index in range(3):
            nursery.start_soon(wait_and_release, index)
        await trio.sleep(5)
        assert order == []  # nobody is granted while the holder holds
        assert await holder.request(b"unlock job") == b"200 Unlocked"
    assert order == [0, 1, 2]


async def test_a_waiter_that_disconnects_leaves_the_queue(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    holder, quitter, patient = [await server.connect() for _ in range(3)]
    assert await holder.request(b"lock k") == b"200 Acquired"
    await quitter.send(b"lock k 30\n")
    await queued(holder, b"k", 1)
    await patient.send(b"lock k 30\n")
    await queued(holder, b"k", 2)
    await quitter.aclose()
    await queued(holder, b"k", 1)
    assert await holder.request(b"unlock k") == b"200 Unlocked"
    assert await patient.line() == b"200 Acquired\r\n"
    assert (await info(holder, b"k"))["exclusive"] != "-"
    assert await holder.request(b"lock k") == b"409 Unavailable"


async def test_a_wait_times_out_with_409_and_counts(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    holder, waiter = await server.connect(), await server.connect()
    assert await holder.request(b"lock k") == b"200 Acquired"
    start = trio.current_time()
    assert await waiter.request(b"lock k 2.5") == b"409 Unavailable"
    assert trio.current_time() - start == pytest.approx(2.5)
    assert (await waiter.stats())["timeouts"] == 1
    assert await holder.request(b"unlock k") == b"200 Unlocked"
    assert (await info(holder, b"k"))["exclusive"] == "-"  # the timed-out waiter got nothing


async def test_a_lease_expires_while_its_owner_is_gone_and_wakes_the_next(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    owner, waiter = await server.connect(), await server.connect()
    start = trio.current_time()
    assert await owner.request(b"lock k ttl=5") == b"200 Acquired"
    await owner.aclose()
    assert await waiter.request(b"lock k 60") == b"200 Acquired"
    assert trio.current_time() - start == pytest.approx(5)
    stats = await waiter.stats()
    assert (stats["expired"], stats["orphans"], stats["leases"]) == (1, 0, 0)


async def test_renew_keeps_a_lease_alive(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    owner, other = await server.connect(), await server.connect()
    assert await owner.request(b"lock k ttl=2") == b"200 Acquired"
    for _ in range(5):
        await trio.sleep(1.5)
        assert await owner.request(b"renew k ttl=2") == b"200 Renewed"
    assert await other.request(b"lock k") == b"409 Unavailable"
    assert (await info(other, b"k"))["ttl"] == "2.000"
    await trio.sleep(2)
    assert await owner.request(b"renew k ttl=2") == b"403 Not Locked"
    assert await other.request(b"lock k") == b"200 Acquired"


async def test_takeover_brings_holds_leases_and_name_along(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    first = await server.connect()
    assert await first.request(b"set_timeout 10000") == b"200 timeout set"
    assert await first.request(b"iam builder") == b"1 ok"
    assert await first.request(b"lock plain") == b"200 Acquired"
    assert await first.request(b"lock leased ttl=30") == b"200 Acquired"
    assert await first.request(b"lock_shared s limit=3") == b"200 1"
    session_id = (await first.request(b"conn_id"))[4:]
    token = await first.request(b"token plain")
    await first.aclose()
    await trio.sleep(5)  # the blip: within the 10 s grace
    second = await server.connect()
    assert await second.request(b"conn_id " + session_id) == b"200 conn id set"
    assert await second.request(b"token plain") == token
    assert (await info(second, b"leased"))["exclusive"] == "builder"
    assert await second.request(b"unlock_shared s") == b"200 0"
    await trio.sleep(20)  # the grace it had has no hold on it any more
    assert await second.request(b"unlock plain") == b"200 Unlocked"
    stats = await second.stats()
    assert (stats["orphans"], stats["shared_orphans"]) == (0, 0)
    third = await server.connect()
    assert await third.request(b"conn_id " + session_id) == b"403 cannot set conn id"


async def test_grace_ends_frees_holds_as_orphans_and_refuses_the_id(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    first, watcher = await server.connect(), await server.connect()
    assert await first.request(b"set_timeout 2000") == b"200 timeout set"
    assert await first.request(b"lock k") == b"200 Acquired"
    session_id = (await first.request(b"conn_id"))[4:]
    await first.aclose()
    assert await watcher.request(b"lock k 10") == b"200 Acquired"
    assert (await watcher.stats())["orphans"] == 1
    late = await server.connect()
    assert await late.request(b"conn_id " + session_id) == b"403 cannot set conn id"


async def test_semaphore_limit_is_never_exceeded_with_sg_in_the_mix(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    a, b, c, d = [await server.connect() for _ in range(4)]
    assert await a.request(b"lock_shared api limit=2") == b"200 1"
    assert await b.request(b"sg api") == b"2 Got Lock"
    await c.send(b"lock_shared api 30 limit=2\n")
    await queued(a, b"api", 1)
    await d.send(b"lock_shared api 30 limit=3\n")
    await queued(a, b"api", 2)
    # One release hands over to c (2 of its 2), then to d (3 of its 3), in order.
    assert await a.request(b"unlock_shared api") == b"200 3"
    assert await c.line() == b"200 2\r\n"
    assert await d.line() == b"200 3\r\n"
    assert await b.request(b"sr api") == b"1 Released Lock"
    assert await a.request(b"lock_shared api limit=2") == b"409 2"
    assert await a.request(b"si api") == b"2 Locked"


async def test_mlock_in_opposite_orders_thousands_of_rounds_never_stalls(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    """Two clients take the same keys in opposite orders, a few thousand times. Any
    stall would let the mock clock jump to the wait's end and give a 409."""
    rounds = 2000
    one, two = await server.connect(), await server.connect()

    async def loop(client: LineClient, keys: bytes) -> None:
        for _ in range(rounds):
            await client.send(b"mlock " + keys + b" wait=30\nunlock_all\n")
            assert await client.line() == b"200 Acquired\r\n"
            assert await client.line() == b"200 OK\r\n"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop, one, b"a b c")
        nursery.start_soon(loop, two, b"c b a")
    stats = await one.stats()
    assert stats["command_mlock"] == 2 * rounds
    assert stats["timeouts"] == 0
    assert stats["locks"] == 0


async def test_mlock_waiter_is_not_starved_by_single_key_requests(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    hog, multi, stream = [await server.connect() for _ in range(3)]
    assert await hog.request(b"lock hot") == b"200 Acquired"
    await multi.send(b"mlock hot cold wait=30\n")
    await queued(hog, b"hot", 1)
    await stream.send(b"lock hot 30\n")
    await queued(hog, b"hot", 2)
    assert await hog.request(b"unlock hot") == b"200 Unlocked"
    assert await multi.line() == b"200 Acquired\r\n"
    assert await multi.request(b"unlock_all") == b"200 OK"
    assert await stream.line() == b"200 Acquired\r\n"


async def test_mlock_that_gives_up_frees_what_it_took(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    holder, multi = await server.connect(), await server.connect()
    assert await holder.request(b"lock y") == b"200 Acquired"
    assert await multi.request(b"mlock x y wait=3") == b"409 Unavailable y"
    assert (await info(holder, b"x"))["exclusive"] == "-"


@pytest.mark.parametrize("server_config", [Config(max_waiters=1)])
async def test_waiters_per_key_limit(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    holder, first, second = [await server.connect() for _ in range(3)]
    assert await holder.request(b"lock k") == b"200 Acquired"
    await first.send(b"lock k 30\n")
    await queued(holder, b"k", 1)
    assert await second.request(b"lock k 30") == b"413 Too Many Waiters"
    assert await second.request(b"mlock j k wait=30") == b"413 Too Many Waiters"
    assert (await info(holder, b"j"))["exclusive"] == "-"


async def test_stats_and_quit(server: RunningServer) -> None:
    client = await server.connect()
    await client.send(b"stats\n")
    lines = await client.lines_until_end()
    assert lines[0] == b"200 STATS\r\n"
    assert lines[1].startswith(b"STAT clients ")
    names = {line.split()[1] for line in lines[1:-1]}
    assert {b"waiting", b"sessions", b"leases", b"expired", b"timeouts"} <= names
    assert await client.request(b"quit") == b"200 Bye"
    assert await client.at_eof()


async def test_requests_after_a_waiting_lock_wait_for_it(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    holder, waiter = await server.connect(), await server.connect()
    assert await holder.request(b"lock k") == b"200 Acquired"
    await waiter.send(b"ping\nlock k 10\nping\n")
    assert await waiter.line() == b"200 PONG\r\n"
    await queued(holder, b"k", 1)
    assert await holder.request(b"unlock k") == b"200 Unlocked"
    assert await waiter.line() == b"200 Acquired\r\n"
    assert await waiter.line() == b"200 PONG\r\n"


def test_fencing_tokens_keep_increasing_across_a_restart(spawn_server: SpawnServer) -> None:
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
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    """``quit`` ends the connection like any other end: holds follow the grace rule."""
    watcher = await server.connect()
    plain = await server.connect()
    assert await plain.request(b"lock p") == b"200 Acquired"
    assert await plain.request(b"quit") == b"200 Bye"
    assert await plain.at_eof()
    assert await watcher.request(b"lock p 5") == b"200 Acquired"  # freed at once
    assert (await watcher.stats())["orphans"] == 1
    graceful = await server.connect()
    assert await graceful.request(b"set_timeout 10000") == b"200 timeout set"
    assert await graceful.request(b"lock g") == b"200 Acquired"
    session_id = (await graceful.request(b"conn_id"))[4:]
    assert await graceful.request(b"quit") == b"200 Bye"
    assert await graceful.at_eof()
    assert (await info(watcher, b"g"))["exclusive"] != "-"  # kept for a takeover
    resumed = await server.connect()
    assert await resumed.request(b"conn_id " + session_id) == b"200 conn id set"
    assert await resumed.request(b"unlock g") == b"200 Unlocked"
