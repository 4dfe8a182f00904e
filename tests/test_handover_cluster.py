"""Zero-downtime upgrade of a cluster node (docs/upgrade.md): the locks stay in
etcd, and the successor takes over the listeners, the connections, the node's
identity and its sessions' leases, against real processes and a real etcd."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.support.cluster_nodes import TEST_SESSION_TTL, Nodes
from tests.support.polling import eventually, until_waiting
from tests.support.server_process import stop_server
from tests.test_handover import (
    FAKE_SUCCESSOR,
    GetReleaseLoop,
    ask,
    connect,
    old_server,
    resumable_hold,
    take_back,
    take_over,
    wait_exit,
)

pytestmark = pytest.mark.cluster


async def test_a_successor_node_takes_every_connection_and_session_over(
    nodes: Nodes, tmp_path: Path
) -> None:
    """The issue's "done when" on a cluster node: holds, two queued waiters in FIFO
    order, a lease with its token, a name, a client looping through the hand-over,
    new connections; the old exits 0, and another node sees the locks held
    throughout. Longer than the session TTL, so the successor must keep the
    sessions' leases alive."""
    control = tmp_path / "control.sock"
    old_log: list[str] = []
    other = nodes.start()
    with old_server(control, *nodes.flags(), log=old_log) as (old, port):
        holder, first, second, leaser, named, looper = [await connect(port) for _ in range(6)]
        watcher = await other.connect()
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        assert await ask(named, b"iam nightly-backup") == b"1 ok\r\n"
        assert await ask(named, b"lock job") == b"200 Acquired\r\n"
        assert await ask(leaser, b"lock lease ttl=30") == b"200 Acquired\r\n"
        token_before = await ask(leaser, b"token lease")
        await first.send(b"lock k1 30\n")
        await until_waiting(watcher, b"k1", 1)
        await second.send(b"lock k1 30\n")
        await until_waiting(watcher, b"k1", 2)
        loop = GetReleaseLoop(looper)
        new_log: list[str] = []

        def successor() -> subprocess.Popen[str]:
            return take_over(control, *nodes.flags(), log=new_log)

        # Past two session TTLs after it: only the successor keeps the leases alive.
        new, took = await loop.across(successor, old, 2.5 * TEST_SESSION_TTL)
        try:
            assert loop.errors == [] and loop.rounds > loop.rounds_at_exit, loop
            print(f"hand-over took {took:.2f} s, {loop.rounds} g/r rounds, errors {loop.errors}")
            assert took < 5, f"the hand-over took {took:.2f} s"
            # Every lock is still held, as the other node sees it too.
            assert await ask(watcher, b"g k1") == b"0 Cannot Get Lock\r\n"
            assert await ask(watcher, b"g job") == b"0 Cannot Get Lock\r\n"
            assert await ask(holder, b"i k1") == b"1 Locked\r\n"
            assert await ask(leaser, b"token lease") == token_before
            assert await ask(leaser, b"renew lease ttl=60") == b"200 Renewed\r\n"
            assert b"exclusive=nightly-backup" in await ask(named, b"info job")
            # The waiters are granted in their order when the holder releases.
            assert await ask(holder, b"r k1") == b"1 Released Lock\r\n"
            with trio.fail_after(5):
                assert await first.line() == b"200 Acquired\r\n"
            assert await ask(first, b"unlock k1") == b"200 Unlocked\r\n"
            with trio.fail_after(5):
                assert await second.line() == b"200 Acquired\r\n"
            # New connections are served by the new process, which counted it all.
            fresh = await connect(port)
            found = await fresh.stats()
            assert found["handovers"] == 1
            assert found["sessions_lost"] == 0
            assert any("handed over" in line for line in old_log), old_log
            assert any("took over from pid" in line for line in new_log), new_log
            # A client that leaves still frees its locks at once.
            await holder.stream.aclose()
            await second.stream.aclose()

            async def freed() -> bool:
                return await watcher.request(b"g k1") == b"1 Got Lock"

            await eventually(freed, timeout=5)
        finally:
            stop_server(new)


@pytest.mark.parametrize("how", ["vanish-after-state", "never-ready"])
async def test_a_failed_successor_leaves_the_node_serving_with_every_wait_in_place(
    nodes: Nodes, tmp_path: Path, how: str
) -> None:
    """The old node thaws: its waiters keep their place in etcd's queues and are
    granted in order, and its holds and sessions carry on."""
    control = tmp_path / "control.sock"
    log: list[str] = []
    with old_server(control, *nodes.flags(), "--handover-timeout", "1", log=log) as (old, port):
        holder, first, second = [await connect(port) for _ in range(3)]
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        await first.send(b"lock k1 30\n")
        await until_waiting(holder, b"k1", 1)
        await second.send(b"lock k1 30\n")
        await until_waiting(holder, b"k1", 2)
        fake = await trio.lowlevel.open_process(
            [sys.executable, FAKE_SUCCESSOR, str(control), how], stdout=subprocess.PIPE
        )
        assert fake.stdout is not None
        output = b""
        with trio.fail_after(10):
            if how == "never-ready":
                while b"state received" not in output:
                    output += await fake.stdout.receive_some()
                # A request behind the wait, sent while the node is paused: the wait's
                # task ends, the wait stays, and the node waits on for it after.
                await first.send(b"ping\n")
            while chunk := await fake.stdout.receive_some():
                output += chunk
            assert await fake.wait() == 0, output
        assert old.poll() is None
        # The node may log it a moment after the successor is gone, and its log
        # reaches the test through a pipe.
        await eventually(
            lambda: any("hand-over failed" in line for line in log), what="hand-over failed"
        )
        assert await ask(holder, b"r k1") == b"1 Released Lock\r\n"
        with trio.fail_after(5):
            assert await first.line() == b"200 Acquired\r\n"
        if how == "never-ready":
            assert await first.line() == b"200 PONG\r\n"
        assert await ask(first, b"unlock k1") == b"200 Unlocked\r\n"
        with trio.fail_after(5):
            assert await second.line() == b"200 Acquired\r\n"
        assert (await holder.stats())["sessions_lost"] == 0


async def test_a_handed_over_node_session_can_be_taken_back_by_conn_id(
    nodes: Nodes, tmp_path: Path
) -> None:
    """A word session in grace after the hand-over is taken back with conn_id on the
    successor: its record's revision (the guard of every free) came along."""
    control = tmp_path / "control.sock"
    with old_server(control, *nodes.flags()) as (old, port):
        worker, session_id = await resumable_hold(port, b"nightly")
        new = await trio.to_thread.run_sync(lambda: take_over(control, *nodes.flags()))
        try:
            assert await wait_exit(old, 10) == 0
            back = await take_back(worker, port, session_id)
            assert await ask(back, b"unlock nightly") == b"200 Unlocked\r\n"
            assert await ask(back, b"lock nightly") == b"200 Acquired\r\n"
        finally:
            stop_server(new)


async def test_a_successor_without_etcd_is_refused_by_a_node(nodes: Nodes, tmp_path: Path) -> None:
    """Tables of one backend cannot become another's: the successor says why and
    exits, and the node serves on."""
    control = tmp_path / "control.sock"
    with old_server(control, *nodes.flags()) as (old, port):
        holder = await connect(port)
        assert await ask(holder, b"g k1") == b"1 Got Lock\r\n"
        result = await trio.run_process(
            [sys.executable, "-m", "elockd", "--take-over", str(control)],
            capture_stderr=True,
            check=False,
        )
        assert result.returncode != 0
        assert b"--etcd" in result.stderr, result.stderr
        assert old.poll() is None
        assert await ask(holder, b"i k1") == b"1 Locked\r\n"


async def test_waits_of_every_kind_move_with_the_requests_behind_them(
    nodes: Nodes, tmp_path: Path
) -> None:
    """A shared wait with a limit, an mlock wait, an exclusive wait with requests
    pipelined behind it (one of them still unread), and a waiter that leaves on the
    successor: each ends as it would have on the old node."""
    control = tmp_path / "control.sock"
    with old_server(control, *nodes.flags()) as (old, port):
        one, two, shared_waiter, holder, mlocker, piper, leaver = [
            await connect(port) for _ in range(7)
        ]
        for count, client in enumerate((one, two), 1):
            assert await ask(client, b"lock_shared p 0 limit=2") == b"200 %d\r\n" % count
        await shared_waiter.send(b"lock_shared p 30 limit=2\n")
        await until_waiting(holder, b"p")
        assert await ask(holder, b"lock b") == b"200 Acquired\r\n"
        await mlocker.send(b"mlock a b wait=6\n")
        mlock_sent = trio.current_time()
        await until_waiting(holder, b"b")
        assert await ask(holder, b"lock k1") == b"200 Acquired\r\n"
        await piper.send(b"lock k1 30\nping\n")
        await leaver.send(b"lock k1 30\n")
        await until_waiting(holder, b"k1", 2)
        new = await trio.to_thread.run_sync(lambda: take_over(control, *nodes.flags()))
        try:
            assert await wait_exit(old, 10) == 0
            # The mlock's wait then ran out on the successor, not on the old node.
            assert trio.current_time() - mlock_sent < 6, "the hand-over outlasted the wait"
            await piper.send(b"ping\n")  # after the hand-over, behind the waiting lock
            with trio.fail_after(10):
                assert await mlocker.line() == b"409 Unavailable b\r\n"
            # (its count may include the waiter it let in: not what is tested here)
            assert (await ask(one, b"unlock_shared p")).startswith(b"200 ")
            with trio.fail_after(5):
                assert await shared_waiter.line() == b"200 2\r\n"
            await leaver.stream.aclose()
            await until_waiting(holder, b"k1", 1)  # the successor cancelled its wait
            assert await ask(holder, b"unlock k1") == b"200 Unlocked\r\n"
            with trio.fail_after(5):
                assert [await piper.line() for _ in range(3)] == [
                    b"200 Acquired\r\n",
                    b"200 PONG\r\n",
                    b"200 PONG\r\n",
                ]
            assert (await holder.stats())["sessions_lost"] == 0
        finally:
            stop_server(new)
