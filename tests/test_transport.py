"""``--send-timeout`` bounds a stall, not a reply: a peer reading a big reply slowly
but steadily keeps its connection; one that stops reading is dropped."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
import trio
import trio.testing

from elockd.net.transport import SocketTransport, StreamTransport, Transport

REPLY = b"x" * (4 << 20)  # far more than the two socket buffers hold


def socket_pair() -> tuple[socket.socket, socket.socket]:
    server, client = socket.socketpair()
    for sock in (server, client):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    return server, client


def raw(sock: socket.socket, timeout: float) -> Transport:
    return SocketTransport(sock, timeout)


def stream(sock: socket.socket, timeout: float) -> Transport:
    return StreamTransport(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), timeout)


TRANSPORTS = [pytest.param(raw, id="socket"), pytest.param(stream, id="stream")]


async def read_steadily(sock: socket.socket, total: int, pause: float) -> int:
    """Read ``total`` bytes, 16 KiB at a time, sleeping ``pause`` between reads."""
    peer = trio.socket.from_stdlib_socket(sock)
    received = 0
    while received < total:
        chunk = await peer.recv(16384)
        if not chunk:
            break
        received += len(chunk)
        await trio.sleep(pause)
    return received


@pytest.mark.parametrize("make", TRANSPORTS)
async def test_a_slow_steady_reader_gets_the_whole_reply(
    make: Callable[[socket.socket, float], Transport], mock_clock: trio.testing.MockClock
) -> None:
    """Each 16 KiB read comes 0.2 s after the last: the whole 4 MB takes 51 s, far
    past a 1 s send timeout, but no stall lasts 1 s."""
    server, client = socket_pair()
    transport = make(server, 1.0)
    received = 0
    started = trio.current_time()

    async def reader() -> None:
        nonlocal received
        received = await read_steadily(client, len(REPLY), 0.2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await transport.send(REPLY)
    assert received == len(REPLY)
    assert trio.current_time() - started > 10  # the reply took many send timeouts
    await transport.aclose()
    client.close()


@pytest.mark.parametrize("make", TRANSPORTS)
async def test_a_reader_that_stops_is_dropped_one_timeout_after_the_last_progress(
    make: Callable[[socket.socket, float], Transport], mock_clock: trio.testing.MockClock
) -> None:
    server, client = socket_pair()
    transport = make(server, 1.0)
    stopped_at = 0.0

    async def reader() -> None:
        nonlocal stopped_at
        await read_steadily(client, 1 << 20, 0.2)  # reads 1 MB, then nothing more
        stopped_at = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        with pytest.raises(trio.BrokenResourceError):
            await transport.send(REPLY)
        dropped_at = trio.current_time()
        await transport.aclose()  # the reader sees EOF if it is still reading
    # Dropped only once the reader stopped (12 s in), within a timeout of it.
    assert stopped_at < dropped_at <= stopped_at + 1.5
    client.close()
