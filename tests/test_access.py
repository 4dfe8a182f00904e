"""Limits and access control: hold limits, idle and send timeouts, auth tokens, TLS."""

from __future__ import annotations

import logging
import ssl
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from elockd.daemon.server import make_service, serve
from elockd.daemon.startup import StartupError
from elockd.observe import logs
from elockd.observe.logthrottle import LogThrottle
from elockd.protocol.config import Config
from elockd.protocol.connection import Connection
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import eventually
from tests.support.sansio import memory_service


@pytest.mark.parametrize("server_config", [Config(max_holds=2)])
async def test_hold_limit_refuses_new_holds_only(server: RunningServer) -> None:
    client = await server.connect()
    assert await client.request(b"g a") == b"1 Got Lock"
    assert await client.request(b"sg b") == b"1 Got Lock"
    assert await client.request(b"g c") == b"0 Too Many Holds"
    assert await client.request(b"sg c") == b"0 Too Many Holds"
    assert await client.request(b"lock c") == b"413 Too Many Holds"
    assert await client.request(b"lock_shared c limit=3") == b"413 Too Many Holds"
    assert await client.request(b"mlock a c") == b"413 Too Many Holds"
    assert await client.request(b"g a") == b"1 Got Lock"  # a repeat adds no hold
    assert await client.request(b"i c") == b"0 Not Locked"
    assert await client.request(b"r a") == b"1 Released Lock"
    assert await client.request(b"g c") == b"1 Got Lock"


@pytest.mark.parametrize("server_config", [Config(idle_timeout=30)])
async def test_idle_timeout_closes_silent_connections(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    silent, pinging = await server.connect(), await server.connect()
    assert await silent.request(b"g held") == b"1 Got Lock"
    assert await pinging.request(b"g kept") == b"1 Got Lock"
    for _ in range(4):
        await trio.sleep(20)
        assert await pinging.request(b"ping") == b"200 PONG"
    assert await silent.at_eof()
    assert await pinging.request(b"i held") == b"0 Not Locked"
    assert await pinging.request(b"i kept") == b"1 Locked"


@pytest.mark.parametrize("server_config", [Config(send_timeout=5)])
async def test_client_that_never_reads_is_dropped(
    server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    reader, hog = await server.connect(), await server.connect()
    assert await hog.request(b"g hogged") == b"1 Got Lock"
    # Each `q` reply is ~500 bytes: 40,000 of them are far more than the socket
    # buffers hold, so the server blocks in send, stops reading, and gives up.
    await hog.send(b"q\n" * 40_000)

    async def dropped() -> bool:  # and its lock freed
        reply = await reader.request(b"i hogged")
        assert reply in (b"1 Locked", b"0 Not Locked"), reply
        return reply == b"0 Not Locked"

    await eventually(dropped, timeout=60, interval=1)
    stats = await reader.stats()
    assert stats["orphans"] == 1
    assert stats["connections"] == 1


def write_token(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return str(path)


async def test_auth_required_before_anything_else(nursery: trio.Nursery, tmp_path: Path) -> None:
    token = write_token(tmp_path)
    config = Config(port=0, metrics_port=0, auth_token_file=token, auth_failure_delay=0.1)
    service = make_service(config)
    addresses = await nursery.start(serve, config, service)
    port = addresses[0][1]
    client = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    assert await client.request(b"g k") == b"0 Auth Required"
    assert await client.request(b"lock k") == b"403 Auth Required"
    assert await client.request(b"nope") == b"0 Invalid Command: nope"
    assert not service.backend.exclusive
    assert await client.request(b"auth s3cret-token") == b"200 OK"
    assert await client.request(b"g k") == b"1 Got Lock"
    intruder = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    assert await intruder.request(b"auth guess") == b"403 Bad Token"
    assert await intruder.at_eof()
    await client.aclose()


async def test_a_wrong_token_is_logged_and_answered_late_without_slowing_others(
    nursery: trio.Nursery,
    tmp_path: Path,
    mock_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guessing was 7,835 tokens a second with nothing logged. Now each wrong token
    costs its guesser --auth-failure-delay, a warning names the peer, and a client
    with the right token is served meanwhile."""
    monkeypatch.setattr(logs, "_auth_failure_warning", LogThrottle(logs.log, logging.WARNING))
    config = Config(
        port=0, metrics_port=0, auth_token_file=write_token(tmp_path), auth_failure_delay=2.5
    )
    addresses = await nursery.start(serve, config, make_service(config))
    port = addresses[0][1]
    guesser = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    honest = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    started = trio.current_time()
    with caplog.at_level(logging.WARNING, logger="elockd"):
        await guesser.send(b"auth guess-1\nauth guess-2\n")
        assert await honest.request(b"auth s3cret-token") == b"200 OK"
        assert await honest.request(b"g k") == b"1 Got Lock"
        assert trio.current_time() == started, "the honest client did not wait"
        assert await guesser.line() == b"403 Bad Token\r\n"
        assert trio.current_time() - started == 2.5
        assert await guesser.at_eof(), "one guess per connection"
    [record] = [r for r in caplog.records if "auth" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert getattr(record, "peer", "").startswith("127.0.0.1:")
    await honest.aclose()


def test_auth_without_a_token_file_accepts_any_token() -> None:
    """docs/protocol.md (readings chosen): nothing to check, nothing refused."""
    conn = Connection(memory_service(), b"10.0.0.1:1111")
    assert conn.handle(b"auth anything", 0.0) == b"200 OK\r\n"
    assert not conn.closing
    assert conn.handle(b"g k", 0.0) == b"1 Got Lock\r\n"


async def test_empty_token_file_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_text("\n")
    with pytest.raises(StartupError, match=r"^--auth-token-file .*/empty: empty"):
        make_service(Config(auth_token_file=str(path)))


async def start_tls_server(nursery: trio.Nursery, config: Config) -> int:
    addresses = await nursery.start(serve, config, make_service(config))
    return int(addresses[0][1])


async def tls_client(port: int, context: ssl.SSLContext) -> LineClient:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="127.0.0.1")
    await stream.do_handshake()
    return LineClient(stream)  # type: ignore[arg-type]


async def test_tls_lock_port(
    nursery: trio.Nursery, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    base = Config(port=0, metrics_port=0)
    port = await start_tls_server(
        nursery, replace(base, tls_cert=tls_files["cert"], tls_key=tls_files["key"])
    )
    context = ssl.create_default_context()
    ca.configure_trust(context)
    client = await tls_client(port, context)
    assert await client.request(b"g secret") == b"1 Got Lock"
    assert await client.request(b"lock secret") == b"200 Acquired"
    # A plaintext client gets no lock service on the TLS port.
    plain = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    await plain.send(b"g secret\n")
    with pytest.raises((EOFError, trio.BrokenResourceError)):
        await plain.line()
    await client.aclose()


async def test_a_tls_session_outlives_the_handshake_timeout(
    nursery: trio.Nursery,
    ca: trustme.CA,
    tls_files: dict[str, str],
    mock_clock: trio.testing.MockClock,
) -> None:
    """The handshake timeout bounds the handshake only, not the session after it."""
    config = Config(
        port=0,
        metrics_port=0,
        handshake_timeout=1.0,
        tls_cert=tls_files["cert"],
        tls_key=tls_files["key"],
    )
    port = await start_tls_server(nursery, config)
    context = ssl.create_default_context()
    ca.configure_trust(context)
    holder = await tls_client(port, context)
    other = await tls_client(port, context)
    assert await holder.request(b"g kept") == b"1 Got Lock"
    await trio.sleep(60)
    assert await other.request(b"i kept") == b"1 Locked"
    assert await holder.request(b"r kept") == b"1 Released Lock"
    await holder.aclose()
    await other.aclose()


async def test_mutual_tls_demands_a_client_certificate(
    nursery: trio.Nursery, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    config = Config(
        port=0,
        metrics_port=0,
        tls_cert=tls_files["cert"],
        tls_key=tls_files["key"],
        tls_client_ca=tls_files["ca"],
    )
    port = await start_tls_server(nursery, config)
    with_cert = ssl.create_default_context()
    ca.configure_trust(with_cert)
    ca.issue_cert("worker-1@example.test").configure_cert(with_cert)
    client = await tls_client(port, with_cert)
    assert await client.request(b"g k") == b"1 Got Lock"
    await client.aclose()

    without_cert = ssl.create_default_context()
    ca.configure_trust(without_cert)
    with pytest.raises((trio.BrokenResourceError, EOFError)):
        anonymous = await tls_client(port, without_cert)
        # TLS 1.3 reports a refused client certificate on the first read.
        await anonymous.request(b"g k")
