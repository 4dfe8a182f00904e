"""The deadline gate on a cluster node, without etcd (docs/cluster.md, "What is
guaranteed"): a reply about a hold is checked against the node's local lease
deadline after the last await of its request, so an etcd answer that came just
before a process pause is never sent after it as a hold.

The pause is simulated on trio's MockClock: the etcd read returns, then the clock
moves past the deadline before the reply is made (as a SIGSTOP between the two
would), and the node's deadline timer has not run (as after a SIGCONT, when the
first thing the loop runs may be the reply). The requests go through the real
command table, service and ``answered`` of the server loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
import trio.testing

from elockd.backend.cluster.etcd.client import EtcdClient, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, entry_value
from elockd.backend.cluster.lease import lease_deadline
from elockd.backend.cluster.space import ClusterLockSpace
from elockd.engine.watchers import SYNCED
from elockd.net.serving import answered
from elockd.protocol.commands import COMMANDS
from elockd.protocol.config import Config
from elockd.protocol.connection import TERSE, WORD, Connection, Outcome, Reports, Service, Streamed
from tests.test_cluster_deadline import put

TTL = 5


def node() -> tuple[ClusterLockSpace, Connection]:
    """A node with a lease just renewed, and a client connection to it."""
    space = ClusterLockSpace(EtcdClient(["http://127.0.0.1:9"]), b"/t/", session_ttl=TTL)
    space.lease.renewed(7, trio.current_time(), TTL)
    return space, Connection(Service(Config(), space, COMMANDS), b"peer")


async def reply_to(conn: Connection, line: bytes) -> bytes:
    """The whole reply, made as the server makes it (net/serving.py)."""
    reply = conn.handle(line, trio.current_time())
    if isinstance(reply, Outcome):
        reply = await answered(reply, Reports())
    if isinstance(reply, Streamed):
        return reply.whole()
    assert isinstance(reply, bytes)
    return reply


def etcd_at(space: ClusterLockSpace, ahead: int = 0) -> None:
    """etcd answers ``ls``'s read of its revision: the node's copy's, plus ``ahead``
    revisions its watch has not brought (a stalled watch)."""

    async def revision(key: bytes) -> int:
        return space.mirror.revision + ahead

    space.calls.revision = revision  # type: ignore[method-assign]


def paused_read(space: ClusterLockSpace) -> None:
    """``info``'s etcd reads answer that another client holds ``k`` (token from
    revision 10); then the process stops until past the node's deadline."""
    head = KeyValue(space.layout.entry(EXCLUSIVE, b"k", 3), entry_value(1, None, b"o"), 10, 10, 9)

    async def describe(key: bytes) -> tuple[KeyValue | None, int, int]:
        answer = (head, 0, 0)  # etcd has answered ...
        await trio.sleep_until(space.lease.deadline + 1.0)  # ... and the node is paused
        return answer

    space.recipe.describe = describe  # type: ignore[method-assign]


async def test_info_answered_before_a_pause_is_not_sent_after_it(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The defect: ``info`` awaited its etcd reads, then formatted ``200 key=…
    token=…`` after the node had passed its deadline (another node may have granted
    the key meanwhile). Now it is the refusal; so are ``i`` and ``si``."""
    space, conn = node()
    paused_read(space)
    assert await reply_to(conn, b"info k") == WORD.unavailable
    space.lease.renewed(8, trio.current_time(), TTL)
    paused_read(space)
    assert await reply_to(conn, b"i k") == TERSE.unavailable
    space.lease.renewed(9, trio.current_time(), TTL)
    paused_read(space)
    assert await reply_to(conn, b"si k") == TERSE.unavailable
    await space.client.aclose()


async def test_info_read_before_a_loss_is_not_sent_on_the_new_lease(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The pause outlasts the lease; on resume the node loses its sessions and gets
    a new lease before the reply to ``info`` (read before the pause) is made. The
    node has a lease within its deadline again, but not the one the read was made
    under: the reply is the refusal. A request read after the loss is answered."""
    space, conn = node()
    head = KeyValue(space.layout.entry(EXCLUSIVE, b"k", 3), entry_value(1, None, b"o"), 10, 10, 9)

    async def describe(key: bytes) -> tuple[KeyValue | None, int, int]:
        answer = (head, 0, 0)  # etcd has answered ...
        if space.lease.id == 7:
            await trio.sleep_until(space.lease.deadline + 1.0)  # ... the node is paused,
            space.lease.check_expiry()  # its timer loses the sessions on resume,
            space.lease.renewed(8, trio.current_time(), TTL)  # and etcd grants a new lease
        return answer

    space.recipe.describe = describe  # type: ignore[method-assign]
    assert await reply_to(conn, b"info k") == WORD.unavailable
    await trio.sleep(0.1)
    assert (await reply_to(conn, b"info k")).startswith(b"200 key=k exclusive=o ")
    await space.client.aclose()


async def test_info_without_a_pause_is_answered(mock_clock: trio.testing.MockClock) -> None:
    """The same read, no pause: the hold is described (the gate passes)."""
    space, conn = node()
    head = KeyValue(space.layout.entry(EXCLUSIVE, b"k", 3), entry_value(1, None, b"o"), 10, 10, 9)

    async def describe(key: bytes) -> tuple[KeyValue | None, int, int]:
        await trio.sleep(0.1)
        return head, 0, 0

    space.recipe.describe = describe  # type: ignore[method-assign]
    assert (await reply_to(conn, b"info k")).startswith(b"200 key=k exclusive=o ")
    await space.client.aclose()


async def test_ls_past_the_deadline_says_so(mock_clock: trio.testing.MockClock) -> None:
    """``ls`` reads the node's copy of the queues; on a node past its deadline (cut
    from etcd, its copy frozen) it answers the refusal, not the rows; and it stays
    refused while the node has no new lease."""
    space, conn = node()
    etcd_at(space)
    space.mirror.apply([put(b"k", 3, 10)])
    listed = await reply_to(conn, b"ls")
    assert listed.startswith(b"k exclusive=o ") and listed.endswith(b"END\r\n")
    await trio.sleep_until(lease_deadline(0, TTL))
    assert await reply_to(conn, b"ls") == WORD.unavailable
    assert space.lease.id == 0  # the sessions were lost with the lease
    assert await reply_to(conn, b"ls") == WORD.unavailable
    await trio.sleep(0.01)  # a request read after the loss ...
    space.lease.renewed(8, trio.current_time(), TTL)  # ... once etcd answers again
    assert (await reply_to(conn, b"ls")).startswith(b"k exclusive=o ")
    await space.client.aclose()


async def test_ls_on_a_node_whose_watch_stalled_says_so(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A node whose lease lives but whose watch stalled (on a paused etcd member)
    has a copy that stopped moving: ``ls`` asks etcd's revision first and waits for
    the copy to reach it, so it answers the refusal after ``--etcd-timeout``, not
    rows another node may have changed meanwhile."""
    space, conn = node()
    space.mirror.apply([put(b"k", 3, 10)])
    etcd_at(space, ahead=3)
    asked = trio.current_time()
    assert await reply_to(conn, b"ls") == WORD.unavailable
    assert trio.current_time() - asked == space.calls.deadline
    etcd_at(space)  # the watch caught up
    assert (await reply_to(conn, b"ls")).startswith(b"k exclusive=o ")
    await space.client.aclose()


async def test_a_dump_that_goes_stale_while_it_is_sent_ends_with_the_refusal(
    mock_clock: trio.testing.MockClock,
) -> None:
    """``d`` is sent a chunk at a time: the rows sent before the deadline stand, and
    the chunk made after it is the refusal in place of the rest, then ``END`` (so a
    client reading up to ``END`` stays in step)."""
    space, conn = node()
    keys = [b"key%06d" % n for n in range(6000)]  # three chunks of 32 KiB, and more

    def rows() -> Iterator[tuple[bytes, bytes, bytes]]:
        for n, key in enumerate(keys):
            if n == 4000:
                space.lease.deadline = trio.current_time()  # paused here, say
            yield key, b"o", b"peer"

    async def holders(kind: bytes, key: bytes | None) -> Iterator[tuple[bytes, bytes, bytes]]:
        return rows()

    space.recipe.holders = holders  # type: ignore[method-assign]
    reply = await reply_to(conn, b"d")
    assert reply.startswith(b"key000000: o\r\n")
    assert reply.endswith(b"\r\n" + TERSE.unavailable + b"END\r\n")
    assert b"key005999" not in reply
    await space.client.aclose()


async def test_watch_past_the_deadline_is_refused(mock_clock: trio.testing.MockClock) -> None:
    """A ``watch`` asked of a node past its deadline is refused, and its connection
    ends (it is not left a silent stream); before it, the snapshot comes."""
    space, conn = node()
    space.mirror.apply([put(b"k", 3, 10)])
    assert (await reply_to(conn, b"watch")).endswith(SYNCED)
    assert not conn.closing
    other = Connection(conn.service, b"other")
    await trio.sleep_until(lease_deadline(0, TTL))
    assert await reply_to(other, b"watch") == WORD.unavailable
    assert other.closing
    await space.client.aclose()


async def test_a_watcher_is_woken_when_the_lease_is_lost(
    mock_clock: trio.testing.MockClock,
) -> None:
    """An idle watcher has nothing to send: the node wakes it when its lease goes,
    so that its stream says so (the drainer asks the gate) rather than stay silent."""
    space, conn = node()
    await reply_to(conn, b"watch")
    watcher = conn.watcher
    assert watcher is not None
    woken: list[str] = []
    watcher.wake = lambda: woken.append("woken")
    space.lease.gone("test")
    assert woken == ["woken"]
    assert space.lease.cannot_vouch(trio.current_time())
    await space.client.aclose()
