"""Zero-downtime upgrade: a second elockd takes every connection and lock over from
the first (docs/upgrade.md), against real processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
import trustme

from tests.support.hostile_tools import Probe, latency_probe
from tests.support.line_client import LineClient
from tests.support.polling import eventually, resumed, until_waiting
from tests.support.server_process import start_server, stop_server

FAKE_SUCCESSOR = str(Path(__file__).parent / "support" / "fake_successor.py")


@contextmanager
def old_server(
    control: Path, *args: str, log: list[str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    process, port = start_server("--control-socket", str(control), *args, log=log)
    try:
        yield process, port
    finally:
        stop_server(process)


async def connect(port: int) -> LineClient:
    return LineClient(await trio.open_tcp_stream("127.0.0.1", port))


async def ask(client: LineClient, line: bytes) -> bytes:
    await client.send(line + b"\n")
    return await client.line()


async def wait_exit(process: subprocess.Popen[str], timeout: float) -> int:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(process.wait)


async def resumable_hold(port: int, key: bytes) -> tuple[LineClient, bytes]:
    """A connection that holds ``key`` with a 30 s grace time, and its session id."""
    worker = await connect(port)
    assert await ask(worker, b"set_timeout 30000") == b"200 timeout set\r\n"
    assert await ask(worker, b"lock " + key) == b"200 Acquired\r\n"
    return worker, (await ask(worker, b"conn_id"))[4:].strip()


async def take_back(worker: LineClient, port: int, session_id: bytes) -> LineClient:
    """After a hand-over: ``worker``'s connection still answers; then a network blip
    ends it, and a new connection takes its session back with ``conn_id`` (once the
    server has noticed the close: until then the session is not free to take)."""
    assert await ask(worker, b"ping") == b"200 PONG\r\n"  # the same connection
    await worker.stream.aclose()
    back = await connect(port)
    await eventually(lambda: resumed(back, session_id), timeout=5)
    return back


@dataclass
class GetReleaseLoop:
    """A client taking and freeing one key in a loop through a hand-over: every reply
    that was not the one expected, and how many rounds it made (the test stops it)."""

    client: LineClient
    errors: list[bytes] = field(default_factory=list)
    rounds: int = 0
    #: Rounds made by the time the old process had exited.
    rounds_at_exit: int = 0
    stop: trio.Event = field(default_factory=trio.Event)

    async def run(self) -> None:
        while not self.stop.is_set():
            for line, good in ((b"g loop", b"1 Got Lock\r\n"), (b"r loop", b"1 Released Lock\r\n")):
                reply = await ask(self.client, line)
                if reply != good:
                    self.errors.append(reply)
            self.rounds += 1

    async def across(
        self,
        start_successor: Callable[[], subprocess.Popen[str]],
        old: subprocess.Popen[str],
        then: float,
    ) -> tuple[subprocess.Popen[str], float]:
        """Loop while ``start_successor`` takes ``old`` over, which must exit 0, and
        for ``then`` seconds more: the successor, and how long the hand-over took."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.run)
            await trio.sleep(0.2)
            started = trio.current_time()
            new = await trio.to_thread.run_sync(start_successor)
            try:
                assert await wait_exit(old, 10) == 0
                took = trio.current_time() - started
                self.rounds_at_exit = self.rounds
                await trio.sleep(then)
                self.stop.set()
            except BaseException:
                stop_server(new)
                raise
        return new, took


async def run_fake_successor(control: Path, how: str) -> None:
    """tests/support/fake_successor.py doing ``how`` to the server at ``control``: it must
    have done what it was told."""
    fake = await trio.run_process(
        [sys.executable, FAKE_SUCCESSOR, str(control), how], capture_stdout=True, check=False
    )
    assert fake.returncode == 0, fake.stdout


def take_over(control: Path, *args: str, log: list[str] | None = None) -> subprocess.Popen[str]:
    process, _ = start_server("--take-over", str(control), *args, log=log)
    return process


async def test_a_successor_takes_every_connection_and_lock_over(tmp_path: Path) -> None:
    """The issue's "done when": holds, a queued waiter, a lease with its token, a name,
    a client looping through the hand-over, new connections; the old exits 0."""
    control = tmp_path / "control.sock"
    old_log: list[str] = []
    with old_server(control, log=old_log) as (old, port):
        holder, waiter, leaser, named, looper = [await connect(port) for _ in range(5)]
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        assert await ask(named, b"iam nightly-backup") == b"1 ok\r\n"
        assert await ask(named, b"lock job") == b"200 Acquired\r\n"
        assert await ask(leaser, b"lock lease ttl=30") == b"200 Acquired\r\n"
        token_before = await ask(leaser, b"token lease")
        await waiter.send(b"lock k1 30\n")  # queued behind the holder
        await until_waiting(holder, b"k1")
        loop = GetReleaseLoop(looper)
        new_log: list[str] = []
        new, took = await loop.across(lambda: take_over(control, log=new_log), old, 0.3)
        try:
            assert loop.errors == [] and loop.rounds > loop.rounds_at_exit, loop
            print(f"hand-over took {took:.2f} s, {loop.rounds} g/r rounds, errors {loop.errors}")
            assert took < 5, f"the hand-over took {took:.2f} s"
            # Holds, names, leases and tokens came along.
            assert await ask(holder, b"i k1") == b"1 Locked\r\n"
            assert await ask(leaser, b"token lease") == token_before
            assert await ask(leaser, b"renew lease ttl=60") == b"200 Renewed\r\n"
            info = await ask(named, b"info job")
            assert b"exclusive=nightly-backup" in info, info
            # The queued waiter is granted when the holder releases.
            assert await ask(holder, b"r k1") == b"1 Released Lock\r\n"
            with trio.fail_after(5):
                assert await waiter.line() == b"200 Acquired\r\n"
            # New connections are served by the new process.
            fresh = await connect(port)
            assert (await fresh.stats())["handovers"] == 1
            assert any("handed over" in line for line in old_log), old_log
            assert any(re.search(r"took over from pid \d+", line) for line in new_log), new_log
        finally:
            stop_server(new)


async def test_a_successor_of_an_unknown_version_is_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    control = tmp_path / "control.sock"
    log: list[str] = []
    with old_server(control, log=log) as (old, port):
        holder = await connect(port)
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        await run_fake_successor(control, "wrong-version")
        assert old.poll() is None
        assert await ask(holder, b"i k1") == b"1 Locked\r\n"
        assert await ask(holder, b"g k2") == b"1 Got Lock\r\n"
    assert any("state versions [999]" in line for line in log), log


@pytest.mark.parametrize("how", ["vanish-after-state", "never-ready"])
async def test_a_successor_that_fails_leaves_the_old_one_serving(tmp_path: Path, how: str) -> None:
    """Killed mid-hand-over, or silent past --handover-timeout: the old process
    resumes every connection, waiters and pipelined requests included."""
    control = tmp_path / "control.sock"
    log: list[str] = []
    with old_server(control, "--handover-timeout", "1", log=log) as (old, port):
        holder, waiter, piper = [await connect(port) for _ in range(3)]
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        await waiter.send(b"lock k1 30\n")
        await run_fake_successor(control, how)
        assert old.poll() is None
        # Pipelined requests during and after the attempt are all answered in order.
        await piper.send(b"g p1\ng p2\nr p1\n")
        assert [await piper.line() for _ in range(3)] == [
            b"1 Got Lock\r\n",
            b"1 Got Lock\r\n",
            b"1 Released Lock\r\n",
        ]
        assert await ask(holder, b"r k1") == b"1 Released Lock\r\n"
        with trio.fail_after(5):
            assert await waiter.line() == b"200 Acquired\r\n"
        fresh = await connect(port)
        assert await ask(fresh, b"i k1") == b"1 Locked\r\n"
    assert any("hand-over failed" in line for line in log), log


def test_the_control_socket_is_private(tmp_path: Path) -> None:
    control = tmp_path / "control.sock"
    with old_server(control):
        assert os.stat(control).st_mode & 0o777 == 0o600


async def tls_connect(port: int, ca: trustme.CA) -> LineClient:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    stream = trio.SSLStream(
        await trio.open_tcp_stream("127.0.0.1", port), context, server_hostname="127.0.0.1"
    )
    await stream.do_handshake()
    return LineClient(stream)  # type: ignore[arg-type]


async def test_tls_connections_close_and_their_sessions_wait_in_grace(
    tmp_path: Path, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    """A TLS stream cannot move: its connection closes at the hand-over, its word
    session waits out its grace on the successor, and conn_id takes it back there;
    a plain terse hold of a TLS client is freed as at any disconnect."""
    control = tmp_path / "control.sock"
    tls = ("--tls-cert", tls_files["cert"], "--tls-key", tls_files["key"])
    with old_server(control, *tls) as (old, port):
        worker = await tls_connect(port, ca)
        assert await ask(worker, b"set_timeout 30000") == b"200 timeout set\r\n"
        assert await ask(worker, b"lock nightly") == b"200 Acquired\r\n"
        session_id = (await ask(worker, b"conn_id"))[4:].strip()
        plain = await tls_connect(port, ca)
        assert await ask(plain, b"g terse-key") == b"1 Got Lock\r\n"
        new = await trio.to_thread.run_sync(lambda: take_over(control, *tls))
        try:
            assert await wait_exit(old, 10) == 0
            with pytest.raises((EOFError, trio.BrokenResourceError)):
                await ask(worker, b"ping")
            back = await tls_connect(port, ca)
            assert await ask(back, b"i terse-key") == b"0 Not Locked\r\n"
            assert await ask(back, b"conn_id " + session_id) == b"200 conn id set\r\n"
            assert (await ask(back, b"info nightly")).startswith(b"200 key=nightly exclusive=")
            assert await ask(back, b"unlock nightly") == b"200 Unlocked\r\n"
        finally:
            stop_server(new)


async def test_a_handed_over_session_can_still_be_taken_over_by_conn_id(tmp_path: Path) -> None:
    control = tmp_path / "control.sock"
    with old_server(control) as (old, port):
        worker, session_id = await resumable_hold(port, b"nightly")
        new = await trio.to_thread.run_sync(lambda: take_over(control))
        try:
            assert await wait_exit(old, 10) == 0
            back = await take_back(worker, port, session_id)
            assert await ask(back, b"unlock nightly") == b"200 Unlocked\r\n"
        finally:
            stop_server(new)


async def elockctl_upgrade(
    control: Path, *flags: str, notify: Path | None = None
) -> trio.CompletedProcess[bytes]:
    """``elockctl upgrade CONTROL -- FLAGS``, its output captured. Its stderr goes to
    a file, not a pipe: the new elockd inherits it and outlives elockctl."""
    env = {**os.environ, "NOTIFY_SOCKET": str(notify)} if notify else None
    with tempfile.TemporaryFile() as errors:
        done = await trio.run_process(
            [sys.executable, "-m", "elockd.ctl", "upgrade", str(control), "--", *flags],
            capture_stdout=True,
            stderr=errors,
            check=False,
            env=env,
        )
        errors.seek(0)
        done.stderr = errors.read()
    return done


def took_over_pid(upgrade: trio.CompletedProcess[bytes]) -> int:
    found = re.search(rb"elockd pid (\d+) took over", upgrade.stdout)
    assert found is not None, (upgrade.stdout, upgrade.stderr)
    return int(found[1])


async def test_elockctl_upgrade_starts_the_successor_and_tells_systemd(tmp_path: Path) -> None:
    control = tmp_path / "control.sock"
    with (
        old_server(control) as (old, port),
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd,
    ):
        systemd.bind(str(tmp_path / "notify"))
        holder = await connect(port)
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        # The default --metrics-port is not bound: the HTTP port is the old one's
        # (none here), so a busy 9998 does not matter.
        upgrade = await elockctl_upgrade(control, notify=tmp_path / "notify")
        assert upgrade.returncode == 0, upgrade.stderr
        pids = [took_over_pid(upgrade)]
        try:
            assert await wait_exit(old, 10) == 0
            systemd.settimeout(5)
            told = systemd.recv(4096).split(b"\n")
            assert f"MAINPID={pids[0]}".encode() in told and b"READY=1" in told
            assert await ask(holder, b"i k1") == b"1 Locked\r\n"
            # The successor listens on the control socket in turn.
            again = await elockctl_upgrade(control, "--control-socket", str(control))
            assert again.returncode == 0, again.stderr
            pids.append(took_over_pid(again))
            assert await ask(holder, b"i k1") == b"1 Locked\r\n"
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


async def test_elockctl_upgrade_reports_a_successor_that_cannot_start(tmp_path: Path) -> None:
    control = tmp_path / "control.sock"
    with old_server(control) as (old, port):
        holder = await connect(port)
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        upgrade = await elockctl_upgrade(control, "--max-connections", "nonsense")
        assert upgrade.returncode == 3, upgrade.stderr
        assert b"the old one serves on" in upgrade.stderr
        assert await ask(holder, b"i k1") == b"1 Locked\r\n"
        assert old.poll() is None


async def crowd_holding_a_lock_each(port: int, count: int = 1000) -> list[trio.SocketStream]:
    """``count`` connections, the N-th holding ``crowd-N``."""
    crowd = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(count)]
    for index, stream in enumerate(crowd):
        await stream.send_all(b"g crowd-%d\n" % index)
    for stream in crowd:
        assert await stream.receive_some(100) == b"1 Got Lock\r\n"
    return crowd


async def take_over_under_probe(
    control: Path, old: subprocess.Popen[str], port: int, log: list[str]
) -> tuple[subprocess.Popen[str], Probe]:
    """A successor takes ``old`` over (which must exit 0) while a probe does g/r every
    5 ms: the successor, and the probe, whose longest round trip is the pause
    clients saw."""
    async with latency_probe(port) as probe:
        await trio.sleep(0.2)
        new = await trio.to_thread.run_sync(lambda: take_over(control, log=log))
        try:
            assert await wait_exit(old, 10) == 0
            await trio.sleep(0.2)
        except BaseException:
            stop_server(new)
            raise
    return new, probe


@pytest.mark.serial
async def test_the_pause_with_a_thousand_connections_stays_under_100_ms(tmp_path: Path) -> None:
    """1,000 connections each holding a lock, and a probe doing g/r every 5 ms: the
    longest round trip across the hand-over is the pause clients see."""
    control = tmp_path / "control.sock"
    old_log: list[str] = []
    with old_server(control, "--max-connections", "2000", log=old_log) as (old, port):
        crowd = await crowd_holding_a_lock_each(port)
        new_log: list[str] = []
        new, probe = await take_over_under_probe(control, old, port, new_log)
        try:
            fresh = await connect(port)
            assert await ask(fresh, b"i crowd-999") == b"1 Locked\r\n"
            await crowd[999].send_all(b"r crowd-999\n")  # the same connection, carried
            assert await crowd[999].receive_some(100) == b"1 Released Lock\r\n"
        finally:
            stop_server(new)
    print(f"probe worst {probe.worst * 1000:.1f} ms over {probe.count} round trips")
    print("".join(line for line in old_log + new_log if "took over" in line or "PHASE" in line))
    assert probe.worst < 0.1, probe.worst
