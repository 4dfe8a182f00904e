"""What a cluster node's mirror reports held, without etcd: the holds each revision
began and ended (``watch``), why each went, when each began (``ls`` ages), and the
ordered names ``ls`` reads (docs/cluster.md, "Operators on a cluster")."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import trio

from elockd.backend.cluster.etcd.client import Event, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, entry_value, parse_entry_value
from elockd.backend.cluster.mirror import Freed, Granted, QueueMirror
from tests.support.cluster_nodes import Nodes
from tests.support.line_client import LineClient
from tests.support.polling import eventually, until_waiting
from tests.test_cluster_mirror import LAYOUT, NODE_LEASE, delete


def put(
    kind: bytes, key: bytes, tag: int, revision: int, limit: int = 1, *, at: float = 0.0
) -> Event:
    value = entry_value(limit, None, b"o%d" % tag, peer=b"10.0.0.1:%d" % tag, at=at or None)
    kv = KeyValue(LAYOUT.entry(kind, key, tag), value, revision, revision, NODE_LEASE)
    return Event("PUT", kv)


def mark(key: bytes, tag: int, revision: int, marked_at: int, *, at: float) -> Event:
    value = entry_value(2, None, b"o%d" % tag, held=True, peer=b"10.0.0.1:1", at=at)
    kv = KeyValue(LAYOUT.entry(SHARED, key, tag), value, revision, marked_at, NODE_LEASE)
    return Event("PUT", kv)


def other(key: bytes, revision: int, value: bytes = b"", *, gone: bool = False) -> Event:
    return Event("DELETE" if gone else "PUT", KeyValue(key, value, revision, revision, 0))


class Heard:
    """The mirror's reports as compact lines: ``+ kind key tag n`` / ``- ... why``."""

    def __init__(self, mirror: QueueMirror) -> None:
        self.lines: list[str] = []
        mirror.on_changes = self.changed

    def changed(self, freed: list[Freed], granted: list[Granted]) -> None:
        for (kind, key), entry, left, why in freed:
            self.lines.append(f"- {kind.decode()} {key.decode()} {entry.tag} {left} {why.decode()}")
        for (kind, key), entry, holders in granted:
            self.lines.append(f"+ {kind.decode()} {key.decode()} {entry.tag} {holders}")

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


def test_exclusive_grants_and_frees_in_revision_order_with_their_reasons() -> None:
    mirror = QueueMirror(LAYOUT)
    heard = Heard(mirror)
    mirror.apply([put(EXCLUSIVE, b"k", 1, 10), put(EXCLUSIVE, b"k", 2, 11)])
    assert heard.take() == ["+ x k 1 1"]
    # Another node's unlock: released; the waiter is granted in the same revision.
    mirror.apply([delete(EXCLUSIVE, b"k", 1, 12), put(EXCLUSIVE, b"k", 3, 13)])
    assert heard.take() == ["- x k 1 0 released", "+ x k 2 1"]
    # A session record deleted in the same revision: the session ended.
    mirror.apply([delete(EXCLUSIVE, b"k", 2, 14), other(LAYOUT.sessions + b"ab", 14, gone=True)])
    assert heard.take() == ["- x k 2 0 orphaned", "+ x k 3 1"]
    # This node said why before deleting.
    mirror.freeing(LAYOUT.entry(EXCLUSIVE, b"k", 3), 13, b"expired")
    mirror.apply([put(EXCLUSIVE, b"k", 4, 15), delete(EXCLUSIVE, b"k", 3, 16)])
    assert heard.take() == ["- x k 3 0 expired", "+ x k 4 1"]
    # A kill names its entries in the same revision, whatever this node said.
    entry = LAYOUT.entry(EXCLUSIVE, b"k", 4)
    mirror.freeing(entry, 15, b"released")
    mirror.apply([other(LAYOUT.killed, 17, entry), delete(EXCLUSIVE, b"k", 4, 17)])
    assert heard.take() == ["- x k 4 0 killed"]
    assert not mirror._why  # every reason said is used up


def test_an_mlock_holds_only_once_it_heads_every_queue() -> None:
    mirror = QueueMirror(LAYOUT)
    heard = Heard(mirror)
    mirror.apply([put(EXCLUSIVE, b"b", 1, 10)])
    mirror.apply([put(EXCLUSIVE, b"a", 2, 11), put(EXCLUSIVE, b"b", 2, 11)])
    assert heard.take() == ["+ x b 1 1"]  # 2 heads a, but waits for b
    assert not mirror.queues[(EXCLUSIVE, b"a")].head().holding
    mirror.apply([delete(EXCLUSIVE, b"b", 1, 12)])
    assert heard.take() == ["- x b 1 0 released", "+ x a 2 1", "+ x b 2 1"]
    # Killing one of its keys leaves it holding the other.
    killed = LAYOUT.entry(EXCLUSIVE, b"a", 2)
    mirror.apply([other(LAYOUT.killed, 13, killed), delete(EXCLUSIVE, b"a", 2, 13)])
    assert heard.take() == ["- x a 2 0 killed"]
    assert mirror.queues[(EXCLUSIVE, b"b")].head().holding


def test_shared_holders_count_up_and_down_and_a_limited_one_holds_at_its_mark() -> None:
    mirror = QueueMirror(LAYOUT)
    heard = Heard(mirror)
    mirror.apply([put(SHARED, b"s", 1, 10, 0, at=1000.0)])
    mirror.apply([put(SHARED, b"s", 2, 11, 0)])
    mirror.apply([put(SHARED, b"s", 3, 12, 2)])  # limit 2: waits for its mark
    assert heard.take() == ["+ s s 1 1", "+ s s 2 2"]
    mirror.apply([delete(SHARED, b"s", 2, 13)])
    mirror.apply([mark(b"s", 3, 12, 14, at=1010.0)])
    assert heard.take() == ["- s s 2 1 released", "+ s s 3 2"]
    queue = mirror.queues[(SHARED, b"s")]
    assert queue.holding == 2
    # Ages count from the write that made each hold: the request, or the mark.
    assert [e.since for e in queue.in_order()] == [1000.0, 1010.0]
    mirror.apply([delete(SHARED, b"s", 1, 15), delete(SHARED, b"s", 3, 15)])
    assert heard.take() == ["- s s 1 1 released", "- s s 3 0 released"]


def test_a_waiter_granted_later_is_aged_from_when_the_mirror_saw_it_hold() -> None:
    mirror = QueueMirror(LAYOUT)
    clock = [2000.0]
    mirror.wall = lambda: clock[0]
    mirror.apply([put(EXCLUSIVE, b"k", 1, 10, at=1990.0), put(EXCLUSIVE, b"k", 2, 11, at=1995.0)])
    assert mirror.queues[(EXCLUSIVE, b"k")].head().since == 1990.0
    clock[0] = 2005.0
    mirror.apply([delete(EXCLUSIVE, b"k", 1, 12)])
    assert mirror.queues[(EXCLUSIVE, b"k")].head().since == 2005.0
    # A rename keeps what was reported, and since when.
    renamed = Event(
        "PUT",
        KeyValue(
            LAYOUT.entry(EXCLUSIVE, b"k", 2), entry_value(1, None, b"new"), 11, 13, NODE_LEASE
        ),
    )
    heard = Heard(mirror)
    mirror.apply([renamed])
    head = mirror.queues[(EXCLUSIVE, b"k")].head()
    assert heard.take() == [] and head.holding and head.since == 2005.0 and head.owner == b"new"
    # A reload ages holds from their entries' writes, and reports nothing.
    mirror.load(20, [put(EXCLUSIVE, b"k", 2, 11, at=1995.0).kv])
    assert heard.take() == [] and mirror.queues[(EXCLUSIVE, b"k")].head().since == 1995.0


def test_names_are_kept_in_byte_order_while_either_queue_of_a_key_has_entries() -> None:
    mirror = QueueMirror(LAYOUT)
    mirror.apply([put(EXCLUSIVE, b"j/b", 1, 10), put(SHARED, b"j/b", 1, 10, 0)])
    mirror.apply([put(SHARED, b"j/a", 2, 11, 0), put(EXCLUSIVE, b"x", 2, 11)])
    assert list(mirror.names.ordered) == [b"j/a", b"j/b", b"x"]
    assert [k for batch in mirror.names.starting_with(b"j/") for k in batch] == [b"j/a", b"j/b"]
    mirror.apply([delete(EXCLUSIVE, b"j/b", 1, 12)])
    assert list(mirror.names.ordered) == [b"j/a", b"j/b", b"x"]  # its shared queue is left
    mirror.apply([delete(SHARED, b"j/b", 1, 13), delete(SHARED, b"j/a", 2, 13)])
    assert list(mirror.names.ordered) == [b"x"] and not mirror.names.stale


def test_the_write_time_rides_on_the_address() -> None:
    value = entry_value(0, 5.0, b"my owner", rank=3, peer=b"[::1]:80", at=1795441005.5)
    parsed = parse_entry_value(value)
    assert (parsed.peer, parsed.at, parsed.owner, parsed.rank, parsed.ttl) == (
        b"[::1]:80",
        1795441005.5,
        b"my owner",
        3,
        5.0,
    )
    assert parse_entry_value(entry_value(0, None, b"o", peer=b"unix")).at is None


# ------------------------------------------------------------------ two nodes


@pytest.mark.cluster
async def test_two_nodes_watch_list_and_kill_across_each_other(
    nodes: Nodes, tmp_path: Path
) -> None:
    """A watcher on A hears what is done through B, in revision order; a kill through
    A evicts B's holder (its ``token`` 403 by the time anyone else is granted) and
    B's waiter gets a larger token;
    ``ls`` on either node lists the keys held through both."""
    admin_file = tmp_path / "admin"
    admin_file.write_text("op-token\n")
    a = nodes.start("--admin-token-file", str(admin_file))
    b = nodes.start("--admin-token-file", str(admin_file))
    watcher = await a.connect()
    await watcher.send(b"watch j/\n")
    assert await watcher.line() == b"200 Watching\r\n"
    assert await watcher.line() == b"SYNCED\r\n"
    bee, next_bee, ada = await b.connect(), await b.connect(), await a.connect()
    assert await bee.request(b"iam bee") == b"1 ok"
    assert await next_bee.request(b"iam next") == b"1 ok"
    assert await ada.request(b"iam ada") == b"1 ok"
    assert await bee.request(b"lock j/x") == b"200 Acquired"
    killed = int((await bee.request(b"token j/x"))[4:])
    assert await bee.request(b"lock_shared j/s") == b"200 1"
    assert await ada.request(b"lock j/y") == b"200 Acquired"
    ada_token = int((await ada.request(b"token j/y"))[4:])
    await next_bee.send(b"lock j/x 30\n")
    await until_waiting(bee, b"j/x")
    listing = [
        [b"j/s", b"exclusive=-", b"shared=1", b"waiting=0"],
        [b"j/x", b"exclusive=bee", b"shared=0", b"waiting=1"],
        [b"j/y", b"exclusive=ada", b"shared=0", b"waiting=0"],
    ]

    async def listed_on(client: LineClient) -> list[bytes] | None:
        # ls waits for the node's copy to reach etcd's revision, so what was done
        # through the other node shows at once; polled all the same.
        listed = (await client.listing(b"ls j/")).split(b"\r\n")
        return listed if [line.split(b" ")[:4] for line in listed[:-2]] == listing else None

    for node in (a, b):
        client = await node.connect()
        listed = await eventually(functools.partial(listed_on, client), what="ls j/ on each node")
        assert [line.split(b" ")[:5] for line in listed[:-2]] == [
            [b"j/s", b"exclusive=-", b"shared=1", b"waiting=0", listed[0].split(b" ")[4]],
            [b"j/x", b"exclusive=bee", b"shared=0", b"waiting=1", listed[1].split(b" ")[4]],
            [b"j/y", b"exclusive=ada", b"shared=0", b"waiting=0", listed[2].split(b" ")[4]],
        ]
        ages = [float(line.split(b" ")[4][4:]) for line in listed[:-2]]
        assert ages[0] <= ages[1] + 0.5 and all(0 <= age < 30 for age in ages)
    admin = await a.connect()
    assert await admin.request(b"auth op-token") == b"200 OK"
    assert await admin.request(b"kill j/x") == b"200 Killed 1"
    assert await next_bee.line() == b"200 Acquired\r\n"
    next_token = int((await next_bee.request(b"token j/x"))[4:])
    assert next_token > killed
    # B dropped the hold before it let the entry go: no window with two holders.
    assert await bee.request(b"token j/x") == b"403 Not Locked"
    assert await bee.request(b"unlock j/x") == b"403 Not Locked"
    assert await bee.request(b"unlock_shared j/s") == b"200 0"
    expected = [
        b"+ j/x exclusive bee token=%d\r\n" % killed,
        b"+ j/s shared bee holders=1\r\n",
        b"+ j/y exclusive ada token=%d\r\n" % ada_token,
        b"- j/x exclusive bee killed\r\n",
        b"+ j/x exclusive next token=%d\r\n" % next_token,
        b"- j/s shared bee holders=0 released\r\n",
    ]
    with trio.fail_after(10):
        assert [await watcher.line() for _ in expected] == expected
    assert (await admin.stats())["killed"] == 1
    assert any("killed by an operator" in line for line in b.log)
