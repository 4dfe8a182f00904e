"""A ``watch`` on a cluster node across the node's hand-over (docs/cluster.md,
"Operators on a cluster"; docs/upgrade.md): the watcher's connection moves to the
successor, which loads its mirror as of the revision the watcher had reached and
replays etcd's history from just after it. The stream is compared with the truth
as etcd itself records it: every grant and free of the prefix exactly once, in
revision order, with the holder and the fencing token, also for what changed
through another node while the first one was paused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from elockd.backend.cluster.etcd.client import EtcdClient, Event, prefix_end
from elockd.backend.cluster.layout import EXCLUSIVE, Layout, parse_entry_value
from elockd.backend.cluster.tokens import fencing_token
from elockd.engine.watchers import KILLED, RELEASED, free_line, grant_line
from elockd.handover.channel import Channel, ChannelError
from tests.support.cluster_nodes import Node, Nodes
from tests.support.line_client import LineClient
from tests.support.polling import eventually
from tests.support.server_process import stop_server
from tests.test_handover import FAKE_SUCCESSOR, ask, take_over, wait_exit

pytestmark = pytest.mark.cluster

WATCHED = b"w/"
#: Taken and freed last, through the other node: once its free reaches the
#: watcher, every event before it has (the stream is in revision order).
MARKER = b"w/~end"


# --------------------------------------------------------------------- truth


@dataclass
class Truth:
    """etcd's own record of the prefix, turned into the lines a watcher must get.

    The test takes only exclusive single-key locks, so the rule is short: the entry
    that heads its queue holds. A queue whose head changed in a revision freed the
    old head (in the order of the deletes) and granted the new one (by key), as
    the contract orders events within one revision. A free is ``killed`` when a
    kill marked the entry (or the revision wrote the kill marker naming it), else
    ``released`` (the test's sessions all live on)."""

    layout: Layout
    floor: int
    #: Per lock name: its entries, etcd key -> (create revision, value).
    queues: dict[bytes, dict[bytes, tuple[int, bytes]]] = field(default_factory=dict)
    lines: list[bytes] = field(default_factory=list)

    def head(self, key: bytes) -> tuple[bytes, int, bytes] | None:
        entries = self.queues.get(key)
        if not entries:
            return None
        etcd_key, (revision, value) = min(entries.items(), key=lambda item: item[1][0])
        return etcd_key, revision, value

    def revision(self, events: list[Event]) -> None:
        """The events of one revision."""
        before: dict[bytes, tuple[bytes, int, bytes] | None] = {}
        frees: list[bytes] = []
        killed = {
            name
            for event in events
            if event.type == "PUT" and event.kv.key == self.layout.killed
            for name in event.kv.value.split(b"\n")
        }
        for event in events:
            name = self.layout.parse_entry(event.kv.key)
            if name is None or name.kind != EXCLUSIVE or not name.key.startswith(WATCHED):
                continue
            if name.key not in before:
                before[name.key] = self.head(name.key)
            entries = self.queues.setdefault(name.key, {})
            if event.type == "DELETE":
                head = before[name.key]
                if head is not None and head[0] == event.kv.key and event.kv.key in entries:
                    value = parse_entry_value(head[2])
                    # Marked by a kill (then deleted by its node, or its lease
                    # lapsed), or deleted in the kill's own revision (older nodes).
                    why = KILLED if value.killed or event.kv.key in killed else RELEASED
                    owner = value.owner
                    frees.append(free_line(name.key, owner, False, 0, why))
                entries.pop(event.kv.key, None)
            else:
                entries[event.kv.key] = (event.kv.create_revision, event.kv.value)
        grants = []
        for key in sorted(before):
            head, old = self.head(key), before[key]
            if head is not None and (old is None or old[:2] != head[:2]):
                value = parse_entry_value(head[2])
                token = fencing_token(self.floor, head[1], value.rank)
                grants.append(grant_line(key, value.owner, False, token))
        self.lines += frees + grants


async def etcd_truth(nodes: Nodes, since: int) -> list[bytes]:
    """The watch lines of ``WATCHED`` from etcd's history after revision ``since``,
    up to the marker's free."""
    layout = Layout(nodes.prefix.encode())
    client = EtcdClient(nodes.etcd.endpoints)
    try:
        _, kvs, _ = await client.get(layout.token_floor)
        truth = Truth(layout, int(kvs[0].value))
        with trio.fail_after(10):
            async with client.watch(layout.root, prefix_end(layout.root), since + 1) as watch:
                async for batch in watch:
                    by_revision: dict[int, list[Event]] = {}
                    for event in batch:
                        by_revision.setdefault(event.kv.mod_revision, []).append(event)
                    for revision in sorted(by_revision):
                        truth.revision(by_revision[revision])
                    if any(line.startswith(b"- " + MARKER + b" ") for line in truth.lines):
                        return truth.lines
    finally:
        await client.aclose()
    raise AssertionError("unreachable")


async def current_revision(nodes: Nodes) -> int:
    client = EtcdClient(nodes.etcd.endpoints)
    try:
        revision, _, _ = await client.get(b"\0")
        return revision
    finally:
        await client.aclose()


# ------------------------------------------------------------------- clients


async def open_watch(node_port: int) -> LineClient:
    """A watcher of ``WATCHED`` on a node where nothing under it is held yet."""
    watcher = LineClient(await trio.open_tcp_stream("127.0.0.1", node_port))
    assert await ask(watcher, b"watch " + WATCHED) == b"200 Watching\r\n"
    assert await watcher.line() == b"SYNCED\r\n"  # an empty snapshot
    return watcher


async def read_until_marker(watcher: LineClient, into: list[bytes]) -> None:
    """Every line up to the marker's free (the watcher's connection stays open)."""
    with trio.fail_after(10):
        while True:
            line = await watcher.line()
            into.append(line)
            if line.startswith(b"- " + MARKER + b" "):
                return


async def marker(node: Node) -> None:
    client = await node.connect()
    assert await ask(client, b"lock " + MARKER) == b"200 Acquired\r\n"
    assert await ask(client, b"unlock " + MARKER) == b"200 Unlocked\r\n"


@dataclass
class Looper:
    """A client taking and freeing one key in a loop (waiting its turn if another
    client has it): every unexpected reply, and the rounds it made."""

    client: LineClient
    key: bytes
    errors: list[bytes] = field(default_factory=list)
    rounds: int = 0

    async def run(self, stop: trio.Event) -> None:
        while not stop.is_set():
            for line, good in (
                (b"lock %s 10" % self.key, b"200 Acquired\r\n"),
                (b"unlock %s" % self.key, b"200 Unlocked\r\n"),
            ):
                reply = await ask(self.client, line)
                if reply != good:
                    self.errors.append(reply)
            self.rounds += 1


async def ends_as_etcd_says(
    nodes: Nodes, other: Node, watcher: LineClient, seen: list[bytes], since: int, then: list[str]
) -> None:
    """Take and free the marker through ``other`` and read the watcher up to its
    free: after the lines already ``seen`` come ``then`` (sign and key, ``+ w/a``)
    and the marker's; and the whole stream is etcd's history since ``since``."""
    already = len(seen)
    await marker(other)
    await read_until_marker(watcher, seen)
    shown = [b" ".join(line.split(b" ", 2)[:2]).decode() for line in seen[already:]]
    assert shown == [*then, f"+ {MARKER.decode()}", f"- {MARKER.decode()}"], seen
    assert_same_stream(seen, await etcd_truth(nodes, since))


def assert_same_stream(seen: list[bytes], truth: list[bytes]) -> None:
    """The watcher's lines are etcd's, exactly: first difference named."""
    for number, (got, want) in enumerate(zip(seen, truth, strict=False)):
        assert got == want, f"line {number}: watcher {got!r}, etcd {want!r}"
    assert len(seen) == len(truth), (len(seen), len(truth), seen[-3:], truth[-3:])


# --------------------------------------------------------------------- tests


async def test_a_moved_watcher_gets_every_change_of_both_nodes_once_in_revision_order(
    nodes: Nodes, tmp_path: Path
) -> None:
    """Clients on the node and on another one take and free keys under the prefix
    (two of them contending for one key across the nodes) before, during and after
    the node's hand-over; the watcher's stream is etcd's history, line for line."""
    control = tmp_path / "control.sock"
    first = nodes.start("--control-socket", str(control))
    other = nodes.start()
    since = await current_revision(nodes)
    watcher = await open_watch(first.port)
    clients = [
        (first, b"w/a"),
        (first, b"w/both"),
        (first, b"x/outside"),  # not watched: must not show
        (other, b"w/b"),
        (other, b"w/both"),
    ]
    loopers = [Looper(await node.connect(), key) for node, key in clients]
    seen: list[bytes] = []
    stop = trio.Event()
    new: subprocess.Popen[str] | None = None
    try:
        async with trio.open_nursery() as nursery:
            for looper in loopers:
                nursery.start_soon(looper.run, stop)
            await trio.sleep(0.3)
            before = [looper.rounds for looper in loopers]
            new = await trio.to_thread.run_sync(
                lambda: take_over(control, *nodes.flags(), log=first.log)
            )
            assert await wait_exit(first.process, 10) == 0
            at_exit = [looper.rounds for looper in loopers]
            await trio.sleep(0.3)
            stop.set()
        after = [looper.rounds for looper in loopers]
        assert [looper.errors for looper in loopers] == [[]] * len(loopers)
        # Every client went on through the hand-over, before it and after it.
        assert all(0 < b < e < a for b, e, a in zip(before, at_exit, after, strict=True)), (
            before,
            at_exit,
            after,
        )
        await marker(other)
        await read_until_marker(watcher, seen)
        truth = await etcd_truth(nodes, since)
        print(f"{len(truth)} events, rounds {after}")
        assert_same_stream(seen, truth)
        # The clients' own count: a grant and a free per round of a watched key.
        assert len(truth) == 2 * (sum(after) - after[2]) + 2
        assert (await (await first.connect()).stats())["handovers"] == 1
    finally:
        if new is not None:
            stop_server(new)


class ReadyHeldBack:
    """A go-between on the control socket, between the successor and the old node:
    it passes every message on (with its descriptors) but holds the successor's
    ``ready`` back until :attr:`release` is set. Until then the old node is paused,
    its books frozen, its state sent: what happens in the cluster meanwhile is
    what a moved watcher must be told of by the successor."""

    def __init__(self, listen_at: Path, control: Path) -> None:
        self.listen_at, self.control = listen_at, control
        self.held = trio.Event()
        self.release = trio.Event()
        self.relayed: list[str] = []

    async def run(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.listen_at))
        listener.listen(1)
        listener.setblocking(False)
        try:
            await trio.lowlevel.wait_readable(listener)
            accepted, _ = listener.accept()
        finally:
            listener.close()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(str(self.control))
        successor, old = Channel(accepted), Channel(upstream)
        try:
            async with trio.open_nursery() as nursery:

                async def relay(source: Channel, sink: Channel) -> None:
                    await self._relay(source, sink)
                    nursery.cancel_scope.cancel()  # one side went: so does the other

                nursery.start_soon(relay, successor, old)
                nursery.start_soon(relay, old, successor)
        finally:
            successor.close()
            old.close()

    async def _relay(self, source: Channel, sink: Channel) -> None:
        while True:
            try:
                message, fds = await source.receive()
            except ChannelError:
                return
            try:
                self.relayed.append(str(message.get("t")))
                if message.get("t") == "ready":
                    self.held.set()
                    await self.release.wait()
                await sink.send(message, fds)
            except ChannelError:
                return
            finally:
                for fd in fds:
                    os.close(fd)


async def hand_over_paused(
    nodes: Nodes, first: Node, control: Path, during: Callable[[], Awaitable[None]]
) -> subprocess.Popen[str]:
    """Hand ``first`` (with ``--control-socket control``) over to a successor, and
    run ``during`` while it is paused, its state sent and the successor's
    ``ready`` held back; then let the hand-over finish. The successor, running."""
    proxy = ReadyHeldBack(control.with_name("between.sock"), control)
    new: subprocess.Popen[str] | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.run)

            async def successor() -> None:
                nonlocal new
                new = await trio.to_thread.run_sync(
                    lambda: take_over(proxy.listen_at, *nodes.flags(), log=first.log)
                )

            nursery.start_soon(successor)
            with trio.fail_after(10):
                await proxy.held.wait()
            await during()
            assert first.process.poll() is None  # still paused, waiting for ready
            proxy.release.set()
        assert "ready" in proxy.relayed and "go" in proxy.relayed, proxy.relayed
        assert await wait_exit(first.process, 10) == 0
    except BaseException:
        if new is not None:
            stop_server(new)
        raise
    assert new is not None
    return new


async def test_a_lock_taken_and_freed_elsewhere_during_the_pause_reaches_the_moved_watcher(
    nodes: Nodes, tmp_path: Path
) -> None:
    """While the node is paused for its hand-over (its state sent, the successor's
    ``ready`` held back), a lock is taken and freed through the other node, a
    lock held through it before is freed, and an operator kills a hold of the
    paused node: the old node's watch sees those revisions but must not send
    them, and the successor must (and drop the killed hold from its books). The
    moved watcher's first lines after the pause are those, once each, then what
    follows."""
    control = tmp_path / "control.sock"
    first = nodes.start("--control-socket", str(control))
    admin_file = tmp_path / "admin"
    admin_file.write_text("op-token\n")
    other = nodes.start("--admin-token-file", str(admin_file))
    since = await current_revision(nodes)
    watcher = await open_watch(first.port)
    here, there, admin = await first.connect(), await other.connect(), await other.connect()
    victim = await first.connect()
    assert await ask(admin, b"auth op-token") == b"200 OK\r\n"
    seen: list[bytes] = []
    # Before the pause: a hold through each node, one freed, one kept.
    assert await ask(here, b"lock w/before") == b"200 Acquired\r\n"
    assert await ask(here, b"unlock w/before") == b"200 Unlocked\r\n"
    assert await ask(there, b"lock w/kept") == b"200 Acquired\r\n"
    assert await ask(victim, b"lock w/victim") == b"200 Acquired\r\n"
    with trio.fail_after(5):
        seen += [await watcher.line() for _ in range(4)]
    assert [line.split(b" ", 2)[:2] for line in seen] == [
        [b"+", b"w/before"],
        [b"-", b"w/before"],
        [b"+", b"w/kept"],
        [b"+", b"w/victim"],
    ]

    async def elsewhere() -> None:
        await here.send(b"ping\n")  # waits out the pause
        assert await ask(there, b"lock w/paused") == b"200 Acquired\r\n"
        assert await ask(there, b"unlock w/paused") == b"200 Unlocked\r\n"
        assert await ask(there, b"unlock w/kept") == b"200 Unlocked\r\n"
        assert await ask(admin, b"kill w/victim") == b"200 Killed 1\r\n"
        # The old node's watch has had those revisions since etcd committed them.

    new = await hand_over_paused(nodes, first, control, elsewhere)
    try:
        with trio.fail_after(5):
            assert await here.line() == b"200 PONG\r\n"
        then = ["+ w/paused", "- w/paused", "- w/kept", "- w/victim"]
        await ends_as_etcd_says(nodes, other, watcher, seen, since, then)
        assert seen[-3].endswith(b" killed\r\n")
        # The successor dropped the killed hold: its session holds the key no more.
        assert (await ask(victim, b"token w/victim")).startswith(b"403 ")
        await eventually(
            lambda: any("(killed by an operator)" in line for line in first.log),
            what="the successor's log of the kill",
        )
    finally:
        stop_server(new)


async def test_a_compaction_during_the_pause_ends_the_moved_watch_with_overflow(
    nodes: Nodes, tmp_path: Path
) -> None:
    """etcd compacts past the revision the watcher had reached while the node is
    paused: the successor cannot replay, so the moved watcher gets ``OVERFLOW``
    and is closed, and a new watch starts from a fresh snapshot."""
    control = tmp_path / "control.sock"
    first = nodes.start("--control-socket", str(control))
    other = nodes.start()
    watcher = await open_watch(first.port)
    there = await other.connect()
    client = EtcdClient(nodes.etcd.endpoints)

    async def compacted() -> None:
        assert await ask(there, b"lock w/paused") == b"200 Acquired\r\n"
        revision = await current_revision(nodes)
        await client.call("kv/compaction", {"revision": str(revision), "physical": True})

    try:
        new = await hand_over_paused(nodes, first, control, compacted)
    finally:
        await client.aclose()
    try:
        with trio.fail_after(5):
            assert await watcher.line() == b"OVERFLOW\r\n"
            with pytest.raises(EOFError):
                await watcher.line()
        again = await first.connect()
        assert await ask(again, b"watch " + WATCHED) == b"200 Watching\r\n"
        assert (await again.line()).startswith(b"+ w/paused exclusive ")
        assert await again.line() == b"SYNCED\r\n"
        assert any("cannot replay the watch from revision" in line for line in first.log)
    finally:
        stop_server(new)


async def test_a_failed_hand_over_sends_what_was_held_back_once(
    nodes: Nodes, tmp_path: Path
) -> None:
    """The successor reads the state and never says ``ready``: the node thaws after
    ``--handover-timeout`` and sends its watcher what changed through the other
    node during the pause (a kill of its own hold among it), once, in order."""
    control = tmp_path / "control.sock"
    admin_file = tmp_path / "admin"
    admin_file.write_text("op-token\n")
    first = nodes.start("--control-socket", str(control), "--handover-timeout", "1")
    other = nodes.start("--admin-token-file", str(admin_file))
    since = await current_revision(nodes)
    watcher = await open_watch(first.port)
    victim, there, admin = await first.connect(), await other.connect(), await other.connect()
    assert await ask(admin, b"auth op-token") == b"200 OK\r\n"
    assert await ask(victim, b"lock w/victim") == b"200 Acquired\r\n"
    with trio.fail_after(5):
        seen = [await watcher.line()]
    assert seen[0].startswith(b"+ w/victim ")
    fake = await trio.lowlevel.open_process(
        [sys.executable, FAKE_SUCCESSOR, str(control), "never-ready"], stdout=subprocess.PIPE
    )
    assert fake.stdout is not None
    output = b""
    with trio.fail_after(10):
        while b"state received" not in output:
            output += await fake.stdout.receive_some()
        # The node is paused until it gives up on the successor.
        assert await ask(there, b"lock w/paused") == b"200 Acquired\r\n"
        assert await ask(there, b"unlock w/paused") == b"200 Unlocked\r\n"
        assert await ask(admin, b"kill w/victim") == b"200 Killed 1\r\n"
        while chunk := await fake.stdout.receive_some():
            output += chunk
        assert await fake.wait() == 0, output
    assert first.process.poll() is None
    then = ["+ w/paused", "- w/paused", "- w/victim"]
    await ends_as_etcd_says(nodes, other, watcher, seen, since, then)
    assert seen[-3].endswith(b" killed\r\n")
    assert (await ask(victim, b"token w/victim")).startswith(b"403 ")
