"""Abusive clients: the server bounds what each costs and keeps answering everyone else.

Two kinds of tests. In-process ones (trio, ``MockClock`` where time matters) pin down
behaviour exactly: slowloris, half-close, random bytes, connection bursts, reply
floods. Real-process ones measure what an operator cares about while the abuse goes
on: a well-behaved probe client's latency (p99) and the server's resident memory.
They print their measurements (``pytest -s tests/test_abuse.py``); the bounds they
assert are generous, so a slow CI machine does not fail them, but each would fail on
the behaviour it guards against (a stalled server, an unbounded buffer).
docs/operations-faults.md quotes the numbers.
"""

from __future__ import annotations

import math
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
import trio
import trio.testing

from elockd.daemon.server import make_service, serve_stream
from elockd.net.serving import REPLY_FLUSH_BYTES
from elockd.protocol.config import Config
from elockd.protocol.connection import Connection, Streamed
from elockd.protocol.framing import LineReader
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import eventually, eventually_blocking, stats_showing
from tests.support.sansio import memory_service
from tests.support.server_process import SpawnServer, drained

# ------------------------------------------------------------------ in-process


@pytest.mark.parametrize("server_config", [Config(idle_timeout=30)])
async def test_slowloris_is_answered_and_trickling_below_idle_rate_is_dropped(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    """A request sent one byte every 10 s is still one request: nothing happens before
    its newline, then it is answered. A client silent for longer than --idle-timeout
    between bytes is dropped, its partial line never executed."""
    slow, trickler, probe = await server.connect(), await server.connect(), await server.connect()
    for byte in b"g slow-key":
        await slow.send(bytes([byte]))
        await trio.sleep(10)
        assert await probe.request(b"i slow-key") == b"0 Not Locked"
    await slow.send(b"\n")
    assert await slow.line() == b"1 Got Lock\r\n"
    assert await probe.request(b"i slow-key") == b"1 Locked"

    await trickler.send(b"g tr")
    for _ in range(4):  # 40 s: more than the idle timeout between two bytes
        await trio.sleep(10)
        assert await probe.request(b"ping") == b"200 PONG"
        assert await slow.request(b"ping") == b"200 PONG"
    assert await trickler.at_eof()
    assert await probe.request(b"i tr") == b"0 Not Locked"
    assert (await probe.stats())["connections"] == 2


async def test_random_bytes_get_one_reply_per_line(server: RunningServer) -> None:
    """A megabyte of random bytes (one stretch of it longer than --max-line) gets
    exactly the replies the sans-IO layer gives it: one per line, none lost or extra,
    and the connection stays usable."""
    rng = random.Random(6)
    too_long = rng.randbytes(10_000).replace(b"\n", b"x")
    garbage = rng.randbytes(1 << 20) + too_long + rng.randbytes(4096) + b"\nping\n"
    replay = Connection(memory_service(), b"replay")
    replies = [
        reply.whole() if isinstance(reply, Streamed) else reply
        for reply in (
            replay.handle(line, 0.0) for line in LineReader(Config().max_line).feed(garbage)
        )
    ]
    assert all(isinstance(reply, bytes) for reply in replies)  # nothing waits alone
    expected = b"".join(reply for reply in replies if isinstance(reply, bytes))
    assert expected.endswith(b"200 PONG\r\n")
    assert b"0 Line Too Long\r\n" in expected
    client = await server.connect()
    await client.send(garbage)
    received = []
    with trio.fail_after(10):
        for _ in range(expected.count(b"\r\n")):
            received.append(await client.line())
    assert received[-1] == b"200 PONG\r\n"
    assert len(received) == expected.count(b"\r\n")
    assert await client.request(b"ping") == b"200 PONG"
    assert server.service.counters.invalid_commands == replay.service.counters.invalid_commands


async def test_half_close_gets_every_reply_then_the_session_ends(server: RunningServer) -> None:
    client, other = await server.connect(), await server.connect()
    await client.send(b"g a\nsg b\nlock c\ni a\n")
    await client.stream.send_eof()
    assert [await client.line() for _ in range(4)] == [
        b"1 Got Lock\r\n",
        b"1 Got Lock\r\n",
        b"200 Acquired\r\n",
        b"1 Locked\r\n",
    ]
    assert await client.at_eof()
    stats = await eventually(lambda: stats_showing(other, connections=1), what="the session end")
    assert (stats["locks"], stats["shared_locks"], stats["orphans"]) == (0, 0, 2)


async def test_half_close_while_waiting_cancels_the_wait(server: RunningServer) -> None:
    """EOF ends the session (docs/protocol.md): a wait in progress is cancelled and gets no
    reply, nor do the requests pipelined behind it; replies before it were sent."""
    holder, client = await server.connect(), await server.connect()
    assert await holder.request(b"g busy") == b"1 Got Lock"
    await client.send(b"g mine\nlock busy 100\ni mine\n")
    assert await client.line() == b"1 Got Lock\r\n"
    await client.stream.send_eof()
    assert await client.at_eof()
    stats = await holder.stats()
    assert (stats["waiting"], stats["locks"], stats["orphans"]) == (0, 1, 1)
    assert await holder.request(b"i mine") == b"0 Not Locked"


@pytest.mark.parametrize("server_config", [Config(max_connections=5)])
async def test_a_burst_of_connections_is_held_to_max_connections(server: RunningServer) -> None:
    """Regression: the limit was checked against connections whose task had started,
    and the accept loop takes a whole burst before any new task starts, so a burst
    of 50 connections was accepted in full. Now slots are counted at accept."""
    burst = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(50)]
    streams = [trio.SocketStream(trio.socket.from_stdlib_socket(sock)) for sock in burst]
    clients = [LineClient(stream) for stream in streams]
    replies = []
    with trio.fail_after(10):
        for client in clients:
            await client.send(b"ping\n")
            replies.append(await client.line())
    assert replies.count(b"200 PONG\r\n") == 5
    assert replies.count(b"0 Too Many Connections\r\n") == 45
    refused = [c for c, r in zip(clients, replies, strict=True) if r.startswith(b"0")]
    assert all([await c.at_eof() for c in refused])
    for client in clients:
        await client.aclose()

    # Slots come back when connections end: a new client gets in.
    async def let_in() -> bool:
        reply = await (await server.connect()).request(b"ping")
        assert reply in (b"200 PONG", b"0 Too Many Connections"), reply
        return reply == b"200 PONG"

    await eventually(let_in, what="a slot for a new connection")


async def test_a_reply_flood_is_sent_in_bounded_batches(nursery: trio.Nursery) -> None:
    """Regression: the replies to one received chunk were all built before one write.
    64 KiB of ``d\\n`` is 32,768 dumps; with 300 keys held that was ~700 MB and a
    5 s stall of every other client. Now replies go out every REPLY_FLUSH_BYTES, so a
    client that does not read stops the server after one batch."""
    service = make_service(Config(port=0, metrics_port=0))
    holder = Connection(service, b"holder")
    for index in range(300):
        holder.handle(b"g key-%05d" % index, 0.0)
    dump = holder.handle(b"d", 0.0)
    assert isinstance(dump, Streamed)
    dump_size = len(dump.whole())
    hog, hog_server = trio.testing.lockstep_stream_pair()  # send blocks until read
    nursery.start_soon(serve_stream, service, hog_server, b"hog")
    nursery.start_soon(hog.send_all, b"d\n" * 32768)
    await trio.testing.wait_all_tasks_blocked()
    handled = service.counters.commands[b"d"] - 1  # minus the holder's own
    assert 1 <= handled <= REPLY_FLUSH_BYTES // dump_size + 1
    # Everyone else is still served while the hog's replies wait for it.
    probe, probe_server = trio.testing.memory_stream_pair()
    nursery.start_soon(serve_stream, service, probe_server, b"probe")
    await probe.send_all(b"ping\n")
    assert await probe.receive_some() == b"200 PONG\r\n"
    assert service.counters.commands[b"d"] - 1 == handled


async def test_a_clock_jump_ends_exactly_what_became_due(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    """Leases, waits and timeouts run on trio's monotonic clock, never the wall clock.
    When that clock leaps (a paused VM resuming, here a MockClock jump), what fell due
    ends at once and nothing else does."""
    mock_clock.autojump_threshold = math.inf  # time moves only when told
    holder, waiter, observer = [await server.connect() for _ in range(3)]
    assert await holder.request(b"lock leased 0 ttl=30") == b"200 Acquired"
    assert await holder.request(b"g plain") == b"1 Got Lock"
    await waiter.send(b"lock plain 60\n")
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(45)  # past the lease, not past the wait
    await trio.testing.wait_all_tasks_blocked()
    assert await observer.request(b"i leased") == b"0 Not Locked"
    assert await observer.request(b"info plain") == (
        b"200 key=plain exclusive=127.0.0.1:%d shared=0 waiting=1 ttl=- token=%d"
        % (holder.stream.socket.getsockname()[1], server.service.backend.exclusive[b"plain"].token)
    )
    mock_clock.jump(20)  # past the wait
    assert await waiter.line() == b"409 Unavailable\r\n"
    stats = await observer.stats()
    assert (stats["expired"], stats["timeouts"], stats["locks"]) == (1, 1, 1)


# ---------------------------------------------------------------- real process


def memory_kb(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of a process (VmHWM: its peak so far), from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[int(0.99 * (len(ordered) - 1))]


class Probe:
    """A well-behaved client timing ``ping`` round trips in a thread while abuse goes
    on, so the test thread is free to be the abuser."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        buffer = b""
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sock.sendall(b"ping\n")
                while b"\r\n" not in buffer:
                    chunk = self.sock.recv(4096)
                    if not chunk:
                        raise ConnectionError("closed")
                    buffer += chunk
            except OSError as error:
                self.errors.append(repr(error))
                return
            line, _, buffer = buffer.partition(b"\r\n")
            if line != b"200 PONG":
                self.errors.append(repr(line))
                return
            self.latencies.append(time.monotonic() - started)
            self._stop.wait(0.002)

    def report(self, what: str) -> str:
        ms = [x * 1000 for x in self.latencies]
        return (
            f"{what}: probe {len(ms)} pings, p50 {sorted(ms)[len(ms) // 2]:.2f} ms, "
            f"p99 {p99(ms):.2f} ms, max {max(ms):.2f} ms"
        )


@contextmanager
def probing(port: int) -> Iterator[Probe]:
    probe = Probe(port)
    probe._thread.start()
    try:
        yield probe
    finally:
        probe._stop.set()
        probe._thread.join()
        probe.sock.close()
    assert probe.errors == []
    assert len(probe.latencies) >= 10


def stats(port: int) -> dict[str, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"q\n")
        data = b""
        while not data.endswith(b"END\r\n"):
            chunk = sock.recv(65536)
            assert chunk, "closed before END"
            data += chunk
    lines = data.decode().splitlines()[:-1]
    return {name: int(value) for name, _, value in (line.partition(": ") for line in lines)}


def test_ten_megabyte_lines_keep_memory_flat(spawn_server: SpawnServer) -> None:
    process, port = spawn_server()
    before = memory_kb(process.pid)
    line = b"g " + b"x" * (10 << 20) + b"\n"
    sent = 0
    with probing(port) as probe, socket.create_connection(("127.0.0.1", port)) as abuser:
        started = time.monotonic()
        # Keep the abuse going until the probe has a fair sample (at most 100 lines).
        while sent < 3 or (len(probe.latencies) < 300 and sent < 100):
            abuser.sendall(line)
            sent += 1
        abuser.sendall(b"ping\n")
        received = b""
        while not received.endswith(b"200 PONG\r\n"):
            received += abuser.recv(4096)
        elapsed = time.monotonic() - started
    growth = memory_kb(process.pid, "VmHWM") - before
    print(f"\n{sent} x 10 MB lines in {elapsed:.2f} s; server peak RSS +{growth} kB")
    print(probe.report("10 MB lines"))
    assert received == b"0 Line Too Long\r\n" * sent + b"200 PONG\r\n"
    assert growth < 16 << 10  # hundreds of MB went through; nothing like it stays
    assert p99(probe.latencies) < 1.0


def test_flood_of_slowloris_connections_past_max_connections(spawn_server: SpawnServer) -> None:
    """600 connections, each sending a --max-line partial request and then nothing,
    against --max-connections 200: 199 get in (the probe has a slot), the rest are
    told and closed, and the probe never waits long."""
    process, port = spawn_server("--max-connections", "200")
    before = memory_kb(process.pid)
    partial = b"g " + b"s" * 4000
    with probing(port) as probe:
        started = time.monotonic()
        flood = []
        for _ in range(600):
            sock = socket.create_connection(("127.0.0.1", port))
            with suppress(ConnectionError):  # a refused one may be closed already
                sock.sendall(partial)
            flood.append(sock)
        replies: dict[socket.socket, bytes] = {}

        def all_refusals_arrived() -> bool:
            for sock in flood:
                if sock not in replies:
                    with suppress(BlockingIOError):  # served: a partial line gets no reply
                        replies[sock] = sock.recv(64, socket.MSG_DONTWAIT)
            return len(replies) >= 600 - 199

        eventually_blocking(all_refusals_arrived, timeout=10, interval=0.02, what="the refusals")
        refused = sum(reply == b"0 Too Many Connections\r\n" for reply in replies.values())
        elapsed = time.monotonic() - started
        held = memory_kb(process.pid) - before
        served = [sock for sock in flood if sock not in replies]
        # Keep knocking while the probe takes its sample: each knock is refused.
        knocks = 0
        while len(probe.latencies) < 300 and knocks < 20_000:
            with socket.create_connection(("127.0.0.1", port)) as knock:
                assert knock.recv(64) == b"0 Too Many Connections\r\n"
            knocks += 1
        knock_seconds = time.monotonic() - started - elapsed
        # The held ones are live sessions: ending their partial lines gets them replies.
        for sock in served:
            sock.sendall(b"\n")
        answers = [sock.recv(64) for sock in served]
        for sock in flood:
            sock.close()
    print(
        f"\nflood: 600 connections in {elapsed:.2f} s, {refused} refused, {len(served)} "
        f"slowloris held (+{held} kB RSS, {held / max(1, len(served)):.1f} kB each); then "
        f"{knocks} more refused in {knock_seconds:.2f} s"
    )
    print(probe.report("connection flood"))
    assert refused == 600 - 199
    # They all asked for the same key: whichever line the server read first got it.
    assert sorted(answers) == [b"0 Cannot Get Lock\r\n"] * 198 + [b"1 Got Lock\r\n"]
    assert p99(probe.latencies) < 1.0
    eventually_blocking(
        lambda: stats(port)["connections"] == 1, timeout=10, what="flood connections to end"
    )


def test_pipeliner_that_never_reads_is_throttled_then_dropped(spawn_server: SpawnServer) -> None:
    """A client pipelining a million requests without reading its replies: the server
    stops reading it once its replies back up, answers everyone else throughout, keeps
    its memory bounded, and drops it --send-timeout after the last successful send."""
    process, port = spawn_server("--send-timeout", "2")
    before = memory_kb(process.pid)
    hog = socket.create_connection(("127.0.0.1", port))
    hog.settimeout(30)
    outcome: list[str] = []

    def pipeline() -> None:
        try:
            hog.sendall(b"ping\n" * 1_000_000)
            outcome.append("all sent")
        except OSError as error:
            outcome.append(type(error).__name__)

    with probing(port) as probe:
        writer = threading.Thread(target=pipeline)
        started = time.monotonic()
        writer.start()
        eventually_blocking(
            lambda: stats(port)["command_ping"] > 0, timeout=10, what="the hog to be served"
        )
        served = time.monotonic()
        eventually_blocking(
            lambda: stats(port)["connections"] == 2, timeout=15, what="the hog to be dropped"
        )
        dropped = time.monotonic() - served
        writer.join(30)
    answered = stats(port)["command_ping"] - len(probe.latencies)
    growth = memory_kb(process.pid, "VmHWM") - before
    hog.close()
    print(
        f"\npipeliner: dropped {dropped:.2f} s after it started ({time.monotonic() - started:.2f} "
        f"s total); {answered} of 1,000,000 requests answered; writer: {outcome}; "
        f"server peak RSS +{growth} kB"
    )
    print(probe.report("pipeliner"))
    assert answered < 1_000_000  # it stopped reading the hog
    assert growth < 32 << 10
    assert p99(probe.latencies) < 1.0
    assert dropped < 2 + 10


def test_sigterm_under_load_exits_zero_promptly(spawn_server: SpawnServer) -> None:
    """SIGTERM while 24 clients take, wait for and release locks as fast as they can:
    exit 0 within seconds, and no traceback on stderr."""
    lines: list[str] = []
    process, port = spawn_server(log=lines)
    stop = threading.Event()
    done = [0] * 24

    def busy(index: int) -> None:
        key = b"k%d" % (index % 4)
        script = b"g %s\nlock_shared s 0.05 limit=2\nlock w 0.05\nr %s\nunlock_all\n" % (key, key)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                while not stop.is_set():
                    sock.sendall(script)
                    received = b""
                    while received.count(b"\r\n") < 5:
                        chunk = sock.recv(4096)
                        if not chunk:
                            return
                        received += chunk
                    done[index] += 1
        except OSError:
            return  # reset by the closing server

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    try:
        eventually_blocking(lambda: sum(done) >= 500, timeout=20, what="clients to get going")
        assert stats(port)["connections"] >= 25
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=10)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    drained(process)
    log = "".join(lines)
    print(
        f"\nSIGTERM with 24 busy clients ({sum(done)} rounds done): exit {code} in {elapsed:.3f} s"
    )
    assert code == 0
    assert "Traceback" not in log
    assert "SIGTERM received" in log
    assert elapsed < 5
