"""One connection's loop (net/serving.py) against a transport that fails the way
real ones do: whatever a connection does, it ends that connection, never the
server. A connection task that raises would take the whole nursery, and every
lock in it, down with it."""

from __future__ import annotations

import logging

import pytest
import trio

from elockd.backend.interface import Later
from elockd.daemon.server import make_memory_backend
from elockd.handover.pause import NEVER
from elockd.net.serving import PausableService, serve_connection
from elockd.protocol.commands import COMMANDS
from elockd.protocol.config import Config


class FailingTransport:
    """Sends ``first`` once, then reports the peer gone; ``watch`` and ``receive``
    fail as they are told."""

    def __init__(self, first: bytes, *, watch_error: BaseException | None = None) -> None:
        self.pause = NEVER
        self.rest: object = None
        self.first = first
        self.watch_error = watch_error
        self.receive_error: BaseException | None = None
        self.sent: list[bytes] = []
        self.closed = False

    async def receive(self) -> bytes:
        if self.receive_error is not None:
            raise self.receive_error
        data, self.first = self.first, b""
        return data

    async def send(self, data: bytes) -> None:
        self.sent.append(data)

    async def send_stream(self, chunks: object) -> None:
        raise AssertionError("no dump is asked")

    def replying_late(self) -> None:
        pass

    async def watch_for_close(self) -> None:
        await trio.sleep(0.01)
        if self.watch_error is not None:
            raise self.watch_error
        await trio.sleep_forever()

    async def aclose(self) -> None:
        self.closed = True


def service() -> PausableService:
    config = Config()
    return PausableService(config, make_memory_backend(config), COMMANDS)


async def test_a_peer_that_breaks_while_its_request_waits_ends_only_its_connection() -> None:
    """A WebSocket answers a ping while a request waits; that send fails on a reset
    (or after --send-timeout). The wait's watcher sees a broken peer: the
    connection ends as if the peer had hung up, and its wait with it."""
    served = service()
    other = served.backend.open_session("o" * 32, b"other")
    assert served.backend.acquire(other, b"K", trio.current_time())
    transport = FailingTransport(b"lock K 60\n", watch_error=trio.BrokenResourceError("pong"))
    with trio.fail_after(5):
        await serve_connection(served, transport, b"peer")  # returns: no exception
    assert transport.closed and transport.sent == []
    info = served.backend.info(b"K", trio.current_time())
    assert not isinstance(info, Later) and info.waiting == 0


async def test_an_unexpected_error_ends_only_its_connection_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    served = service()
    transport = FailingTransport(b"g K\n")
    transport.receive_error = RuntimeError("a bug in a transport")
    with caplog.at_level(logging.ERROR, logger="elockd"), trio.fail_after(5):
        await serve_connection(served, transport, b"peer")
    assert transport.closed
    assert any("unexpected error" in r.getMessage() for r in caplog.records)
