"""A ``watch`` stream across a zero-downtime upgrade (docs/upgrade.md): the watcher
keeps its connection, and receives every event once, in order, with no gap."""

from __future__ import annotations

from pathlib import Path

import trio

from tests.support.line_client import LineClient
from tests.support.server_process import stop_server
from tests.test_handover import ask, connect, old_server, take_over, wait_exit


async def read_events(watcher: LineClient, into: list[bytes]) -> None:
    while True:
        line = await watcher.line()
        into.append(line)


async def test_a_watcher_moves_with_no_gap_and_no_duplicate(tmp_path: Path) -> None:
    control = tmp_path / "control.sock"
    with old_server(control) as (old, port):
        holder = await connect(port)
        assert await ask(holder, b"iam looper") == b"1 ok\r\n"
        assert await ask(holder, b"lock w/held") == b"200 Acquired\r\n"
        watcher = await connect(port)
        await watcher.send(b"watch w/\n")
        assert await watcher.line() == b"200 Watching\r\n"
        events = [await watcher.line(), await watcher.line()]  # the snapshot, SYNCED
        stop = trio.Event()
        rounds = 0
        rounds_at_exit = 0
        new = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_events, watcher, events)

            async def loop() -> None:
                nonlocal rounds
                while not stop.is_set():
                    assert await ask(holder, b"lock w/loop") == b"200 Acquired\r\n"
                    assert await ask(holder, b"unlock w/loop") == b"200 Unlocked\r\n"
                    rounds += 1

            nursery.start_soon(loop)
            await trio.sleep(0.3)
            new = await trio.to_thread.run_sync(lambda: take_over(control))
            try:
                assert await wait_exit(old, 10) == 0
                rounds_at_exit = rounds
                await trio.sleep(0.3)
                stop.set()
                await trio.sleep(0.1)
                with trio.fail_after(10):
                    while len(events) < 1 + 2 * rounds:
                        await trio.sleep(0.01)
                await trio.sleep(0.2)  # anything more would be a duplicate
                nursery.cancel_scope.cancel()
            except BaseException:
                stop_server(new)
                raise
        try:
            assert rounds > rounds_at_exit > 0
            assert events[0].startswith(b"+ w/held exclusive looper token=")
            assert events[1] == b"SYNCED\r\n"
            stream = events[2:]
            assert len(stream) == 2 * rounds, (len(stream), rounds)
            tokens = []
            for n in range(rounds):
                grant, free = stream[2 * n], stream[2 * n + 1]
                assert grant.startswith(b"+ w/loop exclusive looper token="), grant
                assert free == b"- w/loop exclusive looper released\r\n", free
                tokens.append(int(grant.split(b"token=")[1]))
            assert tokens == sorted(set(tokens))  # none twice, always growing
            # The same connection goes on streaming from the successor.
            assert await ask(holder, b"unlock w/held") == b"200 Unlocked\r\n"
            with trio.fail_after(5):
                assert await watcher.line() == b"- w/held exclusive looper released\r\n"
            assert (await (await connect(port)).stats())["handovers"] == 1
        finally:
            stop_server(new)


async def test_an_operators_mark_moves_only_to_a_successor_that_has_an_admin_token(
    tmp_path: Path,
) -> None:
    """An operator's connection keeps its mark across a hand-over to a successor with
    --admin-token-file (it may still `kill`), a plain one never gains it, and a
    successor started without the flag honours "without that flag `kill` is always
    403": the moved operator's mark is dropped."""
    admin_file = tmp_path / "admin"
    admin_file.write_bytes(b"admin-token\n")
    control = tmp_path / "control.sock"
    with old_server(control, "--admin-token-file", str(admin_file)) as (old, port):
        operator, plain, holder = [await connect(port) for _ in range(3)]
        assert await ask(operator, b"auth admin-token") == b"200 OK\r\n"
        assert await ask(holder, b"lock k") == b"200 Acquired\r\n"
        assert await ask(plain, b"kill k") == b"403 Forbidden\r\n"
        middle = await trio.to_thread.run_sync(
            lambda: take_over(control, "--admin-token-file", str(admin_file))
        )
        try:
            assert await wait_exit(old, 10) == 0
            assert await ask(plain, b"kill k") == b"403 Forbidden\r\n"
            assert await ask(operator, b"kill k") == b"200 Killed 1\r\n"
            assert await ask(holder, b"lock k") == b"200 Acquired\r\n"
            last = await trio.to_thread.run_sync(lambda: take_over(control))
        except BaseException:
            stop_server(middle)
            raise
        try:
            assert await wait_exit(middle, 10) == 0
            assert await ask(operator, b"kill k") == b"403 Forbidden\r\n"
            assert await ask(holder, b"token k") != b"403 Not Locked\r\n"
        finally:
            stop_server(last)
