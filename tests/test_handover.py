"""Zero-downtime upgrade: a second elockd takes every connection and lock over from
the first (docs/upgrade.md), against real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from tests.conftest import LineClient
from tests.server_process import start_server, stop_server

FAKE_SUCCESSOR = str(Path(__file__).with_name("fake_successor.py"))


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
        await trio.sleep(0.1)  # let it queue (checked below through q)
        errors: list[bytes] = []
        rounds = 0
        stop = trio.Event()

        async def loop() -> None:
            nonlocal rounds
            while not stop.is_set():
                for line, good in (
                    (b"g loop", b"1 Got Lock\r\n"),
                    (b"r loop", b"1 Released Lock\r\n"),
                ):
                    reply = await ask(looper, line)
                    if reply != good:
                        errors.append(reply)
                rounds += 1

        new_log: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loop)
            await trio.sleep(0.2)
            started = trio.current_time()
            new = await trio.to_thread.run_sync(lambda: take_over(control, log=new_log))
            try:
                assert await wait_exit(old, 10) == 0
                took = trio.current_time() - started
                before = rounds
                await trio.sleep(0.3)
                stop.set()
            except BaseException:
                stop_server(new)
                raise
        try:
            assert errors == [] and rounds > before, (errors, rounds, before)
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
            await fresh.send(b"q\n")
            counters = {}
            while (line := await fresh.line()) != b"END\r\n":
                name, _, value = line.strip().partition(b": ")
                counters[name] = value
            assert counters[b"handovers"] == b"1"
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
        fake = await trio.run_process(
            [sys.executable, FAKE_SUCCESSOR, str(control), "wrong-version"],
            capture_stdout=True,
            check=False,
        )
        assert fake.returncode == 0, fake.stdout
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
        fake = await trio.run_process(
            [sys.executable, FAKE_SUCCESSOR, str(control), how],
            capture_stdout=True,
            check=False,
        )
        assert fake.returncode == 0, fake.stdout
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
