"""A hand-over past clients that do not read their replies (docs/upgrade.md, "A client
that does not read"): such a connection is carried with its unsent replies, or
dropped as the send timeout would drop it, and never holds the others frozen."""

from __future__ import annotations

import fcntl
import socket
import ssl
import termios
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from elockd.handover.pause import Pause
from elockd.net.transport import UNSENT_LIMIT, SocketTransport
from tests.support.cluster_nodes import Nodes
from tests.support.hostile_tools import free_port
from tests.support.polling import until_waiting
from tests.support.server_process import stop_server
from tests.support.websocket_tools import RawWebSocket, masked_frame
from tests.test_handover import (
    ask,
    connect,
    crowd_holding_a_lock_each,
    old_server,
    run_fake_successor,
    take_over,
    take_over_under_probe,
    tls_connect,
    wait_exit,
)

#: The stuck client's receive buffer: the kernel doubles it and keeps a floor.
TINY_BUFFER = 4096
#: ``d`` and ``q``, each padded with blanks (which the server ignores) to 4000
#: bytes: the requests the server's receive buffer holds stay few, and with them
#: the replies the test has to read in the end.
PADDED_DUMP_AND_COUNTERS = b"d" + b" " * 3999 + b"\n" + b"q" + b" " * 3999 + b"\n"


class StuckClient:
    """A plain socket with a tiny receive buffer that sends ``requests`` (a ``d`` or
    ``q`` each) without reading a byte, until its own sends block: then the server
    has stopped reading it, stuck in a send of replies the client does not take."""

    def __init__(self, port: int) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TINY_BUFFER)
        sock.connect(("127.0.0.1", port))
        self.sock = sock
        self.sent = 0  # requests sent whole, each answered with a reply ending "END"
        self.rest = b""  # what is left of the request being sent when it blocked

    def take(self, key: bytes) -> None:
        """``g KEY``, read while it still reads."""
        self.sock.sendall(b"g " + key + b"\n")
        assert self.sock.recv(100) == b"1 Got Lock\r\n"

    async def flood(self, request: bytes = PADDED_DUMP_AND_COUNTERS) -> None:
        """Send ``request`` over and over until the server stops taking them; each
        ``d`` and ``q`` counts as one reply owed once its line is out. The request
        being sent when the server stopped reading is finished by
        :meth:`read_every_reply`."""
        self.sock.setblocking(False)
        blocked_since = None
        pending = memoryview(b"")
        with trio.fail_after(30):
            while True:
                if not pending:
                    pending = memoryview(request)
                try:
                    sent = self.sock.send(pending)
                except BlockingIOError:
                    # Blocked for 0.5 s in a row: the server reads no more of it.
                    now = trio.current_time()
                    blocked_since = now if blocked_since is None else blocked_since
                    if now - blocked_since > 0.5:
                        break
                    await trio.sleep(0.02)
                    continue
                blocked_since = None
                self.sent += bytes(pending[:sent]).count(b"\n")
                pending = pending[sent:]
        self.rest = bytes(pending)

    async def read_every_reply(self, timeout: float) -> int:
        """Finish the last request and read until every request has its reply (an
        ``END`` line each), or until the connection ends: the count of replies read."""
        self.sock.setblocking(False)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(self.sock))
        ends = 0
        partial = b""
        self.sent += self.rest.count(b"\n")
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, self.rest)
                while ends < self.sent:
                    chunk = await stream.receive_some(1 << 16)
                    if not chunk:
                        break
                    *lines, partial = (partial + chunk).split(b"\r\n")
                    ends += lines.count(b"END")
        return ends


def stuck_pair() -> tuple[SocketTransport, socket.socket, Pause]:
    """A transport whose peer reads nothing yet (small buffers both ways), paused by
    a pause of its own."""
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TINY_BUFFER)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_BUFFER)
    transport = SocketTransport(ours)
    transport.pause = Pause()
    return transport, theirs, transport.pause


async def test_a_pause_stops_a_stuck_send_owing_the_rest_which_goes_out_first_after() -> None:
    transport, theirs, pause = stuck_pair()
    reply = bytes(range(256)) * 1024
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(transport.send, reply)
            await trio.testing.wait_all_tasks_blocked()
            pause.request()  # the send returns, without a byte more going out
    owed = len(transport.unsent)
    assert 0 < owed < len(reply)
    await transport.send(b"next reply")  # while paused, owed after the rest
    assert len(transport.unsent) == owed + len(b"next reply")
    pause.resume()
    received = bytearray()

    async def read_all_then_ask() -> None:
        theirs.setblocking(False)
        while len(received) < len(reply) + len(b"next reply"):
            await trio.lowlevel.wait_readable(theirs)
            received.extend(theirs.recv(65536))
        theirs.send(b"next request\n")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all_then_ask)
        with trio.fail_after(5):  # a read sends what is owed first
            assert await transport.receive() == b"next request\n"
    assert received == reply + b"next reply"
    assert not transport.unsent


async def test_a_paused_send_owing_more_than_the_limit_ends_the_connection() -> None:
    transport, _, pause = stuck_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(transport.send, b"x" * 100_000)
            await trio.testing.wait_all_tasks_blocked()
            pause.request()
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(UNSENT_LIMIT // 32768 + 1):
            await transport.send(b"d" * 32768)  # the rest of a dump, made meanwhile


async def test_a_stuck_client_does_not_stop_a_failed_hand_over_from_resuming(
    tmp_path: Path,
) -> None:
    """A successor that never says ready: the hand-over fails after its timeout, not
    by the stuck client, and the stuck client gets every reply once it reads."""
    control = tmp_path / "control.sock"
    log: list[str] = []
    with old_server(control, "--handover-timeout", "1", log=log) as (old, port):
        holder = await connect(port)
        for index in range(200):
            assert await ask(holder, b"g key-%d" % index) == b"1 Got Lock\r\n"
        stuck = StuckClient(port)
        stuck.take(b"stuck-key")
        await stuck.flood()
        await run_fake_successor(control, "never-ready")
        assert old.poll() is None
        assert await ask(holder, b"i stuck-key") == b"1 Locked\r\n"
        assert await stuck.read_every_reply(10) == stuck.sent
        stuck.sock.setblocking(True)
        stuck.sock.sendall(b"i stuck-key\n")
        assert stuck.sock.recv(100) == b"1 Locked\r\n"
    assert any("hand-over failed" in line for line in log), log
    assert not any("did not reach a request boundary" in line for line in log), log


@pytest.mark.serial
async def test_one_stuck_client_among_a_thousand_is_carried_with_its_replies(
    tmp_path: Path,
) -> None:
    """1,000 connections holding a lock each, a waiter queued behind one of them, and
    a client that never reads its dumps: the hand-over succeeds with the pause under
    100 ms, every lock and wait is kept, and the stuck client, carried with its
    unsent replies, gets them all from the successor once it reads."""
    control = tmp_path / "control.sock"
    old_log: list[str] = []
    with old_server(control, "--max-connections", "2000", log=old_log) as (old, port):
        crowd = await crowd_holding_a_lock_each(port)
        waiter = await connect(port)
        await waiter.send(b"lock crowd-0 30\n")
        await until_waiting(await connect(port), b"crowd-0")
        stuck = StuckClient(port)
        stuck.take(b"stuck-key")
        await stuck.flood()
        assert stuck.sent > 10, stuck.sent
        new_log: list[str] = []
        new, probe = await take_over_under_probe(control, old, port, new_log)
        try:
            fresh = await connect(port)
            for index in (1, 500, 999):
                assert await ask(fresh, b"i crowd-%d" % index) == b"1 Locked\r\n"
            assert await ask(fresh, b"i stuck-key") == b"1 Locked\r\n"
            # The waiter waits on in its place, and is granted when crowd-0 is freed.
            await crowd[0].send_all(b"r crowd-0\n")
            assert await crowd[0].receive_some(100) == b"1 Released Lock\r\n"
            with trio.fail_after(5):
                assert await waiter.line() == b"200 Acquired\r\n"
            # The stuck client was carried: every reply it asked for comes now.
            assert await stuck.read_every_reply(10) == stuck.sent
        finally:
            stop_server(new)
    print(f"stuck client: {stuck.sent} requests; probe worst {probe.worst * 1000:.1f} ms")
    print("".join(line for line in old_log + new_log if "took over" in line))
    assert probe.worst < 0.1, probe.worst


async def until_the_server_stops_sending(sock: socket.socket) -> int:
    """Until the bytes waiting in ``sock``'s receive queue stop growing for 0.3 s:
    then the server is stuck in a send (the caller makes sure it has more to send).
    Those bytes."""
    queued, since = -1, trio.current_time()
    with trio.fail_after(10):
        while True:
            now = int.from_bytes(fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4), "little")
            if now != queued:
                queued, since = now, trio.current_time()
            elif trio.current_time() - since > 0.3:
                return queued
            await trio.sleep(0.05)


async def test_clients_stuck_in_a_dump_bigger_than_the_limit_are_dropped_by_their_rules(
    tmp_path: Path,
) -> None:
    """Stuck clients owing more than UNSENT_LIMIT (the rest of a 10 MB dump) are not
    carried: they end as their send timeout would end them. The plain one's hold is
    freed; the one with a grace time waits out its grace on the successor, which
    ``conn_id`` takes back; everyone else's locks stay."""
    control = tmp_path / "control.sock"
    with old_server(control) as (old, port):
        holder = await connect(port)
        keys = [b"%05d" % i + b"k" * 995 for i in range(10_000)]
        await holder.send(b"".join(b"g " + key + b"\n" for key in keys))
        for _ in keys:
            assert await holder.line() == b"1 Got Lock\r\n"
        plain, graceful = StuckClient(port), StuckClient(port)
        plain.take(b"plain-key")
        graceful.take(b"graceful-key")
        graceful.sock.sendall(b"set_timeout 30000\nconn_id\n")
        replies = b""
        while replies.count(b"\n") < 2:
            replies += graceful.sock.recv(1000)
        session_id = replies.split(b"\r\n")[1][4:]
        for stuck in (plain, graceful):
            stuck.sock.sendall(b"d\n")
            assert await until_the_server_stops_sending(stuck.sock) < 10_000_000
        new = await trio.to_thread.run_sync(lambda: take_over(control))
        try:
            assert await wait_exit(old, 10) == 0
            fresh = await connect(port)
            assert await ask(fresh, b"i 00000" + b"k" * 995) == b"1 Locked\r\n"
            assert await ask(fresh, b"i plain-key") == b"0 Not Locked\r\n"
            assert await ask(fresh, b"i graceful-key") == b"1 Locked\r\n"
            # Their connections ended: what they read stops short of the dump's end.
            for stuck in (plain, graceful):
                stuck.sent = 1
                assert await stuck.read_every_reply(10) == 0
            assert await ask(fresh, b"conn_id " + session_id) == b"200 conn id set\r\n"
            assert await ask(fresh, b"r graceful-key") == b"1 Released Lock\r\n"
        finally:
            stop_server(new)


async def test_a_tls_client_stuck_in_a_send_ends_and_the_hand_over_goes_on(
    tmp_path: Path, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    """A TLS send cannot say how much of it went out: one still waiting for its client
    STREAM_SEND_GRACE into the pause ends its connection, as its send timeout would,
    and the hand-over goes on. Its session waits out its grace on the successor."""
    control = tmp_path / "control.sock"
    tls = ("--tls-cert", tls_files["cert"], "--tls-key", tls_files["key"])
    with old_server(control, *tls) as (old, port):
        holder = await tls_connect(port, ca)
        for index in range(200):
            assert await ask(holder, b"g key-%d" % index) == b"1 Got Lock\r\n"
        context = ssl.create_default_context()
        ca.configure_trust(context)
        raw_sock = socket.socket()
        raw_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_BUFFER)
        raw_sock.connect(("127.0.0.1", port))
        stuck = context.wrap_socket(raw_sock, server_hostname="127.0.0.1")
        stuck.sendall(b"set_timeout 30000\nlock stuck-key\nconn_id\n")
        replies = b""
        while replies.count(b"\n") < 3:
            replies += stuck.recv(1000)
        session_id = replies.split(b"\r\n")[2][4:]
        stuck.settimeout(0.5)
        with pytest.raises(TimeoutError):  # the server reads no more of it
            while True:
                await trio.to_thread.run_sync(stuck.sendall, PADDED_DUMP_AND_COUNTERS)
        new = await trio.to_thread.run_sync(lambda: take_over(control, *tls))
        try:
            assert await wait_exit(old, 10) == 0
            back = await tls_connect(port, ca)
            assert await ask(back, b"i key-199") == b"0 Not Locked\r\n"  # TLS: freed
            assert await ask(back, b"conn_id " + session_id) == b"200 conn id set\r\n"
            assert await ask(back, b"unlock stuck-key") == b"200 Unlocked\r\n"
        finally:
            stuck.close()
            stop_server(new)


@pytest.mark.cluster
async def test_a_stuck_client_of_a_cluster_node_is_carried_with_its_replies(
    nodes: Nodes, tmp_path: Path
) -> None:
    """The same on a cluster node: the hand-over succeeds, the stuck client's replies
    come from the successor once it reads, and its hold stays, as another node sees."""
    control = tmp_path / "control.sock"
    other = nodes.start()
    with old_server(control, *nodes.flags()) as (old, port):
        holder = await connect(port)
        # Dumps of 50 KB: each takes an etcd read, and a few fill the buffers.
        for index in range(50):
            assert await ask(holder, b"g key-%d" % index + b"k" * 1000) == b"1 Got Lock\r\n"
        stuck = StuckClient(port)
        stuck.take(b"stuck-key")
        await stuck.flood()
        new = await trio.to_thread.run_sync(lambda: take_over(control, *nodes.flags()))
        try:
            assert await wait_exit(old, 10) == 0
            assert await stuck.read_every_reply(10) == stuck.sent
            watcher = await other.connect()
            assert await ask(watcher, b"g stuck-key") == b"0 Cannot Get Lock\r\n"
            assert await ask(holder, b"i key-49" + b"k" * 1000) == b"1 Locked\r\n"
        finally:
            stop_server(new)


async def websocket_zombie(http_port: int, key: str) -> RawWebSocket:
    """A WebSocket client (4 KiB receive buffer) that takes ``key``, then sends ``q``
    messages without reading, until the server has read none of them for 0.5 s: it
    is then stuck sending to it. The client stays connected."""
    zombie = await RawWebSocket.connect("127.0.0.1", http_port, receive_buffer=TINY_BUFFER)
    assert await zombie.ask(f"g {key}") == "1 Got Lock\r\n"
    flood = masked_frame(b"q") * 1000
    with trio.fail_after(30):
        while True:
            with trio.move_on_after(0.5) as blocked:
                await zombie.sock.send(flood)
            if blocked.cancelled_caught:
                return zombie


async def test_a_websocket_zombie_ends_at_the_pause_and_the_hand_over_goes_on(
    tmp_path: Path,
) -> None:
    """A WebSocket does not move (it closes at a hand-over, its session kept for its
    grace): one stuck sending to a client that does not read ends within
    STREAM_SEND_GRACE of the pause, as its send timeout would end it, instead of
    failing the hand-over (the default --send-timeout is 30 s)."""
    control = tmp_path / "control.sock"
    http_port = free_port()
    with old_server(control, "--metrics-port", str(http_port)) as (old, port):
        holder = await connect(port)
        assert await ask(holder, b"g kept") == b"1 Got Lock\r\n"
        zombie = await websocket_zombie(http_port, "zombie-key")
        new = await trio.to_thread.run_sync(lambda: take_over(control))
        try:
            assert await wait_exit(old, 10) == 0
            assert await ask(holder, b"i kept") == b"1 Locked\r\n"
            assert await ask(holder, b"i zombie-key") == b"0 Not Locked\r\n"
        finally:
            zombie.close()
            stop_server(new)


@pytest.mark.serial
async def test_one_websocket_zombie_among_a_thousand_keeps_the_pause_under_100_ms(
    tmp_path: Path,
) -> None:
    control = tmp_path / "control.sock"
    http_port = free_port()
    flags = ("--max-connections", "2000", "--metrics-port", str(http_port))
    with old_server(control, *flags) as (old, port):
        crowd = await crowd_holding_a_lock_each(port)
        zombie = await websocket_zombie(http_port, "zombie-key")
        new_log: list[str] = []
        new, probe = await take_over_under_probe(control, old, port, new_log)
        try:
            await crowd[999].send_all(b"i crowd-999\n")  # the same connection, carried
            assert await crowd[999].receive_some(100) == b"1 Locked\r\n"
        finally:
            zombie.close()
            stop_server(new)
    print(f"probe worst {probe.worst * 1000:.1f} ms")
    print("".join(line for line in new_log if "took over" in line))
    assert probe.worst < 0.1, probe.worst
