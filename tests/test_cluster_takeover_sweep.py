"""A ``conn_id`` takeover against the node's stray sweep, with the sweep run exactly
between two of the takeover's move txns (docs/cluster.md, "Taking a session over").

A takeover moves a dead node's session entries onto this node's lease in guarded
txns of :data:`~elockd.backend.cluster.takeover.MOVES_PER_TXN`, and records the holds
only after the last. Between two of those txns, moved entries are on this node's
lease, their session is known by its tag, and no hold of it is recorded yet: to the
sweep they looked like strays of that session, and it deleted them (a fresh clone's
run once lost some of 150 taken-over holds that way). The nodes of the cluster tests
are separate processes, where that window is a matter of luck; here etcd is a script
and the sweep runs inside the window every time.

On the same scripted etcd: the sweep looks only at the sessions on the node's own
lease, and a round looks at a budget of entries, the next going on from there.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import pytest
import trio

from elockd.backend.cluster import node as node_module
from elockd.backend.cluster.etcd.client import EtcdClient, Event, KeyValue, TxnResult
from elockd.backend.cluster.layout import EXCLUSIVE, SessionRecord, encode_record, entry_value
from elockd.backend.cluster.ledger import ClusterSession
from elockd.backend.cluster.space import ClusterLockSpace
from elockd.backend.cluster.takeover import MOVES_PER_TXN

OLD_LEASE, NEW_LEASE, TAG = 3, 7, 0x2A
SESSION_ID = "d" * 32
KEYS = [b"job-%03d" % n for n in range(MOVES_PER_TXN + 10)]  # two move txns


def decoded(field: str) -> bytes:
    return base64.b64decode(field)


class ScriptedEtcd:
    """Stands in for etcd under one node: answers the takeover's reads from what the
    old node left, commits every txn, shows each write to the node's mirror as its
    watch would, and runs the node's sweep once, right after the first move txn."""

    def __init__(self, space: ClusterLockSpace) -> None:
        self.space = space
        self.revision = 1000
        self.entries: dict[bytes, KeyValue] = {}
        self.deleted: list[bytes] = []
        self.moves = 0
        self.swept_between_moves = False

    def leave_old_session(self) -> None:
        """What the old node left: the session's record, and one held entry per key,
        all on the old node's lease."""
        self.space.mirror.apply([self.entry(key, TAG, OLD_LEASE) for key in KEYS])

    def entry(self, key: bytes, tag: int, lease: int) -> Event:
        """A held entry of session ``tag`` on ``lease``, in etcd now; the watch event
        that shows it (for :meth:`show`)."""
        self.revision += 1
        etcd_key = self.space.layout.entry(EXCLUSIVE, key, tag)
        value = entry_value(1, None, b"worker")
        kv = KeyValue(etcd_key, value, self.revision, self.revision, lease)
        self.entries[kv.key] = kv
        return Event("PUT", kv)

    async def get(
        self, key: bytes, range_end: bytes | None = None, *, sort_by_create: bool = False
    ) -> tuple[int, list[KeyValue], int]:
        layout = self.space.layout
        if key == layout.session_record(SESSION_ID):
            record = encode_record(SessionRecord("gone-node", False, 0, TAG))
            return self.revision, [KeyValue(key, record, 900, 900, OLD_LEASE)], 0
        found = [kv for etcd_key, kv in self.entries.items() if etcd_key.startswith(key)]
        return self.revision, sorted(found, key=lambda kv: kv.create_revision), 0

    async def txn(
        self, _: object, success: Sequence[dict[str, Any]], *__: object, **___: object
    ) -> TxnResult:
        """Every txn commits (its compares and failure ops are not looked at)."""
        self.revision += 1
        events: list[Event] = []
        moved = False
        for op in success:
            if "request_put" in op:
                body = op["request_put"]
                key = decoded(body["key"])
                old = self.entries.get(key)
                created = old.create_revision if old is not None else self.revision
                kv = KeyValue(
                    key, decoded(body["value"]), created, self.revision, int(body.get("lease", 0))
                )
                moved |= old is not None and old.lease == OLD_LEASE
                if key.startswith(self.space.layout.queues):
                    self.entries[key] = kv
                events.append(Event("PUT", kv))
            for inner in [op, *op.get("request_txn", {}).get("success", [])]:
                if "request_delete_range" in inner:
                    key = decoded(inner["request_delete_range"]["key"])
                    if self.entries.pop(key, None) is not None:
                        self.deleted.append(key)
                        events.append(Event("DELETE", KeyValue(key, b"", 0, self.revision, 0)))
        # A heartbeat-like write, so the mirror's revision reaches this txn's.
        events.append(Event("PUT", KeyValue(b"/t/n/x", b"1", 1, self.revision, 9)))
        self.space.mirror.apply(events)
        if moved:
            self.moves += 1
            if self.moves == 1:
                await self.space.node._sweep()  # the window: moved, not yet held
                self.swept_between_moves = True
        return TxnResult(True, self.revision, [{} for _ in success])


def scripted_node() -> tuple[EtcdClient, ClusterLockSpace, ScriptedEtcd]:
    """A node on :data:`NEW_LEASE` whose etcd is a :class:`ScriptedEtcd`."""
    client = EtcdClient(["http://127.0.0.1:9"])  # never called: the script answers
    space = ClusterLockSpace(client, b"/t/", session_ttl=5)
    etcd = ScriptedEtcd(space)
    space.calls.get = etcd.get  # type: ignore[method-assign]
    space.calls.txn = etcd.txn  # type: ignore[method-assign, assignment]
    space.lease.renewed(NEW_LEASE, trio.current_time(), 5)
    return client, space, etcd


async def test_the_sweep_between_two_move_txns_leaves_the_takeover_whole() -> None:
    client, space, etcd = scripted_node()
    etcd.leave_old_session()

    current = space.ledger.open_session("c" * 32, b"peer")
    taken = await space.takeover.take_over(SESSION_ID, current)

    assert etcd.swept_between_moves and etcd.moves == 2
    assert etcd.deleted == [], f"the sweep deleted {len(etcd.deleted)} taken-over entries"
    assert isinstance(taken, ClusterSession)
    assert sorted(hold.key for hold in space.ledger.holds(taken)) == KEYS
    assert all(kv.lease == NEW_LEASE for kv in etcd.entries.values())
    # Once the holds are recorded the sweep has nothing of the session to free.
    await space.node._sweep()
    assert etcd.deleted == []
    await client.aclose()


async def test_the_sweep_reads_only_the_sessions_on_the_nodes_lease() -> None:
    """Every node sees every session of the cluster; its sweep looks only at those
    with entries on its own lease (it walked them all: about a second of the node's
    thread a keepalive round at a million entries). A stray on its lease is still freed."""
    client, space, etcd = scripted_node()
    others = [etcd.entry(b"other-%d" % tag, tag, OLD_LEASE) for tag in range(1, 1001)]
    stray = etcd.entry(b"left-behind", 5000, NEW_LEASE)
    space.mirror.apply([*others, stray])
    looked: list[int] = []
    entries_on = space.mirror.entries_on

    def counted(tag: int, lease: int) -> list[tuple[bytes, int]]:
        looked.append(tag)
        return entries_on(tag, lease)

    space.mirror.entries_on = counted  # type: ignore[method-assign]
    await space.node._sweep()
    assert looked == [5000]
    assert etcd.deleted == [stray.kv.key]
    await client.aclose()


async def test_a_round_of_the_sweep_looks_at_a_budget_of_entries_then_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node whose own lease holds more entries than a round's budget is swept over
    several rounds, each where the last stopped, until every stray is freed."""
    monkeypatch.setattr(node_module, "SWEEP_BUDGET", 10)
    client, space, etcd = scripted_node()
    # 30 strays of sessions this node no longer has.
    strays = [etcd.entry(b"stray-%d" % tag, tag, NEW_LEASE) for tag in range(1, 31)]
    space.mirror.apply(strays)
    freed_each_round = []
    while etcd.entries:
        before = len(etcd.deleted)
        await space.node._sweep()
        freed_each_round.append(len(etcd.deleted) - before)
    assert freed_each_round == [5, 5, 5, 5, 5, 5]  # 2 of the budget each: a tag, an entry
    assert sorted(etcd.deleted) == sorted(e.kv.key for e in strays)
    await client.aclose()
