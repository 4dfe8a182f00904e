"""A late reply (a grant after a wait) lowers TCP_USER_TIMEOUT to what is left of the
keepalive bound since the peer was last heard; hearing from the peer again gives the
whole bound back. The end-to-end bound, with a host that really vanishes, is measured
in tests/test_hostile.py; here are the socket-level steps, on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from elockd.net import tcp_silence, transport
from elockd.net.serving import deliver
from elockd.net.tcp_silence import lower_user_timeout, set_user_timeout, silent_for
from elockd.net.transport import SocketTransport
from elockd.protocol.connection import Delayed, Reports

BOUND = 30.0


def user_timeout(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the server's accepted socket with the whole bound set, the client's)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with client, accepted:
            set_user_timeout(accepted, BOUND)
            yield accepted, client


@pytest.fixture
def any_silence_is_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lower even after a short silence, so the tests need not wait a whole second."""
    monkeypatch.setattr(tcp_silence, "LATE_REPLY", 0.0)


async def test_silence_counts_from_the_last_segment_the_peer_sent(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    accepted, client = tcp_pair
    await trio.sleep(0.3)
    assert 0.29 <= silent_for(accepted) < 1.0
    client.sendall(b"x")
    await trio.sleep(0.05)
    assert silent_for(accepted) < 0.2


@pytest.mark.usefixtures("any_silence_is_late")
async def test_a_late_reply_gets_what_is_left_of_the_bound_or_the_floor(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    accepted, _ = tcp_pair
    await trio.sleep(0.3)
    left = lower_user_timeout(accepted, BOUND)
    assert left is not None and BOUND - 0.5 < left <= BOUND - 0.29
    assert user_timeout(accepted) == round(left * 1000)
    assert lower_user_timeout(accepted, 1.2) == tcp_silence.LATE_REPLY_FLOOR
    assert user_timeout(accepted) == 1000


async def test_a_peer_heard_within_late_reply_keeps_the_whole_bound(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    accepted, _ = tcp_pair
    assert lower_user_timeout(accepted, BOUND) is None
    assert user_timeout(accepted) == BOUND * 1000


@pytest.mark.usefixtures("any_silence_is_late")
async def test_data_from_the_peer_gives_the_whole_bound_back(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    accepted, client = tcp_pair
    served = SocketTransport(accepted, bound=BOUND)
    await trio.sleep(0.1)
    served.replying_late()
    assert served.lowered and user_timeout(accepted) < BOUND * 1000
    client.sendall(b"unlock job\n")
    assert await served.receive() == b"unlock job\n"
    assert not served.lowered and user_timeout(accepted) == BOUND * 1000


@pytest.mark.usefixtures("any_silence_is_late")
async def test_an_ack_of_the_late_reply_gives_the_whole_bound_back(
    tcp_pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that got its grant and then stays silent: the ACK of the grant is
    noticed (by the run's Restorer), and the bound is whole again."""
    monkeypatch.setattr(transport, "HEARD_RECHECK", 0.02)
    accepted, client = tcp_pair
    served = SocketTransport(accepted, bound=BOUND)
    await trio.sleep(0.1)
    served.replying_late()
    await served.send(b"200 Acquired\r\n")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served.receive)
        with trio.fail_after(2):
            while served.lowered:
                await trio.sleep(0.01)
        assert user_timeout(accepted) == BOUND * 1000
        nursery.cancel_scope.cancel()
    assert client.recv(100) == b"200 Acquired\r\n"


@pytest.mark.usefixtures("any_silence_is_late")
async def test_a_peer_not_heard_since_the_late_reply_stays_lowered(
    tcp_pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing was sent, so nothing is acknowledged: the peer stays unheard, and its
    timeout stays what was left of the bound however often it is checked."""
    monkeypatch.setattr(transport, "HEARD_RECHECK", 0.02)
    accepted, _ = tcp_pair
    served = SocketTransport(accepted, bound=BOUND)
    await trio.sleep(0.1)
    served.replying_late()
    lowered = user_timeout(accepted)
    with trio.move_on_after(0.3):
        await served.receive()
    assert served.lowered and user_timeout(accepted) == lowered


@pytest.mark.usefixtures("any_silence_is_late")
async def test_unix_sockets_have_no_bound() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        served = SocketTransport(ours, bound=BOUND)
        served.replying_late()  # no TCP_INFO to read: nothing happens
        assert not served.lowered


class Recorder:
    """A transport that records what the server did with a reply."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def replying_late(self) -> None:
        self.calls.append("late")

    async def send(self, data: bytes) -> None:
        self.calls.append(data.decode())


@pytest.mark.parametrize(("seconds", "calls"), [(0.5, ["x"]), (2.0, ["late", "x"])])
async def test_only_a_reply_a_second_or_more_after_its_request_is_late(
    seconds: float, calls: list[str], mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0
    recorder = Recorder()
    await deliver(Delayed(b"x", seconds), recorder, trio.current_time(), reports=Reports())  # type: ignore[arg-type]
    assert recorder.calls == calls
