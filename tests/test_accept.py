"""The accept loop survives every resource error, refuses over the descriptor limit
with a reason, and sets TCP keepalive so vanished hosts are noticed."""

from __future__ import annotations

import errno
import logging
import socket

import pytest
import trio

from elockd import server
from elockd.config import Config
from elockd.logthrottle import LogThrottle
from elockd.server import (
    SpareDescriptor,
    accept_loop,
    keepalive_settings,
    make_service,
    tune_accepted,
)
from elockd.serving import ConnectionSlots


class FlakyListener(socket.socket):
    """A listening socket whose accept() fails with the given errnos first."""

    errors: list[int]

    def accept(self) -> tuple[socket.socket, object]:
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, "injected")
        return super().accept()


def flaky_listener(errors: list[int]) -> FlakyListener:
    listener = FlakyListener(socket.AF_INET, socket.SOCK_STREAM)
    listener.errors = errors
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    return listener


async def request(port: int, line: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(line)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = await stream.receive_some(1024)
            if not chunk:
                break
            reply += chunk
        return reply


@pytest.mark.parametrize("code", [errno.ENOMEM, errno.ENOBUFS, errno.EMFILE, errno.ENFILE])
async def test_the_accept_loop_survives_resource_errors(
    code: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, anything but EMFILE and ENFILE ended the loop, and with it the server
    and every lock. Without a spare descriptor the loop pauses and goes on."""
    # The server's throttle is one per process; this test gets its own.
    monkeypatch.setattr(server, "accept_warning", LogThrottle(server.log, logging.WARNING))
    service = make_service(Config(port=0, metrics_port=0))
    listener = flaky_listener([code, code, code])
    port = listener.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="elockd"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_loop, service, listener, nursery)
            with trio.fail_after(5):
                assert await request(port, b"g k\n") == b"1 Got Lock\r\n"
            nursery.cancel_scope.cancel()
    listener.close()
    warnings = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(warnings) == 1, "three failures, one rate-limited line"
    assert errno.errorcode[code] in warnings[0].getMessage()


async def test_out_of_descriptors_a_connection_is_told_why_on_the_spare() -> None:
    service = make_service(Config(port=0, metrics_port=0))
    listener = flaky_listener([errno.EMFILE])
    port = listener.getsockname()[1]
    spare = SpareDescriptor()
    assert spare.fd is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            accept_loop, service, listener, nursery, None, ConnectionSlots(100), spare
        )
        with trio.fail_after(5):
            assert await request(port, b"g k\n") == b"0 Too Many Connections\r\n"
            assert await request(port, b"g k\n") == b"1 Got Lock\r\n"  # served again
        nursery.cancel_scope.cancel()
    assert spare.fd is not None, "the spare was taken back"
    spare.close()
    listener.close()


def test_keepalive_notices_a_dead_peer_well_within_the_bound() -> None:
    assert keepalive_settings(30) == (15, 3, 3)
    for seconds in (2, 3, 4, 5, 10, 30, 60, 300, 7200):
        idle, interval, count = keepalive_settings(seconds)
        assert idle + interval * count <= seconds, seconds
        assert min(idle, interval, count) >= 1


def test_accepted_tcp_sockets_carry_the_keepalive_and_user_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with client, accepted:
            tune_accepted(accepted, 30.0)
            get = accepted.getsockopt
            assert get(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert get(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
            assert get(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 3
            assert get(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            assert get(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 24_000
            assert get(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_keepalive_0_keeps_the_operating_system_defaults() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with client, accepted:
            before = accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            tune_accepted(accepted, 0.0)
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == before
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
