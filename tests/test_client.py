"""The trio client against a real server over TCP.

Most tests run the server in-process with trio's MockClock, so waits, leases and
timeouts are exact and instant; the two that the issue wants against a real process
in real time (a killed connection, a 0.5 s lease kept alive for 3 s) spawn one.
"""

from __future__ import annotations

import re
import ssl
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from elockd.client import (
    AuthError,
    Client,
    ConnectFailed,
    ConnectionLost,
    Hold,
    KeyBusy,
    LockLost,
    ProtocolError,
    RateLimiter,
    ReplyTimeout,
    RequestError,
    Unavailable,
)
from elockd.client.core import (
    ClientCore,
    Operation,
    parse_checked,
    parse_lines,
    parse_ok,
    printable,
    terse_answer,
)
from elockd.daemon.server import make_service, serve
from elockd.protocol.config import Config
from tests.support.foreign_service import foreign_service
from tests.support.line_client import RunningServer
from tests.support.server_process import SpawnServer


async def test_lock_token_contention_and_release(server: RunningServer) -> None:
    async with Client(port=server.port) as a, Client(port=server.port) as b:
        async with a.lock("job") as hold:
            assert hold.held and hold.key == b"job" and not hold.shared
            assert hold.token is not None and hold.token > 0
            info = await b.info("job")
            assert info.locked and info.token == hold.token and info.ttl is None
            with pytest.raises(Unavailable):
                await b.acquire("job")
            first_token = hold.token
        assert hold.released and not hold.lost
        async with b.lock("job") as second:
            assert second.token is not None and second.token > first_token
        assert not (await a.info("job")).locked


async def test_wait_is_granted_when_the_holder_releases(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with Client(port=server.port) as a, Client(port=server.port) as b:
        hold = await a.acquire("k")
        granted_at: list[float] = []

        async def waiter() -> None:
            async with b.lock("k", wait=10):
                granted_at.append(trio.current_time())

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(2)
            assert (await a.info("k")).waiting == 1
            await a.release(hold)
        assert granted_at == [pytest.approx(start + 2)]
        with pytest.raises(Unavailable):  # and a wait that runs out raises
            async with a.lock("k"), b.lock("k", wait=3):
                pass
        assert trio.current_time() == pytest.approx(start + 5)


async def test_shared_limit(server: RunningServer, mock_clock: trio.testing.MockClock) -> None:
    async with (
        Client(port=server.port) as a,
        Client(port=server.port) as b,
        Client(port=server.port) as c,
    ):
        async with a.shared("api", limit=2) as first, b.shared("api", limit=2) as second:
            assert (first.holders, second.holders) == (1, 2)
            assert first.token is None
            with pytest.raises(Unavailable) as refused:
                await c.acquire_shared("api", limit=2, wait=1)
            assert refused.value.holders == 2
            assert (await c.info("api")).shared == 2
        async with c.shared("api", limit=2) as third:
            assert third.holders == 1


async def test_mlock_all_or_nothing(server: RunningServer) -> None:
    async with Client(port=server.port) as a, Client(port=server.port) as b:
        async with a.mlock(["x", "y", "z"]) as hold:
            assert hold.keys == (b"x", b"y", b"z")
            assert set(hold.tokens) == {b"x", b"y", b"z"}
            assert len(set(hold.tokens.values())) == 3
            with pytest.raises(Unavailable) as refused:
                await b.acquire_many(["w", "y"])
            assert refused.value.keys == (b"y",)
            assert not (await b.info("w")).locked  # nothing taken
        async with b.mlock(["w", "y"]):
            pass


async def test_info_stats_ping_session_id_and_raw_commands(server: RunningServer) -> None:
    async with Client(port=server.port) as client:
        assert 0 < await client.ping() < 5  # a loopback round trip, on trio's real clock
        session = await client.session_id()
        assert re.fullmatch("[0-9a-f]{32}", session), session  # 128 random bits, in hex
        stats = await client.stats()
        assert stats["clients"] == 1 and stats["command_ping"] == 1
        assert await client.command("g raw key") == [b"1 Got Lock"]
        assert await client.command("d") == [b"raw key: 127.0.0.1:%d" % client_port(client)]
        # The server finds the verb after blanks and before a tab as well: so must the
        # client, or it reads one line of a multi-line reply and falls out of step.
        assert await client.command(" d") == await client.command("d")
        assert await client.command("d\traw key") == [
            b"raw key: 127.0.0.1:%d" % client_port(client)
        ]
        assert 0 < await client.ping() < 5  # still in step after the multi-line replies
        info = await client.info("nobody")
        assert (info.owner, info.shared, info.waiting, info.token) == (None, 0, 0, None)


def client_port(client: Client) -> int:
    stream = client._stream
    assert isinstance(stream, trio.SocketStream)
    return int(stream.socket.getsockname()[1])


async def test_requests_are_pipelined_on_one_connection(server: RunningServer) -> None:
    async with Client(port=server.port) as client:
        tokens: list[int] = []

        async def worker(index: int) -> None:
            for round_ in range(5):
                async with client.lock(f"key-{index}-{round_}") as hold:
                    assert hold.token is not None
                    tokens.append(hold.token)
                await client.ping()

        async with trio.open_nursery() as nursery:
            for index in range(50):
                nursery.start_soon(worker, index)
        assert len(set(tokens)) == 250
        stats = await client.stats()
        assert stats["clients"] == 1 and stats["command_lock"] == 250 and stats["locks"] == 0


async def test_a_key_is_held_once_per_client(server: RunningServer) -> None:
    async with Client(port=server.port) as client:
        async with client.lock("once"):
            with pytest.raises(KeyBusy):
                await client.acquire("once")
            with pytest.raises(KeyBusy):
                await client.acquire_shared("once")
            with pytest.raises(KeyBusy):
                await client.acquire_many(["other", "once"])
        with pytest.raises(ValueError):
            await client.acquire("two words")


async def test_lease_renews_itself(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with Client(port=server.port) as client, Client(port=server.port) as other:
        async with client.lock("lease", ttl=3) as hold:
            for _ in range(10):
                await trio.sleep(3)
                info = await other.info("lease")
                assert info.token == hold.token and info.ttl is not None and info.ttl > 0
            assert hold.renewals >= 25
        assert server.service.snapshot()["expired"] == 0


async def test_refused_renewal_reports_lock_lost(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    lost: list[Hold] = []
    async with Client(port=server.port) as client:
        with pytest.raises(LockLost, match="renewal refused"):
            async with client.lock("lease", ttl=3, on_lost=lost.append) as hold:
                # Free it behind the client's back, as an expiry would.
                engine = server.service.backend
                engine.release(engine.exclusive[b"lease"].session, b"lease", trio.current_time())
                await trio.sleep(2)  # the renewal at 1 s gets 403 Not Locked
                assert hold.lost and lost == [hold]
        # An exception from the block wins over LockLost; the flag still tells.
        with pytest.raises(ZeroDivisionError):
            async with client.lock("other", ttl=3) as second:
                engine.release(engine.exclusive[b"other"].session, b"other", trio.current_time())
                await trio.sleep(2)
                _ = 1 / 0
        assert second.lost
        assert await client.command("ping") == [b"200 PONG"]  # the connection is fine


async def test_lock_lost_when_the_connection_is_killed(spawn_server: SpawnServer) -> None:
    process, port = spawn_server()
    lost = trio.Event()
    async with Client(port=port) as client:
        with pytest.raises(LockLost, match="connection lost"):
            async with client.lock("k", on_lost=lambda hold: lost.set()) as hold:
                killed_at = trio.current_time()
                process.kill()
                with trio.fail_after(5):
                    await lost.wait()
                assert hold.lost and not hold.held
                assert hold.lost_at is not None
                assert killed_at <= hold.lost_at <= trio.current_time()


async def test_auto_renew_keeps_a_half_second_lease_alive_for_three_seconds(
    spawn_server: SpawnServer,
) -> None:
    _, port = spawn_server()
    async with Client(port=port) as client, Client(port=port) as observer:
        async with client.lock("short-lease", ttl=0.5) as hold:
            for _ in range(12):
                await trio.sleep(0.25)
                info = await observer.info("short-lease")
                assert info.token == hold.token, "the lease ran out"
            assert hold.renewals >= 12
        stats = await observer.stats()
        assert stats["expired"] == 0 and stats["command_renew"] >= 12


async def test_cancelled_wait_never_leaves_a_hold(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    async with (
        Client(port=server.port) as holder,
        Client(port=server.port) as waiter,
        Client(port=server.port) as observer,
    ):
        hold = await holder.acquire("k")
        with trio.move_on_after(1):
            await waiter.acquire("k", wait=10)
        assert waiter.holds == []
        # The server still has the wait; the release grants it to the waiter's
        # session, and the unlock queued on cancellation must free it right after.
        await holder.release(hold)
        await waiter.ping()
        assert not (await observer.info("k")).locked
        async with waiter.lock("k", wait=1):  # the client and the key are usable
            pass


@pytest.mark.parametrize("kind", ["lock", "shared", "mlock"])
async def test_cancelling_an_acquire_at_any_checkpoint_never_leaves_a_hold(
    server: RunningServer, kind: str
) -> None:
    async with Client(port=server.port) as client, Client(port=server.port) as observer:
        got: list[Hold] = []
        for checkpoints in range(8):
            got.clear()

            async def attempt() -> None:
                if kind == "lock":
                    got.append(await client.acquire("c"))
                elif kind == "shared":
                    got.append(await client.acquire_shared("c", limit=1))
                else:
                    got.append(await client.acquire_many(["c", "d"]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(attempt)
                for _ in range(checkpoints):
                    await trio.lowlevel.checkpoint()
                nursery.cancel_scope.cancel()
            for hold in got:
                await client.release(hold)
            await client.ping()
            info = await observer.info("c")
            assert (info.locked, info.shared) == (False, 0), f"left behind at {checkpoints}"
            assert client.holds == []


async def test_cancelling_a_release_still_releases(server: RunningServer) -> None:
    async with Client(port=server.port) as client, Client(port=server.port) as observer:
        for checkpoints in range(4):
            hold = await client.acquire("r")
            # A task started in a cancelled scope still runs up to its first
            # checkpoint: at 0 the release is cancelled before it awaits anything.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.release, hold)
                for _ in range(checkpoints):
                    await trio.lowlevel.checkpoint()
                nursery.cancel_scope.cancel()
            await client.ping()
            assert not (await observer.info("r")).locked, f"still held at {checkpoints}"
        with trio.move_on_after(0.5):  # cancelled inside the block
            async with client.lock("body"):
                await trio.sleep_forever()
        await client.ping()
        assert not (await observer.info("body")).locked


async def test_cancelling_the_scope_around_the_client_still_frees_a_lease(
    server: RunningServer,
) -> None:
    """The client's tasks run inside the caller's cancel scope, so they are gone when
    that scope is cancelled; closing must still send the queued ``unlock`` (a lease
    survives the disconnect) and must not wait for replies nobody reads."""
    with trio.fail_after(5):
        with trio.move_on_after(0.2):
            async with Client(port=server.port) as client, client.lock("k", ttl=60):
                await trio.sleep_forever()
        with trio.move_on_after(0.2):
            async with (
                RateLimiter("rl", 2, port=server.port, ttl=60, wait=1) as limiter,
                limiter.slot(),
            ):
                await trio.sleep_forever()
    observer = await server.connect()
    assert (await observer.request(b"info k")).startswith(b"200 key=k exclusive=- ")
    assert b" shared=0 " in await observer.request(b"info rl")


async def test_cancelling_a_rate_limiter_frees_every_slot_and_wait(
    server: RunningServer,
) -> None:
    """Three leased slots and two tasks still waiting for one: after the cancel no
    slot, lease or waiting request is left behind on the server."""
    blocker = await server.connect()
    assert await blocker.request(b"lock_shared full limit=1") == b"200 1"
    with trio.fail_after(5), trio.move_on_after(0.3):
        async with RateLimiter("rl", 3, port=server.port, ttl=60, wait=30) as limiter:

            async def hold(key_limiter: RateLimiter) -> None:
                async with key_limiter.slot():
                    await trio.sleep_forever()

            async with trio.open_nursery() as workers:
                for _ in range(3):
                    workers.start_soon(hold, limiter)
                async with RateLimiter("full", 1, port=server.port, wait=30) as waiting:
                    for _ in range(2):
                        workers.start_soon(hold, waiting)
                    await trio.sleep_forever()
    stats = await blocker.stats()
    assert (stats["leases"], stats["waiting"]) == (0, 0)
    assert b" shared=0 " in await blocker.request(b"info rl")
    assert b" shared=1 " in await blocker.request(b"info full")  # the blocker's own
    assert stats["connections"] == 1  # every limiter connection is closed


async def test_silent_server_raises_reply_timeout_instead_of_hanging(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await nursery.start(trio.serve_tcp, silent, 0)
    port = listeners[0].socket.getsockname()[1]
    async with Client(port=port, reply_timeout=3) as client:
        start = trio.current_time()
        with pytest.raises(ReplyTimeout):
            await client.ping()
        assert trio.current_time() - start == pytest.approx(3)
        with pytest.raises(ReplyTimeout):  # the connection stays failed
            await client.ping()
    tls = ssl.create_default_context()
    with pytest.raises(ConnectFailed):  # a TLS handshake nobody answers
        async with Client(port=port, ssl_context=tls, connect_timeout=2):
            pass
    assert trio.current_time() - start == pytest.approx(5)


async def test_connection_refused_is_a_clear_error() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ConnectFailed, match="cannot connect"):
            async with Client(port=port):
                pass


async def test_resume_takes_over_a_dropped_session(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    first = Client(port=server.port)
    async with first:
        hold = await first.acquire("resumable", ttl=30)
        session = await first.session_id()
        await first.aclose(release=False)  # leases stay for a resume
    assert hold.lost
    async with Client(port=server.port) as second, Client(port=server.port) as third:
        assert (await third.info("resumable")).token == hold.token
        assert await second.resume(session)
        assert await second.session_id() == session
        async with second.lock("resumable", ttl=30) as adopted:
            assert adopted.token == hold.token
        assert not (await third.info("resumable")).locked
        assert not await third.resume("0" * 32)


async def test_rate_limiter_caps_concurrency(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    active = peak = 0

    async def worker(limiter: RateLimiter) -> None:
        nonlocal active, peak
        async with limiter.slot():
            active += 1
            peak = max(peak, active)
            await trio.sleep(1)
            active -= 1

    start = trio.current_time()
    async with (
        RateLimiter("partner-api", 2, port=server.port, wait=100) as limiter,
        trio.open_nursery() as nursery,
    ):
        for _ in range(6):
            nursery.start_soon(worker, limiter)
    assert peak == 2
    assert trio.current_time() - start == pytest.approx(3)


# ---------------------------------------------------------------- TLS and auth


async def test_mutual_tls_and_auth_token(
    nursery: trio.Nursery, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    files = tls_files
    config = Config(
        port=0,
        metrics_port=0,
        tls_cert=files["cert"],
        tls_key=files["key"],
        tls_client_ca=files["ca"],
        auth_token_file=files["token"],
    )
    config = replace(config, host="127.0.0.1")
    addresses = await nursery.start(serve, config, make_service(config))
    port = addresses[0][1]
    context = ssl.create_default_context()
    ca.configure_trust(context)
    ca.issue_cert("worker@example.test").configure_cert(context)
    client = Client(port=port, ssl_context=context, auth_token="letmein")
    async with client, client.lock("secure") as hold:
        assert hold.token is not None
    with pytest.raises(AuthError):
        async with Client(port=port, ssl_context=context, auth_token="wrong"):
            pass
    async with Client(port=port, ssl_context=context) as anonymous:
        with pytest.raises(AuthError):
            await anonymous.acquire("secure")


# ---------------------------------------------------------------- the sans-IO core


def abandoned_after_a_long_wait(kind: str, core: ClientCore) -> Operation[Hold]:
    """Start a waiting acquire at t=0 and answer all its requests at t=25."""
    if kind == "lock":
        op = core.lock("k", 0.0, 30, None, None)
        replies = b"200 Acquired\r\n200 7\r\n"
    elif kind == "shared":
        op = core.shared("k", 0.0, None, 30, None, None)
        replies = b"200 1\r\n"
    else:
        op = core.mlock(["k", "j"], 0.0, 30, None, None)
        replies = b"200 Acquired\r\n200 7\r\n200 8\r\n"
    core.data_to_send()
    core.receive(replies, 25.0)
    return op


@pytest.mark.parametrize("kind", ["lock", "shared", "mlock"])
def test_abandoning_after_a_long_granted_wait_keeps_the_connection(kind: str) -> None:
    """The undo is due a reply timeout after *now*, not after the acquire was made:
    a cancel that comes 25 s into a granted wait must not time out the connection."""
    core = ClientCore(threading.Event, reply_timeout=10)
    op = abandoned_after_a_long_wait(kind, core)
    op.abandon(25.0)
    assert core.data_to_send().startswith(b"unlock")
    assert [request.deadline for request in core.pending] == [35.0] * len(core.pending)
    core.tick(25.1)
    assert core.error is None


@pytest.mark.parametrize(
    "line", [b" d", b"d\tk", b"\td", b"d \r", b"  dump\tshared", b"stats\t", b"\t q "]
)
def test_multiline_verbs_are_found_as_the_server_finds_them(line: bytes) -> None:
    core = ClientCore(threading.Event)
    op = core.simple(line, 0.0, parse_lines)
    ping = core.simple(b"ping", 0.0, parse_ok(b"200 PONG"))
    core.receive(b"k: 127.0.0.1:1\r\nj: 127.0.0.1:2\r\nEND\r\n200 PONG\r\n", 1.0)
    assert core.error is None
    assert op.finish() == [b"k: 127.0.0.1:1", b"j: 127.0.0.1:2"]
    ping.finish()


async def test_a_server_that_wants_a_token_is_no_no(nursery: trio.Nursery, tmp_path: Path) -> None:
    """``0 Auth Required`` answers a probe with a 0, but it means "cannot tell":
    ``check=True`` raises AuthError instead of handing it back as a "no"."""
    token = tmp_path / "token"
    token.write_text("letmein\n")
    config = Config(host="127.0.0.1", port=0, metrics_port=0, auth_token_file=str(token))
    addresses = await nursery.start(serve, config, make_service(config))
    async with Client(port=addresses[0][1]) as anonymous:
        assert await anonymous.command("i k") == [b"0 Auth Required"]  # raw: as it came
        for line in ("i k", "q", "dump", "stats", "si k"):
            with pytest.raises(AuthError, match="Auth Required"):
                await anonymous.command(line, check=True)
    async with Client(port=addresses[0][1], auth_token="letmein") as client:
        assert await client.command("i k", check=True) == [b"0 Not Locked"]
        counters = await client.command("q", check=True)  # sorted: admitted, ... command_*
        assert any(line.startswith(b"command_") for line in counters), counters


async def test_a_foreign_service_is_a_protocol_error() -> None:
    """An SSH banner is no reply: the connection fails with ProtocolError (a
    ConnectionLost) naming what came, at once, not after the reply timeout."""
    with foreign_service() as port:
        async with Client(port=port, reply_timeout=600) as client:
            with trio.fail_after(5), pytest.raises(ProtocolError, match="SSH-2.0-OpenSSH") as lost:
                await client.command("i k")
        assert isinstance(lost.value, ConnectionLost)
        assert lost.value.data.startswith(b"SSH-2.0-")
        with trio.fail_after(5), pytest.raises(ProtocolError):
            async with Client(port=port, auth_token="letmein", reply_timeout=600):
                pass


# ---------------------------------------------------------------- replies, read strictly


@pytest.mark.parametrize(
    "verb, reply, answer",
    [
        (b"i", b"1 Locked", 1),
        (b"i", b"0 Not Locked", 0),
        (b"i", b"1 Lock Is Locked: a b", 1),  # --replies glockd
        (b"i", b"0 Lock Not Locked: a b", 0),
        (b"g", b"0 Cannot Get Lock", 0),
        (b"g", b"0 Lock Get Failure: k", 0),
        (b"sg", b"3 Got Lock", 3),
        (b"sg", b"2 Shared Lock Get Success: k", 2),
        (b"si", b"4 Locked", 4),
        (b"si", b"0 Shared Lock Not Locked: k", 0),
        (b"r", b"1 Released Lock", 1),
        (b"sr", b"0 Shared Lock Release Failure: k", 0),
        (b"i", b"0 Auth Required", None),
        (b"i", b"0 Backend Unavailable", None),
        (b"i", b"0 Too Many Connections", None),
        (b"i", b"0 Locked", None),  # a yes text with a 0
        (b"i", b"1 Not Locked", None),  # a no text with a 1
        (b"i", b"0 Cannot Get Lock", None),  # another verb's answer
        (b"sg", b"0 Too Many Holds", None),  # sg has no "no"
        (b"sg", b"0 Got Lock", None),
        (b"i", b"SSH-2.0-OpenSSH_9.2", None),
        (b"i", b"x Locked", None),
    ],
)
def test_terse_answers_are_read_strictly(verb: bytes, reply: bytes, answer: int | None) -> None:
    assert terse_answer(verb, reply) == answer


def answered(line: bytes, data: bytes) -> Operation[list[bytes]]:
    core = ClientCore(threading.Event)
    op = core.simple(line, 0.0, parse_checked)
    core.receive(data, 1.0)
    assert core.error is None
    return op


def test_checked_replies() -> None:
    assert answered(b"i k", b"0 Not Locked\r\n").finish() == [b"0 Not Locked"]
    assert answered(b"q", b"locks: 1\r\nEND\r\n").finish() == [b"locks: 1"]
    with pytest.raises(AuthError):
        answered(b"q", b"0 Auth Required\r\n").finish()
    with pytest.raises(AuthError):
        answered(b"lock k", b"403 Auth Required\r\n").finish()
    with pytest.raises(RequestError, match="i: 0 Backend Unavailable"):
        answered(b"i k", b"0 Backend Unavailable\r\n").finish()
    with pytest.raises(RequestError, match="Backend Unavailable"):
        answered(b"d", b"0 Backend Unavailable\r\n").finish()
    # A listing a cluster node's deadline gate cut midway: rows, the refusal, END.
    with pytest.raises(RequestError, match="ls: 409 Backend Unavailable"):
        answered(
            b"ls",
            b"k exclusive=o shared=0 waiting=0 age=1.000 token=5 ttl=-\r\n"
            b"409 Backend Unavailable\r\nEND\r\n",
        ).finish()
    with pytest.raises(RequestError, match="d: 0 Backend Unavailable"):
        answered(b"d", b"k: o\r\n0 Backend Unavailable\r\nEND\r\n").finish()
    # A whole dump whose last row's key begins like a refusal is a dump.
    whole = answered(b"d", b"a: me\r\n400 x: me\r\nEND\r\n").finish()
    assert whole == [b"a: me", b"400 x: me"]
    # A word verb's refusal is an answer (409: no); only auth refusals raise.
    assert answered(b"lock k", b"409 Unavailable\r\n").finish() == [b"409 Unavailable"]


@pytest.mark.parametrize(
    "line, data",
    [
        (b"i k", b"SSH-2.0-OpenSSH_9.2\r\n"),
        (b"i k", b"HTTP/1.1 400 Bad Request\r\n"),
        (b"i k", b"1 Locked\n"),  # a bare \n: elockd always sends \r\n
        (b"q", b"SSH-2.0-OpenSSH_9.2\r\n"),
        (b"stats", b"<html>\r\n"),
        (b"ping", b"200 PONG\r\n\r\n"),  # more than was asked for
    ],
)
def test_bytes_that_are_no_reply_fail_the_connection(line: bytes, data: bytes) -> None:
    core = ClientCore(threading.Event)
    op = core.simple(line, 0.0, parse_lines)
    core.receive(data, 1.0)
    assert isinstance(core.error, ProtocolError), core.error
    if not op.requests[0].lines:
        with pytest.raises(ProtocolError, match="not an elockd reply"):
            op.finish()


def test_a_refusal_sent_before_any_request_is_no_foreign_greeting() -> None:
    core = ClientCore(threading.Event)
    core.receive(b"0 Too Many Connections\r\n", 0.0)
    assert isinstance(core.error, ConnectionLost)
    assert not isinstance(core.error, ProtocolError)
    assert "'0 Too Many Connections' before any request" in str(core.error)


def test_keys_and_replies_in_messages_are_text() -> None:
    assert printable(b"nightly-backup") == "nightly-backup"
    assert printable(b"caf\xc3\xa9 \xff\x00\n") == "caf\u00e9 \\xff\\x00\\n"
    core = ClientCore(threading.Event)
    op = core.lock("jobk", 0.0, None, None, None)
    core.receive(b"409 Unavailable\r\n403 Not Locked\r\n", 1.0)
    with pytest.raises(Unavailable) as refused:
        op.finish()
    assert str(refused.value) == "lock 'jobk' unavailable"
    with pytest.raises(ValueError, match="'a b'"):
        core.lock("a b", 0.0, None, None, None)


@pytest.mark.parametrize(
    "start, replies",
    [
        (lambda core: core.lock("k", 0.0, None, None, None), b"409 Backend Unavailable\r\n" * 2),
        (lambda core: core.shared("k", 0.0, 2, None, None, None), b"409 Backend Unavailable\r\n"),
        (
            lambda core: core.mlock(["k", "j"], 0.0, None, None, None),
            b"409 Backend Unavailable\r\n" * 3,
        ),
    ],
)
def test_backend_unavailable_is_no_busy_lock(
    start: Callable[[ClientCore], Operation[Hold]], replies: bytes
) -> None:
    """A cluster node without etcd quorum answers ``409 Backend Unavailable``: that
    says nothing about the key, so it must not read as "held by others"
    (``Unavailable``), which a cron guard takes for "skip this run"."""
    core = ClientCore(threading.Event)
    op = start(core)
    core.receive(replies, 1.0)
    with pytest.raises(RequestError, match="409 Backend Unavailable") as raised:
        op.finish()
    assert not isinstance(raised.value, Unavailable)
    # A real "not granted" still is one.
    core = ClientCore(threading.Event)
    op = core.shared("k", 0.0, 2, None, None, None)
    core.receive(b"409 2\r\n", 1.0)
    with pytest.raises(Unavailable):
        op.finish()


def test_the_first_request_starts_with_a_blank() -> None:
    """elockd drops leading blanks; an HTTP server or a TLS port refuses a request
    line that starts with one at once, so a client at the wrong door hears so now."""
    core = ClientCore(threading.Event)
    assert core.data_to_send() == b""  # the blank never goes alone
    core.simple(b"i k", 0.0, parse_lines)
    core.simple(b"i j", 0.0, parse_lines)
    assert core.data_to_send() == b" i k\ni j\n"
    core.simple(b"i l", 0.0, parse_lines)
    assert core.data_to_send() == b"i l\n"


@pytest.mark.parametrize(
    "line, data",
    [
        (b"i k", b"\x15\x03\x01\x00\x02\x02\x46"),  # a TLS alert, no line end ever
        (b"q", b"\x15\x03\x03\x00\x02"),  # also where a block is due
        (b"i k", b"HTTP/1.1 400 "),  # a one-line reply starts with a digit
    ],
)
def test_bytes_that_cannot_start_a_reply_fail_before_a_line_end(line: bytes, data: bytes) -> None:
    core = ClientCore(threading.Event)
    core.simple(line, 0.0, parse_lines)
    core.receive(data, 1.0)
    assert isinstance(core.error, ProtocolError)
    assert core.error.data == data


def test_a_block_may_start_with_any_byte_until_its_line_ends() -> None:
    core = ClientCore(threading.Event)
    dump = core.simple(b"d", 0.0, parse_lines)
    core.receive(b"HTTP-ish-key: 127.0.0.1:5", 1.0)  # a key is any bytes
    assert core.error is None
    core.receive(b"\r\nEND\r\n", 1.0)
    assert dump.finish() == [b"HTTP-ish-key: 127.0.0.1:5"]
