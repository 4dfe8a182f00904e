"""A cluster ``kill`` racing a node's own slow requests (docs/cluster.md, "An
operator's kill"): a grant whose entry the kill's acknowledgement already deleted is
not given, a takeover that read an entry before it was marked does not erase the
mark, and a value made of marks reads as malformed, not as a crash."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from elockd.backend.cluster.etcd.client import Event, KeyValue, put_op
from elockd.backend.cluster.layout import (
    EXCLUSIVE,
    KILLED_MARK,
    encode_record,
    entry_value,
    killed_value,
    parse_entry_value,
)
from elockd.backend.cluster.records import SessionRecord
from elockd.backend.interface import BackendUnavailable
from tests.test_cluster_deadline import delete, put
from tests.test_cluster_kill import A_LEASE, HOLDER_TAG, Scene

#: A range read's answer: (revision, the keys, their count).
Read = tuple[int, list[KeyValue], int]


async def test_a_grant_whose_entry_went_before_its_answer_is_not_given(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The txn that entered the queue committed at revision 10; its answer was slow,
    and meanwhile the node's watch brought the entry, a kill's mark and the node's
    own acknowledgement (the delete). Past revision 10 with no such entry, the
    grant is not given: another node may already hold the key."""
    scene = Scene(EXCLUSIVE)
    try:
        recipe, mirror, layout = scene.b.recipe, scene.b.mirror, scene.b.layout
        entry = layout.entry(EXCLUSIVE, b"j", 3)
        assert not recipe._revoked([entry], 10**6)  # the mirror is not there yet
        mirror.apply([put(b"j", 3, 10**6)])
        assert not recipe._revoked([entry], 10**6)  # its own entry, unmarked
        mirror.apply([delete(b"j", 3, 10**6 + 2)])
        assert recipe._revoked([entry], 10**6)  # gone: the answer came too late
    finally:
        await scene.aclose()


async def test_a_takeover_that_read_before_a_kill_does_not_erase_its_mark(
    mock_clock: trio.testing.MockClock,
) -> None:
    """B takes over the holder's session (its node A is gone) and reads K's queue;
    before B's move txn, an operator's kill marks the hold. The move must not put
    the value B read (unmarked) back: it fails, the mark stays, and the entry still
    goes with A's lease."""
    scene = Scene(EXCLUSIVE)
    record = encode_record(SessionRecord("node-a", False, 0, HOLDER_TAG))
    scene.etcd.put(scene.b.layout.session_record(scene.holder.id), record, A_LEASE)
    read = scene.etcd.get
    marked: list[int] = []

    async def read_then_kill(key: bytes, *args: Any, **kwargs: Any) -> Read:
        answer = await read(key, *args, **kwargs)
        if not marked and any(kv.key == scene.holder_entry for kv in answer[1]):
            held = scene.etcd.kvs[scene.holder_entry]
            mark = put_op(held.key, killed_value(held.value), ignore_lease=True)
            marked.append((await scene.etcd.txn([], [mark])).revision)
        return answer

    scene.b.calls.get = read_then_kill  # type: ignore[method-assign]
    taken: list[object] = []
    try:
        async with trio.open_nursery() as nursery:
            scene.run_loops(nursery)
            await scene.settle()
            current = scene.b.ledger.open_session("c" * 32, b"10.0.0.2:2")

            async def take_over() -> None:
                try:
                    taken.append(await scene.b.takeover.take_over(scene.holder.id, current))
                except Exception as error:
                    taken.append(error)

            nursery.start_soon(take_over)
            await scene.settle()
            assert marked, "the kill did not land between the read and the move"
            kv = scene.etcd.kvs[scene.holder_entry]
            assert parse_entry_value(kv.value).killed, "the takeover erased the kill's mark"
            assert kv.lease == A_LEASE
            # The move failed (its guard saw the mark): the session is not taken over.
            assert taken and (taken[0] is None or isinstance(taken[0], BackendUnavailable))
            nursery.cancel_scope.cancel()
    finally:
        await scene.aclose()


def test_a_value_of_many_marks_reads_as_malformed_not_as_a_crash() -> None:
    """Something else under the prefix wrote a value of 5,000 marks: one mark is
    read, the rest is malformed (a held entry that blocks), and nothing recurses."""
    value = parse_entry_value(KILLED_MARK * 5000 + entry_value(1, None, b"o"))
    assert value.killed and value.held and value.owner == b"?"


async def test_a_reload_acknowledges_only_a_mark_on_the_hold_it_drops(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A node that reloads its copy finds its holder's entry re-created since (a
    later revision, no mark): the hold is dropped as gone, and that entry, which no
    kill marked, is not deleted as if it were an acknowledgement."""
    scene = Scene(EXCLUSIVE)
    try:
        again = entry_value(1, None, b"holder")
        scene.etcd.kvs.pop(scene.holder_entry)
        scene.etcd.put(scene.holder_entry, again, A_LEASE)
        recreated = scene.etcd.kvs[scene.holder_entry]
        scene.a.mirror.apply([Event("PUT", recreated)])  # what a reload would show
        scene.a.operators.drop_vanished()
        assert scene.a.operators.acks == []
        assert not scene.a_confirms()
    finally:
        await scene.aclose()
