"""``watch [PREFIX]`` (docs/protocol.md, "watch"): the registry, the wire lines,
and a stream over TCP that carries exactly what the engine did, in order."""

from __future__ import annotations

import random
import socket
import ssl
import time

import pytest
import trio
import trustme
from trio_websocket import open_websocket_url

from elockd.daemon.server import make_service, serve
from elockd.engine.locks import LockEngine
from elockd.engine.watchers import KILLED, TooManyWatchers, Watchers
from elockd.protocol.config import Config
from tests.support.hostile_tools import rss_bytes
from tests.support.line_client import LineClient, RunningServer
from tests.support.server_process import start_server, stop_server
from tests.test_access import tls_client
from tests.test_websocket import start as ws_start

# ------------------------------------------------------------------ the registry


def test_registry_matches_by_prefix_and_formats_each_event_once() -> None:
    watchers = Watchers()
    assert not watchers.active
    jobs = watchers.add(b"jobs/", 1 << 20, 10)
    everything = watchers.add(b"", 1 << 20, 10)
    other = watchers.add(b"other/", 1 << 20, 10)
    assert watchers.active
    watchers.grant(b"jobs/a", b"alice", False, 7)
    watchers.grant(b"jobs/a", b"bob", True, 2)
    watchers.free(b"jobs/a", b"bob", True, 1, b"expired")
    watchers.free(b"jobs/a", b"alice", False, 0, KILLED)
    watchers.grant(b"x", b"carol", False, 8)
    expected = [
        b"+ jobs/a exclusive alice token=7\r\n",
        b"+ jobs/a shared bob holders=2\r\n",
        b"- jobs/a shared bob holders=1 expired\r\n",
        b"- jobs/a exclusive alice killed\r\n",
    ]
    assert jobs.lines == expected
    assert everything.lines == [*expected, b"+ x exclusive carol token=8\r\n"]
    assert other.lines == []
    for watcher in (jobs, everything, other):
        watchers.remove(watcher)
    assert not watchers.active and watchers.count == 0


def test_prefixes_of_several_lengths_match_exactly() -> None:
    watchers = Watchers()
    short, long = watchers.add(b"a", 1 << 20, 10), watchers.add(b"bcd", 1 << 20, 10)
    for key in (b"a", b"ab", b"b", b"bc", b"bcx", b"bcd", b"bcde", b"xa", b""):
        watchers.grant(key, b"o", False, 1)
    assert [line.split()[1] for line in short.lines] == [b"a", b"ab"]
    assert [line.split()[1] for line in long.lines] == [b"bcd", b"bcde"]


def test_registry_is_bounded_by_max_watchers() -> None:
    watchers = Watchers()
    for _ in range(3):
        watchers.add(b"p", 100, 3)
    with pytest.raises(TooManyWatchers):
        watchers.add(b"q", 100, 3)


def test_a_watcher_past_its_buffer_overflows_and_leaves() -> None:
    watchers = Watchers()
    woken: list[int] = []
    watcher = watchers.add(b"k", 100, 10)
    watcher.wake = lambda: woken.append(1)
    for n in range(10):
        watchers.grant(b"k%d" % n, b"owner", False, n)
    assert watcher.overflowed and watcher.lines == []
    assert watchers.count == 0 and not watchers.active
    assert woken  # its connection is told


def test_the_engine_reports_every_reason() -> None:
    engine = LockEngine()
    watcher = engine.watchers.add(b"", 1 << 20, 10)
    a = engine.open_session("a", b"10.0.0.1:1")
    b = engine.open_session("b", b"10.0.0.2:2")
    assert engine.acquire(a, b"k", 0.0, ttl=1.0)
    waiter = engine.wait_for(b, b"k", 0.0)
    assert waiter is not None
    engine.advance(2.0)  # a's lease ends: b is granted
    engine.acquire_shared(a, b"s", 2.0)
    engine.disconnect(b, 3.0)  # orphaned
    engine.release_shared(a, b"s", 3.0)
    assert watcher.lines == [
        b"+ k exclusive 10.0.0.1:1 token=1\r\n",
        b"- k exclusive 10.0.0.1:1 expired\r\n",
        b"+ k exclusive 10.0.0.2:2 token=2\r\n",
        b"+ s shared 10.0.0.1:1 holders=1\r\n",
        b"- k exclusive 10.0.0.2:2 orphaned\r\n",
        b"- s shared 10.0.0.1:1 holders=0 released\r\n",
    ]
    engine.acquire(a, b"x", 4.0)
    engine.acquire_shared(a, b"y", 4.0)
    engine.evict(b"x", 5.0)  # an operator's kill
    engine.evict(b"y", 5.0)
    assert watcher.lines[-2:] == [
        b"- x exclusive 10.0.0.1:1 killed\r\n",
        b"- y shared 10.0.0.1:1 holders=0 killed\r\n",
    ]


# ------------------------------------------------------------------ over TCP


async def read_snapshot(client: LineClient) -> list[bytes]:
    assert await client.line() == b"200 Watching\r\n"
    lines = []
    while (line := await client.line()) != b"SYNCED\r\n":
        lines.append(line)
    return lines


async def test_snapshot_then_synced_then_events(server: RunningServer) -> None:
    holder = await server.connect()
    await holder.reply(b"iam alice")
    assert await holder.reply(b"lock jobs/a") == b"200 Acquired\r\n"
    assert await holder.reply(b"lock_shared jobs/b") == b"200 1\r\n"
    assert await holder.reply(b"lock other/c") == b"200 Acquired\r\n"
    token = int((await holder.reply(b"token jobs/a")).split()[1])
    watcher = await server.connect()
    await watcher.send(b"watch jobs/\n")
    assert await read_snapshot(watcher) == [
        b"+ jobs/a exclusive alice token=%d\r\n" % token,
        b"+ jobs/b shared alice holders=1\r\n",
    ]
    assert await holder.reply(b"unlock jobs/a") == b"200 Unlocked\r\n"
    assert await holder.reply(b"unlock other/c") == b"200 Unlocked\r\n"
    assert await holder.reply(b"lock jobs/d") == b"200 Acquired\r\n"
    assert await watcher.line() == b"- jobs/a exclusive alice released\r\n"
    assert await watcher.line() == b"+ jobs/d exclusive alice token=%d\r\n" % (token + 2)
    # Any line ends the stream and the connection.
    assert await watcher.reply(b"ping") == b"200 Bye\r\n"
    assert await watcher.at_eof()


async def test_a_line_after_watch_in_the_same_chunk_ends_it(server: RunningServer) -> None:
    watcher = await server.connect()
    await watcher.send(b"watch\nping\n")
    assert await read_snapshot(watcher) == []
    assert await watcher.line() == b"200 Bye\r\n"
    assert await watcher.at_eof()


@pytest.mark.parametrize("server_config", [Config(max_watchers=3)])
async def test_one_watcher_too_many_gets_413(server: RunningServer) -> None:
    clients = [await server.connect() for _ in range(4)]
    for client in clients[:3]:
        await client.send(b"watch p/\n")
        assert await read_snapshot(client) == []
    assert await clients[3].reply(b"watch p/") == b"413 Too Many Watchers\r\n"
    await clients[0].aclose()  # its slot comes free
    for _ in range(100):
        await trio.sleep(0.01)
        if server.service.backend.books.watchers.count < 3:
            break
    await clients[3].send(b"watch p/\n")
    assert await read_snapshot(clients[3]) == []


async def test_101_watchers_get_413(server: RunningServer) -> None:
    """The default --max-watchers is 100."""
    clients = [await server.connect() for _ in range(101)]
    for client in clients[:100]:
        await client.send(b"watch w/\n")
    for client in clients[:100]:
        assert await read_snapshot(client) == []
    assert await clients[100].reply(b"watch w/") == b"413 Too Many Watchers\r\n"


class Recorder:
    """The engine's transitions as it makes them, recorded by wrapping its grant and
    free paths (not through the watcher registry under test)."""

    def __init__(self, engine: LockEngine) -> None:
        self.log: list[tuple[str, bytes, bytes, bool]] = []
        grant_x, grant_s, free = (
            engine._grant_exclusive,
            engine._grant_shared,
            engine._free,
        )

        def grant_exclusive(session, key, now, ttl):  # type: ignore[no-untyped-def]
            hold = grant_x(session, key, now, ttl)
            self.log.append(("+", key, session.owner, False))
            return hold

        def grant_shared(session, key, now, ttl):  # type: ignore[no-untyped-def]
            had = key in session.shared
            count = grant_s(session, key, now, ttl)
            if not had:
                self.log.append(("+", key, session.owner, True))
            return count

        def free_hold(hold, now, *why):  # type: ignore[no-untyped-def]
            self.log.append(("-", hold.key, hold.session.owner, hold.shared))
            free(hold, now, *why)

        engine._grant_exclusive = grant_exclusive  # type: ignore[method-assign]
        engine._grant_shared = grant_shared  # type: ignore[method-assign]
        engine._free = free_hold  # type: ignore[method-assign]


@pytest.mark.parametrize("server_config", [Config(watch_buffer=16 << 20)])
async def test_random_traffic_from_20_clients_is_streamed_in_order(
    server: RunningServer,
) -> None:
    """1,000 random grants and frees from 20 clients: the watcher receives exactly
    the engine's transitions, in the order it made them."""
    engine = server.service.backend
    assert isinstance(engine, LockEngine)
    recorder = Recorder(engine)
    watcher = await server.connect()
    await watcher.send(b"watch\n")
    assert await read_snapshot(watcher) == []
    rng = random.Random(28)
    clients = [await server.connect() for _ in range(20)]
    for n, client in enumerate(clients):
        await client.reply(b"iam c%d" % n)
    keys = [b"k%d" % n for n in range(8)]
    held: list[set[bytes]] = [set() for _ in clients]
    shared: list[set[bytes]] = [set() for _ in clients]
    changes = 0

    async def act(n: int) -> int:
        client, key = clients[n], rng.choice(keys)
        roll = rng.random()
        if roll < 0.35:
            got = await client.reply(b"lock " + key)
            if got == b"200 Acquired\r\n" and key not in held[n]:
                held[n].add(key)
                return 1
        elif roll < 0.55 and held[n]:
            key = rng.choice(sorted(held[n]))
            assert await client.reply(b"unlock " + key) == b"200 Unlocked\r\n"
            held[n].discard(key)
            return 1
        elif roll < 0.75:
            if key not in shared[n]:
                await client.reply(b"lock_shared " + key)
                shared[n].add(key)
                return 1
        elif roll < 0.9 and shared[n]:
            key = rng.choice(sorted(shared[n]))
            await client.reply(b"unlock_shared " + key)
            shared[n].discard(key)
            return 1
        elif held[n] or shared[n]:
            freed = len(held[n]) + len(shared[n])
            assert await client.reply(b"unlock_all") == b"200 OK\r\n"
            held[n].clear()
            shared[n].clear()
            return freed
        return 0

    while changes < 1000:
        changes += await act(rng.randrange(len(clients)))
    events = []
    while len(events) < len(recorder.log):
        events.append(await watcher.line())
    seen = [
        (line[:1].decode(), line.split()[1], line.split()[3], line.split()[2] == b"shared")
        for line in events
    ]
    assert len(recorder.log) >= 1000
    assert seen == recorder.log
    # Tokens grow, and the shared counts replay to the engine's.
    holders: dict[bytes, int] = {}
    for line in events:
        fields = line.split()
        if fields[2] == b"shared":
            holders[fields[1]] = holders.get(fields[1], 0) + (1 if fields[0] == b"+" else -1)
            assert fields[4 if fields[0] == b"+" else 4] == b"holders=%d" % holders[fields[1]]
    assert {k: v for k, v in holders.items() if v} == {
        k: engine.shared_count(k) for k in keys if engine.shared_count(k)
    }


# ------------------------------------------------------------------ other doors


async def test_watch_over_websocket_sends_messages_of_whole_lines(
    nursery: trio.Nursery,
) -> None:
    """The reply, the snapshot and SYNCED come as one message; then each message is
    one or more whole event lines; a ping is answered while it streams; any
    message ends the stream."""
    server = await ws_start(nursery)
    tcp = await server.tcp()
    assert await tcp.reply(b"lock ws/a") == b"200 Acquired\r\n"
    async with open_websocket_url(server.url) as ws:
        await ws.send_message("watch ws/")
        first = await ws.get_message()
        assert isinstance(first, str)
        lines = first.split("\r\n")
        assert lines[0] == "200 Watching" and lines[-2:] == ["SYNCED", ""]
        assert lines[1].startswith("+ ws/a exclusive 127.0.0.1:")
        assert await tcp.reply(b"unlock ws/a") == b"200 Unlocked\r\n"
        assert await tcp.reply(b"lock_shared ws/b") == b"200 1\r\n"
        got = ""
        while got.count("\r\n") < 2:
            message = await ws.get_message()
            assert isinstance(message, str) and message.endswith("\r\n")
            got += message
        first_event, second_event = got.splitlines()
        assert first_event.startswith("- ws/a exclusive 127.0.0.1:")
        assert first_event.endswith(" released")
        assert second_event.startswith("+ ws/b shared 127.0.0.1:")
        assert second_event.endswith(" holders=1")
        await ws.ping(b"still there?")  # answered beside the stream
        await ws.send_message("ping")
        assert await ws.get_message() == "200 Bye\r\n"


async def test_watch_over_tls(
    nursery: trio.Nursery, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    config = Config(port=0, metrics_port=0, tls_cert=tls_files["cert"], tls_key=tls_files["key"])
    addresses = await nursery.start(serve, config, make_service(config))
    port = int(addresses[0][1])
    context = ssl.create_default_context()
    ca.configure_trust(context)
    watcher, holder = [await tls_client(port, context) for _ in range(2)]
    await watcher.send(b"watch t/\n")
    assert await read_snapshot(watcher) == []
    assert await holder.reply(b"lock_shared t/x") == b"200 1\r\n"
    assert await holder.reply(b"unlock_shared t/x") == b"200 0\r\n"
    peer = holder.stream.transport_stream.socket.getsockname()  # type: ignore[attr-defined]
    owner = b"%s:%d" % (peer[0].encode(), peer[1])
    assert await watcher.line() == b"+ t/x shared %s holders=1\r\n" % owner
    assert await watcher.line() == b"- t/x shared %s holders=0 released\r\n" % owner
    assert await watcher.reply(b"quit") == b"200 Bye\r\n"
    await watcher.aclose()
    await holder.aclose()


# ------------------------------------------------------------ a watcher that never reads


@pytest.mark.serial
async def test_a_watcher_that_never_reads_gets_overflow_with_rss_bounded() -> None:
    """A watcher that reads nothing while 40 MB of events are made: the server's RSS
    grows by far less than that; once it reads, it finds events, then OVERFLOW,
    then the end of the connection."""
    process, port = start_server("--send-timeout", "60")
    try:
        with socket.create_connection(("127.0.0.1", port)) as watcher:
            watcher.sendall(b"watch\n")
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port)) as worker:
                name = b"x" * 200  # each event line about 250 bytes
                worker.sendall(b"iam %s\n" % name)
                read_replies(worker, 1)
                before = rss_bytes(process.pid)
                peak = before
                for _ in range(80):  # 80 x 1000 grants and frees: about 40 MB of events
                    worker.sendall(b"g k\nr k\n" * 500)
                    read_replies(worker, 1000)
                    peak = max(peak, rss_bytes(process.pid))
            grown = peak - before
            print(f"RSS grew {grown / 1e6:.1f} MB while 40 MB of events were made")
            assert grown < 12e6, grown
            received = bytearray()
            watcher.settimeout(10)
            while chunk := watcher.recv(1 << 20):
                received += chunk
            assert received.startswith(b"200 Watching\r\nSYNCED\r\n")
            assert received.endswith(b"\r\nOVERFLOW\r\n")
            # What arrives before OVERFLOW is what the kernel's buffers took before
            # the watcher fell --watch-buffer behind (its queue is dropped then): its
            # size is the kernel's to choose, but it is whole events in order from
            # the first one made, each grant followed by its free.
            events = received.split(b"\r\n")[2:-2]
            assert events, "no event reached the watcher before OVERFLOW"
            for index, event in enumerate(events):
                sign = b"+" if index % 2 == 0 else b"-"
                assert event.startswith(sign + b" k exclusive "), (index, event[:40])
            assert len(received) < 8 << 20
    finally:
        stop_server(process)


def read_replies(sock: socket.socket, count: int) -> None:
    buffer = b""
    while buffer.count(b"\r\n") < count:
        chunk = sock.recv(65536)
        assert chunk
        buffer += chunk
