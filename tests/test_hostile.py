"""Hostile and churning clients against a real server process: what one client can
make the server hold stays bounded, and a crowd's churn does not stall the others.

One test per row of the attack table in docs/operations.md ("Hostile clients").
Each test measures the server's RSS from /proc and the worst round trip of a probe
doing ``g``/``r`` on its own connection while the attack runs (tests/support/hostile_tools.py).
Crowds of thousands of connections run in their own process (tests/support/crowd.py), so the
probe measures the server and not the test's own loop.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from elockd.daemon.server import keepalive_settings
from tests.support.hostile_tools import free_port, latency_probe, rss_bytes
from tests.support.netns import client_host, why_namespaces_cannot_be_made
from tests.support.polling import eventually
from tests.support.server_process import start_server, stop_server

# Probe latencies are measured against a bound: run alone, not beside other tests.
pytestmark = pytest.mark.serial

MB = 1 << 20
#: What a probe may wait at worst while the crowd churns (the bound of docs/operations.md).
PROBE_BOUND = 0.2
#: ... except when 10,000 connections close at once: their FINs arrive in one epoll
#: round and trio runs every woken connection task in one batch (about 15 us each
#: here, whatever the server then does), so the probe may wait for one or two such
#: batches. The million holds they free are sliced and add little to that floor
#: (docs/operations.md); measured 60-160 ms on the 2-core VM, up to 224 ms under CI.
DROP_PROBE_BOUND = 0.3
CROWD = str(Path(__file__).parent / "support" / "crowd.py")
VANISHING_CLIENT = str(Path(__file__).parent / "support" / "vanishing_client.py")
VANISHING_WAITER = str(Path(__file__).parent / "support" / "vanishing_waiter.py")
SCRAPER = str(Path(__file__).parent / "support" / "scraper.py")


@contextmanager
def server(
    *args: str, log: list[str] | None = None, preexec_fn: Callable[[], None] | None = None
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    process, port = start_server(*args, log=log, preexec_fn=preexec_fn)
    try:
        yield process, port
    finally:
        stop_server(process)


class Crowd:
    """tests/support/crowd.py as a child process, driven line by line."""

    def __init__(self, port: int, connections: int, lines: int, template: str, expect: int):
        self.process = subprocess.Popen(
            [sys.executable, CROWD, str(port), str(connections), str(lines), template, str(expect)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    async def said(self) -> str:
        assert self.process.stdout is not None
        line = await trio.to_thread.run_sync(self.process.stdout.readline)
        if not line:
            raise RuntimeError(f"crowd ended (exit {self.process.wait()})")
        return line.strip()

    async def command(self, command: str, until: str) -> list[str]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        lines = []
        while (line := await self.said()) != until:
            lines.append(line)
        return lines

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


async def read_lines(stream: trio.SocketStream, count: int) -> list[bytes]:
    buffer = b""
    while buffer.count(b"\n") < count:
        chunk = await stream.receive_some(1 << 16)
        assert chunk, "server closed the connection"
        buffer += chunk
    return buffer.split(b"\r\n")[:count]


async def counters(port: int) -> dict[str, int]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(b"q\n")
        buffer = b""
        while not buffer.endswith(b"END\r\n"):
            buffer += await stream.receive_some(1 << 16)
    finally:
        await stream.aclose()
    pairs = (line.split(": ") for line in buffer.decode().splitlines()[:-1])
    return {name: int(value) for name, value in pairs}


async def queued_all(port: int) -> bool:
    """Whether the crowd's 10,000 waits are all queued (a check for ``eventually``)."""
    return (await counters(port))["waiting"] >= 10_000


async def orphans(port: int, count: int) -> bool:
    """Whether ``count`` holds have been freed as orphans (a check for ``eventually``)."""
    return (await counters(port))["orphans"] >= count


async def test_twelve_unread_dumps_of_ten_megabytes_keep_memory_and_latency_bounded() -> None:
    """12 connections pipeline ``d`` over 10,000 keys of 1,000 bytes (a 10 MB reply
    each) and never read. Before replies were streamed, each built its whole reply:
    RSS +117 MB and a probe stalled up to 2.65 s."""
    with server() as (process, port):
        holder = await trio.open_tcp_stream("127.0.0.1", port)
        keys = [b"%05d" % i + b"k" * 995 for i in range(10_000)]
        await holder.send_all(b"".join(b"g " + key + b"\n" for key in keys))
        assert set(await read_lines(holder, 10_000)) == {b"1 Got Lock"}
        before = rss_bytes(process.pid)
        hogs = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(12)]
        async with latency_probe(port) as probe:
            for hog in hogs:
                await hog.send_all(b"d\n" * 1000)
            await trio.sleep(3)
            grown = rss_bytes(process.pid) - before
        served = await counters(port)
        for hog in hogs:
            await hog.aclose()
        await holder.aclose()
    assert served["command_d"] >= 12, "every hog got a dump going"
    print(f"RSS grew {grown / MB:.1f} MB")
    assert grown < 48 * MB, f"RSS grew {grown / MB:.1f} MB"
    print(f"probe worst {probe.worst * 1000:.1f} ms over {probe.count} round trips")
    assert probe.count > 100 and probe.worst < PROBE_BOUND, probe.worst


async def test_a_dump_read_slowly_lists_every_steady_hold_exactly_once() -> None:
    """Holds taken and freed while a big dump is being read do not make steady holds
    vanish or repeat (weakly consistent, as Redis's SCAN)."""
    with server() as (_, port):
        steady = await trio.open_tcp_stream("127.0.0.1", port)
        await steady.send_all(b"".join(b"g steady-%05d\n" % i for i in range(5000)))
        await read_lines(steady, 5000)
        churn = await trio.open_tcp_stream("127.0.0.1", port)
        reader = await trio.open_tcp_stream("127.0.0.1", port)
        await reader.send_all(b"d\n")
        received = b""
        round_ = 0
        while not received.endswith(b"END\r\n"):
            received += await reader.receive_some(4096)
            # Between reads: take 50 new keys and free the last round's.
            taken = b"".join(b"g churn-%d-%d\n" % (round_, i) for i in range(50))
            freed = b"".join(b"r churn-%d-%d\n" % (round_ - 1, i) for i in range(50))
            await churn.send_all(taken + (freed if round_ else b""))
            await read_lines(churn, 100 if round_ else 50)
            round_ += 1
        for stream in (steady, churn, reader):
            await stream.aclose()
    lines = received.split(b"\r\n")[:-2]
    steady_keys = [line.split(b":")[0] for line in lines if line.startswith(b"steady-")]
    assert round_ > 10, "the dump was read in many pieces while the tables changed"
    assert sorted(steady_keys) == [b"steady-%05d" % i for i in range(5000)]
    assert len(lines) == len(set(lines)), "no hold appears twice"


async def test_ten_thousand_waits_timing_out_together_do_not_stall_a_probe() -> None:
    """10,000 ``lock hot 5`` waits end at once. Removing each from the middle of the
    queue used to cost O(waiters), and every woken task ran in one batch: others
    stalled 0.44-1.15 s."""
    with server("--max-connections", "10100") as (_, port):
        holder = await trio.open_tcp_stream("127.0.0.1", port)
        await holder.send_all(b"lock hot\n")
        assert await read_lines(holder, 1) == [b"200 Acquired"]
        crowd = Crowd(port, 10_000, 1, "lock hot 5\n", 0)
        try:
            assert await crowd.said() == "ready"
            # The crowd has sent; let the server queue them all.
            await eventually(lambda: queued_all(port), timeout=30, interval=0.05)
            async with latency_probe(port) as probe:
                replies = await crowd.command("read 1", until="done")
        finally:
            crowd.stop()
        timeouts = (await counters(port))["timeouts"]
        await holder.aclose()
    assert replies == ["409 Unavailable x 10000"]
    assert timeouts == 10_000
    print(f"probe worst {probe.worst * 1000:.1f} ms over {probe.count} round trips")
    assert probe.count > 100 and probe.worst < PROBE_BOUND, probe.worst


async def test_ten_thousand_connections_with_a_million_locks_dropping_together() -> None:
    """10,000 connections holding 100 locks each close at once. Their holds are freed
    in slices between which other clients are served (before: a 0.30-0.55 s stall)."""
    with server("--max-connections", "10100") as (_, port):
        crowd = Crowd(port, 10_000, 100, "g c{c}-{n}\n", 100)
        try:
            assert await crowd.said() == "ready"
            assert (await counters(port))["locks"] == 1_000_000
            async with latency_probe(port) as probe:
                await trio.sleep(0.5)
                await crowd.command("close", until="closed")
                await eventually(lambda: orphans(port, 1_000_000), timeout=30, interval=0.05)
                await trio.sleep(0.2)
                final = await counters(port)  # while the probe still holds its own
        finally:
            crowd.stop()
    assert final["locks"] <= 1 and final["orphans"] == 1_000_000  # the probe's key aside
    print(f"probe worst {probe.worst * 1000:.1f} ms over {probe.count} round trips")
    assert probe.count > 100 and probe.worst < DROP_PROBE_BOUND, probe.worst


async def test_grace_sessions_without_a_connection_are_capped_by_max_sessions() -> None:
    """3,000 clients each set a long grace, take a lock and hang up, 100 connections
    at a time at most. Before --max-sessions every one lived on (77,714 in 20 s)."""
    with server("--max-connections", "100", "--max-sessions", "1000") as (_, port):
        for index in range(3000):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"set_timeout 86400000\ng k%d\n" % index)
            assert await read_lines(stream, 2) == [b"200 timeout set", b"1 Got Lock"]
            await stream.aclose()
        await eventually(lambda: orphans(port, 2000), interval=0.05)
        final = await counters(port)
    # The q connection itself is a session too.
    assert final["sessions"] == 1000 + 1
    assert final["locks"] == 1000 and final["orphans"] == 2000


async def test_a_renew_flood_leaves_memory_flat() -> None:
    """500,000 ``renew K ttl=86400`` of one lease: every superseded deadline used to
    stay until it fired a day later (RSS +60 MB, kept after unlock and disconnect)."""
    with server() as (process, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"lock k ttl=86400\n")
        assert await read_lines(stream, 1) == [b"200 Acquired"]
        before = rss_bytes(process.pid)
        batch = 10_000
        received = 0

        async def read_all() -> None:
            nonlocal received
            buffer = b""
            while received < 500_000:
                buffer += await stream.receive_some(1 << 16)
                *lines, buffer = buffer.split(b"\n")
                assert all(line == b"200 Renewed\r" for line in lines)
                received += len(lines)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            for _ in range(500_000 // batch):
                await stream.send_all(b"renew k ttl=86400\n" * batch)
        grown = rss_bytes(process.pid) - before
        await stream.aclose()
    print(f"RSS grew {grown / MB:.1f} MB over 500,000 renews")
    assert grown < 16 * MB, f"RSS grew {grown / MB:.1f} MB"


async def test_numbers_that_are_not_finite_or_above_max_ttl_get_400() -> None:
    """``ttl=`` followed by 400 nines was accepted as infinity (``info`` said
    ``ttl=inf``); so was a set_timeout of 999999999999 ms."""
    nines = b"9" * 400
    with server() as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        requests = [
            b"lock k 0 ttl=" + nines,
            b"lock k inf",
            b"lock k nan",
            b"lock k 1e400",
            b"lock k " + nines,
            b"lock k 0 ttl=86401",
            b"set_timeout " + nines,
            b"set_timeout 999999999999",
            b"set_timeout inf",
            b"renew k ttl=nan",
            b"mlock a b wait=1e400",
            b"info k",
        ]
        await stream.send_all(b"".join(line + b"\n" for line in requests))
        replies = await read_lines(stream, len(requests))
        await stream.aclose()
    assert all(reply.startswith(b"400 Bad Request: ") for reply in replies[:-1]), replies
    assert replies[-1] == b"200 key=k exclusive=- shared=0 waiting=0 ttl=- token=-"


async def test_a_big_reply_read_slowly_but_steadily_is_not_cut() -> None:
    """``--send-timeout 1``: a 10 MB dump read at about 3 MB/s takes three timeouts
    and more, but no stall lasts one. Before, the timeout bounded the whole reply."""
    with server("--send-timeout", "1") as (_, port):
        holder = await trio.open_tcp_stream("127.0.0.1", port)
        keys = [b"%05d" % i + b"k" * 995 for i in range(10_000)]
        await holder.send_all(b"".join(b"g " + key + b"\n" for key in keys))
        await read_lines(holder, 10_000)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
        reader = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        await reader.socket.connect(("127.0.0.1", port))
        await reader.send_all(b"d\n")
        received = 0
        started = trio.current_time()
        while True:
            chunk = await reader.receive_some(32768)
            assert chunk, f"dropped after {received} bytes"
            received += len(chunk)
            if chunk.endswith(b"END\r\n"):
                break
            await trio.sleep(0.01)  # about 3 MB/s
        took = trio.current_time() - started
        await reader.aclose()
        await holder.aclose()
    print(f"{received / 1e6:.1f} MB read whole in {took:.2f} s")
    assert received > 10_000_000
    assert took > 3, f"read in {took:.1f} s: the test needs a reply slower than the timeout"


def low_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


async def test_over_the_descriptor_limit_connections_are_told_why() -> None:
    """``ulimit -n 256`` and 300 connections: the excess used to hang silently while
    the server logged 10 warnings a second."""
    log: list[str] = []
    with server(log=log, preexec_fn=low_descriptor_limit) as (_, port):
        streams = []
        replies: list[bytes] = []
        with trio.fail_after(20):
            for index in range(300):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                streams.append(stream)
                await stream.send_all(b"g k%d\n" % index)
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = await stream.receive_some(1024)
                    if not chunk:
                        break
                    reply += chunk
                replies.append(reply)
            for stream in streams:
                await stream.aclose()
    served = replies.count(b"1 Got Lock\r\n")
    refused = replies.count(b"0 Too Many Connections\r\n")
    print(f"{served} served, {refused} told '0 Too Many Connections'")
    assert served + refused == 300 and served > 200 and refused >= 40
    warnings = [line for line in log if "accept:" in line]
    assert len(warnings) == 1, warnings


def vanish_keepalive() -> tuple[float, list[str]]:
    """``--keepalive`` for the vanished-host tests and the flags that set it: 5 s in
    ``make test``, to be quick; the default 30 s under VANISH_DEFAULT_FLAGS=1
    (``make stress``)."""
    if os.environ.get("VANISH_DEFAULT_FLAGS"):
        return 30.0, []
    return 5.0, ["--keepalive", "5"]


@pytest.mark.skipif(
    (why := why_namespaces_cannot_be_made()) is not None, reason=f"no network namespaces: {why}"
)
async def test_a_vanished_client_host_loses_its_lock_within_keepalive() -> None:
    """The client's host vanishes (its link goes down: no FIN, no RST ever arrives).
    Its lock used to be held for 2 h 11 min (the kernel's keepalive defaults).
    ``make stress`` runs the same with default flags (VANISH_DEFAULT_FLAGS=1: the
    default --keepalive 30); ``make test`` with --keepalive 5, to be quick."""
    keepalive, flags = vanish_keepalive()
    with (
        client_host() as host,
        server("--host", host.gateway, *flags) as (_, port),
    ):
        client = subprocess.Popen(
            host.command(sys.executable, VANISHING_CLIENT, host.gateway, str(port)),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "1 Got Lock"
            probe = await trio.open_tcp_stream(host.gateway, port)
            await probe.send_all(b"i job\n")
            assert await read_lines(probe, 1) == [b"1 Locked"]
            host.vanish()
            vanished = trio.current_time()

            async def freed() -> bool:
                await probe.send_all(b"i job\n")
                return await read_lines(probe, 1) == [b"0 Not Locked"]

            await eventually(freed, timeout=keepalive + 5, interval=0.2)
            freed_after = trio.current_time() - vanished
            await probe.aclose()
        finally:
            client.kill()
            client.wait()
    print(f"lock freed {freed_after:.1f} s after the host vanished (--keepalive {keepalive:g})")
    assert freed_after <= keepalive


@pytest.mark.skipif(
    (why := why_namespaces_cannot_be_made()) is not None, reason=f"no network namespaces: {why}"
)
async def test_a_vanished_client_host_granted_during_the_cut_frees_the_key_within_the_bound() -> (
    None
):
    """The host of a waiting client vanishes, and its grant is then sent into the void.
    With a reply unacknowledged, Linux stops keepalive probing and only
    TCP_USER_TIMEOUT counts, from the send: the key used to stay taken for the whole
    bound after the grant (7 s from the vanish at --keepalive 5, 42 s at 30). The
    bound of docs/operations.md runs from when the host was last heard from: the
    keepalive bound (idle + interval x count), plus up to 1 s.

    The waiter is heard from just before its host vanishes, and the grant goes out
    at three quarters of the bound, while the connection still lives."""
    keepalive, flags = vanish_keepalive()
    idle, interval, count = keepalive_settings(keepalive)
    bound = idle + interval * count
    with (
        client_host() as host,
        server("--host", host.gateway, *flags) as (_, port),
    ):
        holder = await trio.open_tcp_stream(host.gateway, port)
        probe = await trio.open_tcp_stream(host.gateway, port)
        await holder.send_all(b"lock job\n")
        assert await read_lines(holder, 1) == [b"200 Acquired"]
        waiter = subprocess.Popen(
            host.command(sys.executable, VANISHING_WAITER, host.gateway, str(port)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert waiter.stdin is not None and waiter.stdout is not None
            assert waiter.stdout.readline().strip() == "waiting"

            async def info() -> bytes:
                await probe.send_all(b"info job\n")
                return (await read_lines(probe, 1))[0]

            async def queued() -> bool:
                return b" waiting=1 " in await info()

            await eventually(queued, timeout=5, interval=0.05)
            waiter.stdin.write("touch\n")
            waiter.stdin.flush()
            assert waiter.stdout.readline().strip() == "heard"
            host.vanish()
            vanished = trio.current_time()
            await trio.sleep(0.75 * bound)  # the scenario: the holder leaves during the cut
            await holder.send_all(b"unlock job\n")
            assert await read_lines(holder, 1) == [b"200 Unlocked"]
            granted = trio.current_time() - vanished
            assert b" exclusive=- " not in await info(), "the waiter was not granted"

            async def freed() -> bool:
                return b" exclusive=- " in await info()

            await eventually(freed, timeout=2 * bound + 5, interval=0.1)
            freed_after = trio.current_time() - vanished
        finally:
            waiter.kill()
            waiter.wait()
            await holder.aclose()
            await probe.aclose()
    print(
        f"granted {granted:.1f} s after the host vanished, freed {freed_after:.1f} s after"
        f" (--keepalive {keepalive:g}: bound {bound} s + 1 s)"
    )
    assert freed_after <= bound + 1


async def test_scrapers_in_a_tight_loop_do_not_stall_lock_clients() -> None:
    """8 processes scraping /metrics as fast as they can (each scrape took 1.46 ms of
    the event loop, and lock throughput fell from 421k to 87k req/s). Rendering is
    cached for a second and HTTP connections are capped, so a probe is not held up."""
    metrics_port = free_port()
    with server("--metrics-port", str(metrics_port)) as (_, port):
        holder = await trio.open_tcp_stream("127.0.0.1", port)
        await holder.send_all(b"".join(b"g k%d\n" % i for i in range(100_000)))
        await read_lines(holder, 100_000)
        scrapers = [
            subprocess.Popen([sys.executable, SCRAPER, str(metrics_port), "4"]) for _ in range(8)
        ]
        try:
            async with latency_probe(port) as probe:
                await trio.sleep(3)
        finally:
            for scraper in scrapers:
                scraper.kill()
                scraper.wait()
        await holder.aclose()
    print(f"probe worst {probe.worst * 1000:.1f} ms over {probe.count} round trips")
    assert probe.count > 100 and probe.worst < PROBE_BOUND, probe.worst


async def test_guessing_auth_tokens_is_slow_and_logged() -> None:
    """Wrong ``auth`` tokens: 7,835 guesses a second, nothing logged. Now each costs
    its connection --auth-failure-delay (1 s), a warning names the peer, and the
    server goes on serving others meanwhile."""
    log: list[str] = []
    token = Path(tempfile.mkdtemp()) / "token"
    token.write_text("right-token\n")
    with server("--auth-token-file", str(token), log=log) as (_, port):
        guessed = 0

        async def guess() -> None:
            nonlocal guessed
            while True:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(b"auth wrong-%d\n" % guessed)
                assert await read_lines(stream, 1) == [b"403 Bad Token"]
                guessed += 1
                await stream.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(guess)
            async with latency_probe(port, token=b"right-token") as probe:
                await trio.sleep(2.5)
            nursery.cancel_scope.cancel()
    print(f"{guessed} guesses in 2.5 s; probe worst {probe.worst * 1000:.1f} ms")
    assert guessed <= 3, f"{guessed} guesses in 2.5 s on one connection at a time"
    assert probe.count > 100 and probe.worst < PROBE_BOUND
    warnings = [line for line in log if "auth failed" in line and "peer=127.0.0.1:" in line]
    assert len(warnings) == 1, log  # one line per 10 s, however many guesses
