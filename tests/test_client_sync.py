"""The blocking client against a real ``python -m elockd`` process over TCP."""

from __future__ import annotations

import re
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trustme

from elockd.client import (
    AuthError,
    BlockingClient,
    BlockingRateLimiter,
    Client,
    ConnectFailed,
    ConnectionLost,
    Hold,
    KeyBusy,
    LockLost,
    ProtocolError,
    ReplyTimeout,
    Unavailable,
)
from tests.support.foreign_service import foreign_service
from tests.support.server_process import start_server, stop_server


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """One server for the module; every test uses keys of its own."""
    process, port = start_server()
    yield port
    stop_server(process)


@pytest.fixture
def fresh_server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    process, port = start_server()
    yield process, port
    stop_server(process)


def test_lock_token_contention_and_info(port: int) -> None:
    with BlockingClient(port=port) as a, BlockingClient(port=port) as b:
        with a.lock("sync-job") as hold:
            assert hold.token is not None and hold.token > 0
            assert b.info("sync-job").token == hold.token
            with pytest.raises(Unavailable):
                b.acquire("sync-job")
            with pytest.raises(KeyBusy):
                a.acquire("sync-job")
        with b.lock("sync-job", wait=1) as second:
            assert second.token is not None and second.token > hold.token
        assert not a.info("sync-job").locked


def test_wait_shared_mlock_stats_ping_session(port: int) -> None:
    with BlockingClient(port=port) as a, BlockingClient(port=port) as b:
        hold = a.acquire("sync-wait")
        timer = threading.Timer(0.2, a.release, [hold])
        timer.start()
        start = time.monotonic()
        with b.lock("sync-wait", wait=5):
            assert 0.15 < time.monotonic() - start < 4
        timer.join()
        with a.shared("sync-api", limit=1) as one:
            assert one.holders == 1
            with pytest.raises(Unavailable) as refused:
                b.acquire_shared("sync-api", limit=1)
            assert refused.value.holders == 1
        with a.mlock(["sync-m1", "sync-m2"]) as many:
            assert set(many.tokens) == {b"sync-m1", b"sync-m2"}
            with pytest.raises(Unavailable) as conflict:
                b.acquire_many(["sync-m0", "sync-m2"])
            assert conflict.value.keys == (b"sync-m2",)
        assert 0 < a.ping() < 5  # a loopback round trip
        assert re.fullmatch("[0-9a-f]{32}", a.session_id())  # 128 random bits, in hex
        assert a.stats()["clients"] >= 2
        assert a.command("i sync-m1") == [b"0 Not Locked"]


def test_threads_share_one_pipelined_connection(port: int) -> None:
    errors: list[BaseException] = []
    with BlockingClient(port=port) as client:
        before = client.stats()["command_lock"]

        def worker(index: int) -> None:
            try:
                for round_ in range(20):
                    with client.lock(f"sync-t{index}-{round_}"):
                        client.ping()
            except BaseException as error:  # pragma: no cover - reported below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        assert client.stats()["command_lock"] - before == 160


def test_auto_renew_keeps_a_half_second_lease_alive_for_three_seconds(port: int) -> None:
    with BlockingClient(port=port) as client, BlockingClient(port=port) as observer:
        before = observer.stats()
        with client.lock("sync-lease", ttl=0.5) as hold:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                time.sleep(0.25)
                assert observer.info("sync-lease").token == hold.token, "the lease ran out"
            assert hold.renewals >= 12 and not hold.lost
        after = observer.stats()
        assert after["expired"] == before["expired"]


def test_lock_lost_when_the_connection_is_killed(
    fresh_server: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = fresh_server
    lost = threading.Event()
    with (
        BlockingClient(port=port) as client,
        pytest.raises(LockLost, match="connection lost"),
        client.lock("k", on_lost=lambda hold: lost.set()) as hold,
    ):
        killed_at = time.monotonic()
        process.kill()
        assert lost.wait(5)
        assert hold.lost
        assert hold.lost_at is not None and killed_at <= hold.lost_at <= time.monotonic()


def test_a_dead_io_thread_loses_the_holds_at_a_real_time(port: int) -> None:
    """If the I/O thread is gone, a call gives up a second after its reply was due
    and every hold is lost then, on time.monotonic() (it used to say 0.0)."""
    with BlockingClient(port=port, reply_timeout=0.2) as client:
        hold = client.acquire("sync-dead-thread")
        with client._lock:
            client._stop = True  # what close() tells the thread
        client._wake()
        assert client._thread is not None
        client._thread.join(5)
        assert not client._thread.is_alive()
        before = time.monotonic()
        with pytest.raises(ConnectionLost, match="I/O thread stopped"):
            client.ping()
        assert hold.lost and hold.lost_at is not None
        assert before + 1.0 <= hold.lost_at <= time.monotonic()


def test_interrupted_acquire_never_leaves_a_hold(port: int) -> None:
    """A signal handler raising (Ctrl-C) while acquire waits: the wait goes on at the
    server, and the release queued behind it frees whatever it grants."""

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with (
            BlockingClient(port=port) as holder,
            BlockingClient(port=port) as waiter,
            BlockingClient(port=port) as observer,
        ):
            hold = holder.acquire("sync-cancel")
            main = threading.get_ident()
            timer = threading.Timer(0.2, signal.pthread_kill, [main, signal.SIGUSR1])
            timer.start()
            with pytest.raises(Interrupted):
                waiter.acquire("sync-cancel", wait=10)
            timer.join()
            assert waiter.holds == []
            holder.release(hold)  # the server grants the pending wait to `waiter`...
            waiter.ping()  # ...and runs the queued unlock before this ping
            assert not observer.info("sync-cancel").locked
            with waiter.lock("sync-cancel"):
                pass
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_silent_server_raises_reply_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with BlockingClient(port=port, reply_timeout=0.3) as client:
            start = time.monotonic()
            with pytest.raises(ReplyTimeout):
                client.ping()
            assert 0.25 < time.monotonic() - start < 2
        # A TLS handshake nobody answers ends at the connect timeout.
        start = time.monotonic()
        with pytest.raises(ConnectFailed):
            BlockingClient(
                port=port, ssl_context=ssl.create_default_context(), connect_timeout=0.3
            ).connect()
        assert time.monotonic() - start < 2


def test_connection_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(ConnectFailed, match="cannot connect"):
            BlockingClient(port=port).connect()


def test_resume_after_a_dropped_connection(port: int) -> None:
    first = BlockingClient(port=port)
    first.connect()
    hold = first.acquire("sync-resume", ttl=30)
    session = first.session_id()
    first.close(release=False)
    assert hold.lost
    with BlockingClient(port=port) as second:
        assert second.resume(session)
        with second.lock("sync-resume", ttl=30) as adopted:
            assert adopted.token == hold.token
        assert not second.info("sync-resume").locked


def test_rate_limiter_caps_concurrency_across_threads(port: int) -> None:
    """Six threads through a limiter of 2: two at a time, never three, never one.

    The first two inside wait for each other (a limiter that admits only one never
    lets the second in, and the wait times out); each then keeps its slot 0.1 s, the
    window in which a limiter that admitted a third would show it."""
    lock = threading.Lock()
    active = peak = 0
    two_inside = threading.Event()
    done: list[int] = []

    def worker(index: int, limiter: BlockingRateLimiter) -> None:
        nonlocal active, peak
        with limiter.slot():
            with lock:
                active += 1
                peak = max(peak, active)
                if active == 2:
                    two_inside.set()
            if not two_inside.wait(5):
                return  # never two at once: done stays short
            time.sleep(0.1)
            with lock:
                active -= 1
        done.append(index)

    with BlockingRateLimiter("sync-partner-api", 2, port=port, wait=10) as limiter:
        threads = [
            threading.Thread(target=worker, args=(index, limiter), daemon=True)
            for index in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert [thread for thread in threads if thread.is_alive()] == []  # none timed out
    assert sorted(done) == list(range(6))
    assert peak == 2


def test_lost_hold_reports_on_release(port: int) -> None:
    """A hold freed behind the client's back (here: its session's `unlock_all`)
    raises LockLost when the block ends."""
    lost: list[Hold] = []
    reported = threading.Event()

    def on_lost(hold: Hold) -> None:
        lost.append(hold)
        reported.set()

    with BlockingClient(port=port) as client:
        with (
            pytest.raises(LockLost, match="no longer held"),
            client.lock("sync-lost", on_lost=on_lost),
        ):
            client.command("unlock_all")
        # on_lost runs in the client's I/O thread, maybe just after the block ended.
        assert reported.wait(5)
        assert len(lost) == 1


def test_mutual_tls_and_auth(ca: trustme.CA, tls_files: dict[str, str]) -> None:
    paths = tls_files
    process, port = start_server(
        "--tls-cert",
        paths["cert"],
        "--tls-key",
        paths["key"],
        "--tls-client-ca",
        paths["ca"],
        "--auth-token-file",
        paths["token"],
    )
    try:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        ca.issue_cert("worker@example.test").configure_cert(context)
        client = BlockingClient(port=port, ssl_context=context, auth_token="letmein")
        with client, client.lock("tls", ttl=0.3) as hold:
            time.sleep(0.5)  # renewals go over TLS from the I/O thread
            assert hold.renewals >= 1
        with pytest.raises(AuthError):
            BlockingClient(port=port, ssl_context=context, auth_token="nope").connect()
    finally:
        stop_server(process)


def test_both_clients_over_a_unix_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "elockd.sock")
    process, _ = start_server("--unix", path)
    try:
        with BlockingClient(unix=path) as client, client.lock("over-unix") as hold:
            assert client.info("over-unix").owner == b"unix:1"

        async def with_trio() -> int | None:
            async with Client(unix=path) as client, client.lock("over-unix") as again:
                return again.token

        second = trio.run(with_trio)
        assert second is not None and hold.token is not None and second > hold.token
    finally:
        stop_server(process)


def test_auth_required_and_a_foreign_service_are_errors_not_answers(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("letmein\n")
    process, port = start_server("--auth-token-file", str(token))
    try:
        with BlockingClient(port=port) as anonymous:
            with pytest.raises(AuthError, match="i: 0 Auth Required"):
                anonymous.command("i k", check=True)
            with pytest.raises(AuthError, match="q: 0 Auth Required"):
                anonymous.command("q", check=True)
        with BlockingClient(port=port, auth_token="letmein") as client:
            assert client.command("i k", check=True) == [b"0 Not Locked"]
    finally:
        stop_server(process)
    with foreign_service() as port:
        start = time.monotonic()
        with (
            BlockingClient(port=port, reply_timeout=600) as client,
            pytest.raises(ProtocolError, match="not an elockd reply: 'SSH-2.0-"),
        ):
            client.command("i k", check=True)
        assert time.monotonic() - start < 30, "it waited for a reply instead of failing"
