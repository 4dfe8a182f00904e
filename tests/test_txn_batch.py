"""Group commit (elockd/backend/cluster/etcd/batch.py) against a fake etcd: what shares a
batch, what is sent alone, and that every txn gets its own answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from elockd.backend.cluster.etcd.batch import (
    MAX_TXN_OPS,
    Footprint,
    Queued,
    TxnBatcher,
    batches_in_flight,
    ops_needed,
)
from elockd.backend.cluster.etcd.client import (
    EtcdError,
    EtcdUnavailable,
    compare_create,
    compare_mod,
    delete_op,
    prefix_end,
    put_op,
    range_op,
    txn_op,
)
from elockd.backend.cluster.tokens import TOKENS_PER_REVISION, RankCounter


def txn(
    compare: list[dict[str, Any]],
    success: list[dict[str, Any]],
    failure: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {"compare": compare, "success": success, "failure": failure or []}


def acquire(key: bytes, session: bytes) -> dict[str, Any]:
    """What a node's try-lock sends: "if the queue is empty, enter it"."""
    queue = b"q/x/" + key + b"/"
    entry = queue + session
    return txn(
        [compare_create(queue, "==", 0, prefix_end(queue))],
        [put_op(entry, b"1")],
        [range_op(queue, prefix_end(queue), limit=1)],
    )


def release(key: bytes, session: bytes) -> dict[str, Any]:
    """What a node's release sends: the entry's delete under the session's guard."""
    queue = b"q/x/" + key + b"/"
    entry = queue + session
    read = range_op(queue, prefix_end(queue))
    return txn(
        [compare_mod(b"s/" + session, "==", 7)],
        [txn_op([compare_create(entry, "==", 5)], [delete_op(entry)]), read],
        [read],
    )


def record(session: bytes) -> dict[str, Any]:
    key = b"s/" + session
    return txn([compare_create(key, "==", 0)], [put_op(key, b"n")], [range_op(key)])


def share_a_batch(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return not Footprint(first).clashes(Footprint(second))


# ------------------------------------------------------------------ footprints


def test_txns_on_different_locks_and_sessions_share_a_batch() -> None:
    assert share_a_batch(acquire(b"A", b"1"), acquire(b"B", b"2"))
    assert share_a_batch(release(b"A", b"1"), acquire(b"B", b"2"))
    assert share_a_batch(record(b"1"), record(b"2"))
    assert share_a_batch(record(b"1"), acquire(b"A", b"1"))  # reads no record


def test_txns_on_one_queue_or_one_record_do_not() -> None:
    # Two entries in one queue would share a create revision, their queue order.
    assert not share_a_batch(acquire(b"A", b"1"), acquire(b"A", b"2"))
    # The release deletes what the acquire's compare reads, either way round.
    assert not share_a_batch(release(b"A", b"1"), acquire(b"A", b"2"))
    assert not share_a_batch(acquire(b"A", b"2"), release(b"A", b"1"))
    # The record write changes what the release's guard compares.
    assert not share_a_batch(record(b"1"), release(b"B", b"1"))
    assert not share_a_batch(record(b"1"), record(b"1"))


def test_a_ranged_delete_clashes_with_every_key_in_its_range() -> None:
    wipe = txn([], [delete_op(b"q/", prefix_end(b"q/"))])
    assert not share_a_batch(wipe, acquire(b"A", b"1"))
    assert not share_a_batch(acquire(b"A", b"1"), wipe)
    assert share_a_batch(wipe, record(b"1"))
    everything = txn([], [delete_op(b"a", b"\0")])  # to the end of the keyspace
    assert not share_a_batch(everything, record(b"1"))
    assert share_a_batch(everything, txn([compare_create(b"0", "==", 0)], []))


def test_ops_needed_counts_along_the_nesting_path() -> None:
    assert ops_needed(record(b"1")) == 1
    assert ops_needed(release(b"A", b"1")) == 2 + 1  # two ops, then the nested delete
    keys = [b"k%d" % i for i in range(40)]
    deletes = [txn_op([compare_create(key, "==", 1)], [delete_op(key)]) for key in keys]
    assert ops_needed(txn([], deletes)) == 40 + 1


def test_a_quarter_of_the_window_carries_batches() -> None:
    assert batches_in_flight(16) == 4
    assert batches_in_flight(1) == 1


# ------------------------------------------------------------------ batching


class FakeEtcd:
    """Answers each post with a txn reply; a batch gets one nested answer per txn,
    each telling which txn it answers. Holds every post until ``release``d."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.gate = trio.Event()
        self.refuse: set[str] = set()  # txns (by their put's key) etcd refuses
        self.fail_batches_with: Exception | None = None

    async def send(self, payload: bytes) -> dict[str, Any]:
        body = json.loads(payload)
        self.posts.append(body)
        await self.gate.wait()
        nested = [op["request_txn"] for op in body["success"] if "request_txn" in op]
        if nested and self.fail_batches_with is not None:
            raise self.fail_batches_with
        if not nested:
            if self.name(body) in self.refuse:
                raise EtcdError(3, "refused")
            return {"header": {"revision": "9"}, "succeeded": True, "responses": [self.name(body)]}
        if any(self.name(one) in self.refuse for one in nested):
            raise EtcdError(3, "refused")
        return {
            "header": {"revision": "10"},
            "succeeded": True,
            "responses": [
                {"response_txn": {"succeeded": True, "responses": [self.name(one)]}}
                for one in nested
            ],
        }

    @staticmethod
    def name(body: dict[str, Any]) -> str:
        return str(body["success"][0]["request_put"]["key"])

    def sizes(self) -> list[int]:
        """Txns per post, in order (1 for a txn sent alone)."""
        return [sum(1 for op in post["success"] if "request_txn" in op) or 1 for post in self.posts]


def put_txn(key: bytes) -> dict[str, Any]:
    return txn([], [put_op(key, b"v")])


def queued(body: dict[str, Any]) -> Queued:
    return Queued(body, json.dumps(body).encode())


def batcher(etcd: FakeEtcd, in_flight: int = 1) -> TxnBatcher:
    """A batcher told the lock layer's rank rule, as a cluster node runs one."""
    return TxnBatcher(
        etcd.send,
        alone_on=(EtcdError,),
        unanswered=lambda: EtcdUnavailable("cut off"),
        in_flight=in_flight,
        max_ranks=TOKENS_PER_REVISION,
    )


async def submit_all(
    nursery: trio.Nursery, into: TxnBatcher, bodies: list[dict[str, Any]]
) -> list[Queued]:
    """Submit each body from a task of its own, in order."""
    items = [queued(body) for body in bodies]
    for item in items:
        nursery.start_soon(into.submit, item)
        await trio.testing.wait_all_tasks_blocked()
    return items


async def send_all(
    etcd: FakeEtcd, sender: TxnBatcher, bodies: list[dict[str, Any]]
) -> list[Queued]:
    """Run the batcher, submit ``bodies`` in order (the first goes out alone and is
    held in flight until all are queued), then let etcd answer them all."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.run)
        items = await submit_all(nursery, sender, bodies)
        etcd.gate.set()
        with trio.fail_after(5):
            for item in items:
                await item.done.wait()
        nursery.cancel_scope.cancel()
    return items


async def test_txns_that_arrive_while_one_is_in_flight_go_as_one_batch() -> None:
    etcd = FakeEtcd()
    sender = batcher(etcd)
    items = await send_all(etcd, sender, [put_txn(b"k%d" % i) for i in range(5)])
    # The first alone, as a plain txn; the four that came meanwhile in one batch.
    assert etcd.sizes() == [1, 4]
    assert "request_put" in etcd.posts[0]["success"][0]
    names = [FakeEtcd.name(put_txn(b"k%d" % i)) for i in range(5)]
    for item, name in zip(items, names, strict=True):
        assert item.error is None and item.reply is not None
        assert item.reply["responses"] == [name]  # its own answer, in its place
    assert [item.reply["header"]["revision"] for item in items if item.reply] == ["9"] + ["10"] * 4
    assert (sender.batches, sender.batched) == (1, 4)


async def test_a_clashing_txn_ends_the_batch_and_nothing_overtakes_it() -> None:
    etcd = FakeEtcd()
    sender = batcher(etcd)
    bodies = [
        put_txn(b"first"),  # in flight while the rest arrive
        acquire(b"A", b"1"),
        acquire(b"B", b"2"),
        acquire(b"A", b"3"),  # same queue as the second: the next batch
        acquire(b"C", b"4"),  # clashes with nothing, yet waits behind the third
    ]
    await send_all(etcd, sender, bodies)
    assert etcd.sizes() == [1, 2, 2]
    second = [FakeEtcd.name(one["request_txn"]) for one in etcd.posts[2]["success"]]
    assert second == [FakeEtcd.name(bodies[3]), FakeEtcd.name(bodies[4])]


async def test_a_batch_keeps_under_etcds_operation_limit() -> None:
    etcd = FakeEtcd()
    sender = batcher(etcd)
    items = await send_all(etcd, sender, [put_txn(b"k%d" % i) for i in range(1 + 200)])
    # Each nested put txn needs 1: 1 + n <= 128 holds for n up to 127 txns.
    assert etcd.sizes() == [1, MAX_TXN_OPS - 1, 200 - (MAX_TXN_OPS - 1)]
    assert all(item.reply is not None for item in items)


async def test_a_batch_etcd_refuses_is_sent_again_one_txn_at_a_time() -> None:
    etcd = FakeEtcd()
    sender = batcher(etcd)
    bodies = [put_txn(b"first"), put_txn(b"good"), put_txn(b"bad"), put_txn(b"fine")]
    etcd.refuse.add(FakeEtcd.name(bodies[2]))
    items = await send_all(etcd, sender, bodies)
    assert etcd.sizes() == [1, 3, 1, 1, 1]
    assert [item.error is None for item in items] == [True, True, False, True]
    assert isinstance(items[2].error, EtcdError)


async def test_etcd_not_answering_fails_the_whole_batch() -> None:
    etcd = FakeEtcd()
    etcd.fail_batches_with = EtcdUnavailable("no quorum")
    sender = batcher(etcd)
    items = await send_all(etcd, sender, [put_txn(b"k%d" % i) for i in range(3)])
    assert etcd.sizes() == [1, 2]
    assert items[0].error is None
    assert all(isinstance(item.error, EtcdUnavailable) for item in items[1:])


async def test_a_txn_withdrawn_before_its_batch_is_never_sent() -> None:
    etcd = FakeEtcd()
    sender = batcher(etcd)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.run)
        (first,) = await submit_all(nursery, sender, [put_txn(b"first")])  # in flight
        waiting = trio.CancelScope()

        async def give_up() -> None:
            with waiting:
                await sender.submit(queued(put_txn(b"withdrawn")))

        nursery.start_soon(give_up)
        await trio.testing.wait_all_tasks_blocked()
        waiting.cancel()
        (kept,) = await submit_all(nursery, sender, [put_txn(b"kept")])
        etcd.gate.set()
        with trio.fail_after(5):
            await first.done.wait()
            await kept.done.wait()
        nursery.cancel_scope.cancel()
    assert etcd.posts == [put_txn(b"first"), put_txn(b"kept")]


async def test_txns_still_queued_when_the_batcher_stops_come_back_unsent() -> None:
    etcd = FakeEtcd()
    sender = batcher(etcd)
    async with trio.open_nursery() as nursery:
        running = trio.CancelScope()

        async def run() -> None:
            with running:
                await sender.run()

        nursery.start_soon(run)
        in_flight, waiting = await submit_all(nursery, sender, [put_txn(b"a"), put_txn(b"b")])
        running.cancel()
        with trio.fail_after(5):
            await in_flight.done.wait()
            await waiting.done.wait()
        nursery.cancel_scope.cancel()
    assert sender.running is False
    # The one in flight was cut off (its fate unknown); the queued one never left,
    # and its caller sends it alone.
    assert isinstance(in_flight.error, EtcdUnavailable) and in_flight.reply is None
    assert waiting.error is None and waiting.reply is None
    assert len(etcd.posts) == 1


@pytest.mark.parametrize("in_flight", [1, 2])
async def test_at_most_in_flight_batches_at_once(in_flight: int) -> None:
    etcd = FakeEtcd()
    sender = batcher(etcd, in_flight)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.run)
        items = await submit_all(nursery, sender, [put_txn(b"k%d" % i) for i in range(6)])
        assert len(etcd.posts) == in_flight  # the rest wait, gathered, for a place
        etcd.gate.set()
        with trio.fail_after(5):
            for item in items:
                await item.done.wait()
        nursery.cancel_scope.cancel()
    assert sum(etcd.sizes()) == 6
    assert len(etcd.posts) == in_flight + 1


async def test_a_batch_takes_at_most_64_token_ranks_in_a_row() -> None:
    """Holds of one revision are told apart by their entries' ranks, which the node
    numbers round modulo 64 in the order it queues txns: a batch may span no more
    than 64 of them, counting those of txns withdrawn from its midst."""
    etcd = FakeEtcd()
    sender = batcher(etcd)
    ranked = [(b"first", 1), (b"a", 40), (b"gone", 20), (b"b", 4), (b"c", 1)]
    items = [
        Queued(body, json.dumps(body).encode(), ranks)
        for body, ranks in ((put_txn(name), ranks) for name, ranks in ranked)
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.run)
        for item in items:
            nursery.start_soon(sender.submit, item)
            await trio.testing.wait_all_tasks_blocked()
        items[2].withdrawn = True  # as a cancelled caller leaves it
        etcd.gate.set()
        with trio.fail_after(5):
            for item in items[:2] + items[3:]:
                await item.done.wait()
        nursery.cancel_scope.cancel()
    # a (40) + gone (20) + b (4) = 64 ranks in a row; c would be the 65th.
    assert etcd.sizes() == [1, 2, 1]
    assert etcd.posts[2] == put_txn(b"c")


def test_a_request_takes_consecutive_ranks_and_skips_rather_than_wraps() -> None:
    """An mlock's keys get consecutive ranks (so consecutive tokens) in byte order;
    near the end of the round it starts from 0, and the ranks skipped count as taken
    (a batch's 64 ranks in a row include them)."""
    counter = RankCounter()
    counter.next = 62
    assert counter.take([b"x"]) == ({b"x": 62}, 1)
    assert counter.take([b"b", b"a", b"c"]) == ({b"a": 0, b"b": 1, b"c": 2}, 1 + 3)
    assert counter.take([b"y"]) == ({b"y": 3}, 1)
    counter.next = 0
    everything = [b"k%02d" % i for i in range(64)]
    assert counter.take(everything) == ({key: i for i, key in enumerate(everything)}, 64)
    assert counter.next == 0
