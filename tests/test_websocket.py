"""WebSocket sessions on the HTTP port: one message per request and per reply, a
session like a TCP one (limits, auth, counters, locks freed on close)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection, open_websocket_url

from elockd.client import BlockingClient, Client
from elockd.daemon.server import make_service, serve
from elockd.protocol.config import Config
from tests.support.hostile_tools import free_port
from tests.support.line_client import LineClient
from tests.support.polling import eventually, until_waiting


@dataclass
class Running:
    port: int
    http_port: int

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.http_port}/"

    async def tcp(self) -> LineClient:
        return LineClient(await trio.open_tcp_stream("127.0.0.1", self.port))


async def start(nursery: trio.Nursery, **settings: object) -> Running:
    http_port = free_port()
    config = replace(Config(port=0, metrics_port=http_port), **settings)  # type: ignore[arg-type]
    addresses = await nursery.start(serve, config, make_service(config))
    return Running(int(addresses[0][1]), http_port)


@asynccontextmanager
async def websocket(url: str) -> AsyncIterator[WebSocketConnection]:
    async with open_websocket_url(url) as connection:
        yield connection


async def ask(connection: WebSocketConnection, request: str | bytes) -> str | bytes:
    await connection.send_message(request)
    return await connection.get_message()


async def test_a_websocket_client_excludes_tcp_clients_and_frees_on_close(
    nursery: trio.Nursery,
) -> None:
    """The issue's case: with --replies glockd, ``g K`` over WebSocket gets glockd's
    reply; a TCP client cannot take K meanwhile; closing the WebSocket frees K."""
    server = await start(nursery, replies="glockd")
    tcp = await server.tcp()
    async with websocket(server.url) as ws:
        assert await ask(ws, "g K") == "1 Lock Get Success: K\r\n"
        assert await tcp.request(b"g K") == b"0 Lock Get Failure: K"
        assert await ask(ws, b"i K") == b"1 Lock Is Locked: K\r\n"  # binary in, binary out
    with trio.fail_after(5):
        while await tcp.request(b"g K") != b"1 Lock Get Success: K":
            await trio.sleep(0.01)
    stats = await tcp.request(b"stats")
    assert stats == b"200 STATS"  # the word family is unchanged in glockd's mode


async def test_replies_are_whole_messages_of_the_request_type(nursery: trio.Nursery) -> None:
    server = await start(nursery)
    async with websocket(server.url) as ws:
        for key in ("a", "b", "c"):
            assert await ask(ws, f"g {key}") == "1 Got Lock\r\n"
        dump = await ask(ws, "d")  # a multi-line reply: one message, END included
        assert isinstance(dump, str) and dump.endswith("END\r\n") and dump.count("\r\n") == 4
        assert await ask(ws, b"lock k") == b"200 Acquired\r\n"
        assert await ask(ws, "nope") == "0 Invalid Command: nope\r\n"
        stats = await ask(ws, "q")
        assert isinstance(stats, str) and "connections: 1\r\n" in stats


async def test_auth_is_required_first(nursery: trio.Nursery, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    server = await start(nursery, auth_token_file=str(token), auth_failure_delay=0.01)
    async with websocket(server.url) as ws:
        assert await ask(ws, "g K") == "0 Auth Required\r\n"
        assert await ask(ws, "lock K") == "403 Auth Required\r\n"
        assert await ask(ws, "auth s3cret") == "200 OK\r\n"
        assert await ask(ws, "g K") == "1 Got Lock\r\n"
    async with websocket(server.url) as ws:
        assert await ask(ws, "auth guess") == "403 Bad Token\r\n"
        with pytest.raises(ConnectionClosed):
            await ws.get_message()


async def test_websocket_sessions_count_against_max_connections(nursery: trio.Nursery) -> None:
    server = await start(nursery, max_connections=1)
    async with websocket(server.url) as ws:
        assert await ask(ws, "ping") == "200 PONG\r\n"
        tcp = await server.tcp()
        assert await tcp.line() == b"0 Too Many Connections\r\n"
    with trio.fail_after(5):  # the WebSocket's slot comes free when it closes
        while True:
            tcp = await server.tcp()
            if await tcp.request(b"ping") == b"200 PONG":
                break
            await trio.sleep(0.01)
    async with websocket(server.url) as ws:
        assert await ws.get_message() == "0 Too Many Connections\r\n"
        with pytest.raises(ConnectionClosed):
            await ws.get_message()


async def test_a_message_over_max_line_is_refused_and_the_session_goes_on(
    nursery: trio.Nursery,
) -> None:
    server = await start(nursery)
    async with websocket(server.url) as ws:
        assert await ask(ws, "g " + "k" * 1_000_000) == "0 Line Too Long\r\n"
        assert await ask(ws, "g k") == "1 Got Lock\r\n"
        assert "invalid_commands: 1\r\n" in str(await ask(ws, "q"))


async def test_an_abrupt_close_frees_the_locks(nursery: trio.Nursery) -> None:
    """The client's TCP connection goes away without a WebSocket close."""
    server = await start(nursery)
    tcp = await server.tcp()
    raw = trio.socket.socket()
    await raw.connect(("127.0.0.1", server.http_port))
    await raw.send(
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    assert b" 101 " in (await raw.recv(4096)).split(b"\r\n")[0]
    # One masked text frame "g K" (RFC 6455 5.3), as a browser would send it.
    payload, mask = b"g K", b"\x01\x02\x03\x04"
    masked = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
    await raw.send(b"\x81" + bytes([0x80 | len(payload)]) + mask + masked)
    assert (await raw.recv(4096))[2:] == b"1 Got Lock\r\n"
    assert await tcp.request(b"i K") == b"1 Locked"
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    raw.close()  # a reset, no close frame
    with trio.fail_after(5):
        while await tcp.request(b"i K") != b"0 Not Locked":
            await trio.sleep(0.01)
    assert (await tcp.stats())["orphans"] == 1


async def test_the_idle_timeout_applies_to_websocket_sessions(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """--idle-timeout, not the HTTP port's: a session outlives --metrics-idle-timeout."""
    server = await start(nursery, idle_timeout=30.0, metrics_idle_timeout=5.0)
    async with websocket(server.url) as ws:
        assert await ask(ws, "g K") == "1 Got Lock\r\n"
        await trio.sleep(20)
        assert await ask(ws, "i K") == "1 Locked\r\n"  # 20 s > the HTTP idle timeout
        await trio.sleep(31)
        with pytest.raises(ConnectionClosed):
            await ws.get_message()


async def upgrade_status(port: int, *headers: bytes, host: bytes = b"127.0.0.1") -> bytes:
    """The status line of a raw upgrade request to ``port`` with ``headers`` added,
    sent as a browser that reached the port by the name ``host`` would."""
    raw = trio.socket.socket()
    await raw.connect(("127.0.0.1", port))
    await raw.send(
        b"GET / HTTP/1.1\r\nHost: %s:%d\r\nUpgrade: websocket\r\n" % (host, port)
        + b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        + b"Sec-WebSocket-Version: 13\r\n"
        + b"".join(header + b"\r\n" for header in headers)
        + b"\r\n"
    )
    status = (await raw.recv(4096)).split(b"\r\n")[0]
    raw.close()
    return status


async def test_a_page_of_another_site_cannot_open_a_lock_session(nursery: trio.Nursery) -> None:
    """Cross-site WebSocket hijacking: a browser says which page opened the socket."""
    server = await start(nursery)
    port = server.http_port
    assert b" 403 " in await upgrade_status(port, b"Origin: https://evil.example")
    assert b" 403 " in await upgrade_status(port, b"Origin: null")
    assert b" 403 " in await upgrade_status(port, b"Origin: http://127.0.0.1:%d" % (port + 1))
    assert b" 101 " in await upgrade_status(port, b"Origin: http://127.0.0.1:%d" % port)
    assert b" 101 " in await upgrade_status(port)  # not a browser: no Origin


async def test_a_rebound_name_cannot_open_a_lock_session(nursery: trio.Nursery) -> None:
    """DNS rebinding: a site points its own name at 127.0.0.1, so its page's Origin
    and Host agree. A browser reaches the port only by a name it is known by: an IP
    address, localhost, --metrics-host or --http-allowed-hosts."""
    server = await start(nursery, http_allowed_hosts="locks.internal")
    port = server.http_port

    async def as_browser_at(name: bytes) -> bytes:
        origin = b"Origin: http://%s:%d" % (name, port)
        return await upgrade_status(port, origin, host=name)

    assert b" 403 " in await as_browser_at(b"rebound.evil.example")
    assert b" 101 " in await as_browser_at(b"localhost")
    assert b" 101 " in await as_browser_at(b"locks.internal")
    assert b" 101 " in await as_browser_at(b"LOCKS.internal")
    assert b" 101 " in await as_browser_at(b"[::1]")
    assert b" 101 " in await upgrade_status(port, host=b"rebound.evil.example")  # no Origin


async def test_upgrades_are_refused_when_the_lock_port_speaks_tls(
    nursery: trio.Nursery, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    server = await start(nursery, tls_cert=tls_files["cert"], tls_key=tls_files["key"])
    with pytest.raises(HandshakeError) as refused:
        async with websocket(server.url):
            pass
    assert "403" in str(refused.value)


async def test_the_clients_and_their_calls_work_over_websocket(nursery: trio.Nursery) -> None:
    server = await start(nursery)
    async with Client(url=server.url) as client:
        async with client.lock("job", ttl=5) as hold:
            assert (await client.info("job")).token == hold.token

            def from_a_thread() -> bool:
                with BlockingClient(url=server.url) as other:
                    return other.info("job").locked

            assert await trio.to_thread.run_sync(from_a_thread)
        assert not (await client.info("job")).locked


async def test_a_waiting_request_is_answered_in_order_and_cancelled_by_a_close(
    nursery: trio.Nursery,
) -> None:
    """A wait over WebSocket is a TCP session's wait: a request sent behind it is
    answered after it, and closing the session while it waits cancels it."""
    server = await start(nursery)
    tcp = await server.tcp()
    assert await tcp.request(b"g K") == b"1 Got Lock"
    async with websocket(server.url) as ws:
        await ws.send_message("lock K 5")
        await until_waiting(tcp, b"K")
        await ws.send_message("ping")
        assert await tcp.request(b"r K") == b"1 Released Lock"
        assert await ws.get_message() == "200 Acquired\r\n"
        assert await ws.get_message() == "200 PONG\r\n"
        assert await ask(ws, "unlock K") == "200 Unlocked\r\n"
    assert await tcp.request(b"g K") == b"1 Got Lock"
    async with websocket(server.url) as ws:
        await ws.send_message("lock K 30")
        await until_waiting(tcp, b"K")
    await until_waiting(tcp, b"K", 0)  # the close cancelled the wait
    assert await tcp.request(b"r K") == b"1 Released Lock"
    assert await tcp.request(b"i K") == b"0 Not Locked"


async def test_a_message_of_several_lines_is_that_many_requests_answered_in_one_message(
    nursery: trio.Nursery,
) -> None:
    """docs/protocol.md's reading: a message is read as the TCP port reads bytes, so
    "g a\\ng b" is two requests; their replies come together, in one message."""
    server = await start(nursery)
    async with websocket(server.url) as ws:
        assert await ask(ws, "g a\ng b") == "1 Got Lock\r\n1 Got Lock\r\n"
        assert await ask(ws, "i a") == "1 Locked\r\n"


async def test_close_codes_say_why_a_session_ended(nursery: trio.Nursery) -> None:
    """1009 for a message over the hard bound (its locks are freed as at any close),
    1013 after "0 Too Many Connections", 1000 after quit."""
    server = await start(nursery, max_connections=2)
    tcp = await server.tcp()
    async with websocket(server.url) as ws:
        assert await ask(ws, "g K") == "1 Got Lock\r\n"
        await ws.send_message("g " + "k" * (1 << 20))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1009

    async def freed() -> bool:
        return await tcp.request(b"i K") == b"0 Not Locked"

    await eventually(freed, timeout=5)
    async with websocket(server.url) as ws:
        assert await ask(ws, "quit") == "200 Bye\r\n"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1000
    second = await server.tcp()
    assert await second.request(b"ping") == b"200 PONG"
    async with websocket(server.url) as ws:
        assert await ws.get_message() == "0 Too Many Connections\r\n"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1013


async def test_glockds_silences_are_empty_messages(nursery: trio.Nursery) -> None:
    """W6 (issue 24): with --replies glockd, a request that gets no reply on TCP (an
    unknown verb, an empty line, a listing of nothing) gets an empty message, as
    r312 sends: glockd's own tester waits for one message per request."""
    server = await start(nursery, replies="glockd")
    async with websocket(server.url) as ws:
        assert await ask(ws, "nope") == ""
        assert await ask(ws, "d") == ""  # nothing is held: an empty listing
        assert await ask(ws, "d nothing") == ""
        assert await ask(ws, "") == ""
        assert await ask(ws, b"who") == b""  # of the request's type
        assert await ask(ws, "ping") == "200 PONG\r\n"
        assert await ask(ws, "g k") == "1 Lock Get Success: k\r\n"
        assert await ask(ws, "d") == f"k: {ws.local.address}:{ws.local.port}\r\n"
        # Several lines in one message are answered together, silences adding nothing.
        assert await ask(ws, "nope\ni k") == "1 Lock Is Locked: k\r\n"
    tcp = await server.tcp()
    await tcp.send(b"nope\n")
    assert await tcp.request(b"i k") == b"0 Lock Not Locked: k"  # TCP: silence


async def test_binary_messages_keep_every_byte_of_a_key(nursery: trio.Nursery) -> None:
    server = await start(nursery)
    tcp = await server.tcp()
    async with websocket(server.url) as ws:
        assert await ask(ws, b"g \x80\xff") == b"1 Got Lock\r\n"
        assert await tcp.request(b"i \x80\xff") == b"1 Locked"
        listing = await ask(ws, b"d")
        assert isinstance(listing, bytes) and listing.startswith(b"\x80\xff: "), listing
        text = await ask(ws, "d")  # a text message shows the bytes replaced
        assert isinstance(text, str) and text.startswith("\ufffd\ufffd: "), text


async def test_pings_are_answered_and_an_upgrade_must_open_its_connection(
    nursery: trio.Nursery,
) -> None:
    """A ping gets its pong (the session goes on); an upgrade asked on a kept-alive
    HTTP connection, after a first request, is refused (403)."""
    server = await start(nursery)
    async with websocket(server.url) as ws:
        with trio.fail_after(5):
            await ws.ping(b"are you there")
        assert await ask(ws, "ping") == "200 PONG\r\n"
    stream = await trio.open_tcp_stream("127.0.0.1", server.http_port)
    await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
        received += await stream.receive_some(4096)
    assert received.startswith(b"HTTP/1.1 200 ") and b"ok\n" in received
    await stream.send_all(
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    received = b""
    while b"\r\n" not in received:
        received += await stream.receive_some(4096)
    assert received.startswith(b"HTTP/1.1 403 "), received
    await stream.aclose()


async def test_kill_over_the_websocket_needs_the_admin_token(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The WebSocket door is no way round --admin-token-file: a session that passed
    `auth` with the lock token gets 403 for `kill`, one with the admin token kills."""
    (tmp_path / "token").write_text("lock-token\n")
    (tmp_path / "admin").write_text("admin-token\n")
    server = await start(
        nursery,
        auth_token_file=str(tmp_path / "token"),
        admin_token_file=str(tmp_path / "admin"),
        auth_failure_delay=0.01,
    )
    async with websocket(server.url) as holder, websocket(server.url) as operator:
        assert await ask(holder, "auth lock-token") == "200 OK\r\n"
        assert await ask(holder, "lock k") == "200 Acquired\r\n"
        assert await ask(holder, "kill k") == "403 Forbidden\r\n"
        assert await ask(operator, "kill k") == "403 Auth Required\r\n"
        assert await ask(operator, "auth admin-token") == "200 OK\r\n"
        assert await ask(operator, "kill k") == "200 Killed 1\r\n"
        assert await ask(holder, "token k") == "403 Not Locked\r\n"
