"""Group commit: txns waiting to be sent at the same time go to etcd as one.

Every acquire and release of a cluster node is an etcd txn, and each txn sent on its
own costs a gateway request, a raft entry and its share of an fsync. While a few
batches are in flight, the txns that arrive meanwhile wait in order; when a place
frees, as many of them as etcd allows go in one outer txn, each as a nested txn of
its own (etcd 3.3+), and each gets back its own answer: its ``succeeded``, its
responses, and the outer txn's revision.

etcd evaluates every compare of a txn, nested ones included, against the state
before the txn, and applies the operations in order. So txns share a batch only if
none of them writes a key another one reads, compares or writes (a queue's prefix
read by one acquire covers every entry another would put in that queue). Each txn
of a batch then sees exactly what it would have seen alone, and the batch is the
same as sending them one after another, in their order. A txn that would break
that, or etcd's limits (``--max-txn-ops`` 128, counted along every nesting path,
and the request size), ends the batch: it and every later one wait for the next,
so none overtakes another.

A txn that creates a queue entry reads its queue: entries in one queue never share
a batch, and so never share a create revision (their order in the queue). Entries of
different queues do. The user of this client tells apart the holds of one revision
by a *rank* it gives each new entry, counting round: each txn says how many ranks it
took (``ranks``), and a batch takes at most ``max_ranks`` of them in a row (the
lock layer's rule, passed in: this package knows nothing of fencing tokens).
"""

from __future__ import annotations

import base64
import bisect
import collections
from collections.abc import Awaitable, Callable
from typing import Any

import trio

#: etcd's default ``--max-txn-ops``: operations per txn, along every nesting path.
MAX_TXN_OPS = 128
#: Well under etcd's default ``--max-request-bytes`` (1.5 MiB).
MAX_BATCH_BYTES = 1024 * 1024


def batches_in_flight(window: int) -> int:
    """Batches in flight at once for a call window of ``window`` (--etcd-in-flight):
    a quarter of it. Fewer leave etcd idle between batches; more split the txns
    that arrive together into smaller batches (measured in docs/cluster.md)."""
    return max(1, window // 4)


Interval = tuple[bytes, bytes]  # [start, end); end b"" is the end of the keyspace


def _interval(body: dict[str, Any]) -> Interval:
    """The keys a range, delete or compare covers: one key, or ``[key, range_end)``."""
    key = base64.b64decode(body["key"])
    range_end = body.get("range_end")
    if range_end is None:
        return key, key + b"\0"
    end = base64.b64decode(range_end)
    return key, b"" if end == b"\0" else end


def _overlaps(one: Interval, other: Interval) -> bool:
    return (not other[1] or one[0] < other[1]) and (not one[1] or other[0] < one[1])


class Footprint:
    """What txns read (compares and ranges) and write (puts and deletes), in both
    branches, nested txns included: one txn's, or a whole batch's as it gathers.
    Points are kept sorted, so a test against a batch is a bisect."""

    __slots__ = ("read_points", "read_ranges", "write_points", "write_ranges")

    def __init__(self, txn: dict[str, Any] | None = None) -> None:
        self.read_points: list[bytes] = []
        self.read_ranges: list[Interval] = []
        self.write_points: list[bytes] = []
        self.write_ranges: list[Interval] = []
        if txn is not None:
            self._add_txn(txn)

    def _add_txn(self, txn: dict[str, Any]) -> None:
        for compare in txn.get("compare", ()):
            self._add(_interval(compare), write=False)
        for op in (*txn.get("success", ()), *txn.get("failure", ())):
            if "request_range" in op:
                self._add(_interval(op["request_range"]), write=False)
            elif "request_put" in op:
                bisect.insort(self.write_points, base64.b64decode(op["request_put"]["key"]))
            elif "request_delete_range" in op:
                self._add(_interval(op["request_delete_range"]), write=True)
            elif "request_txn" in op:
                self._add_txn(op["request_txn"])

    def _add(self, interval: Interval, *, write: bool) -> None:
        start, end = interval
        if end == start + b"\0":
            bisect.insort(self.write_points if write else self.read_points, start)
        else:
            (self.write_ranges if write else self.read_ranges).append(interval)

    def add(self, other: Footprint) -> None:
        """Take in ``other``'s keys (a txn joining the batch)."""
        for point in other.read_points:
            bisect.insort(self.read_points, point)
        for point in other.write_points:
            bisect.insort(self.write_points, point)
        self.read_ranges += other.read_ranges
        self.write_ranges += other.write_ranges

    def clashes(self, other: Footprint) -> bool:
        """True if ``other`` writes what these txns read or write, or reads what
        they write."""
        for point in other.write_points:
            if self._has_point(point, read=True) or self._has_point(point, read=False):
                return True
        for point in other.read_points:
            if self._has_point(point, read=False):
                return True
        for interval in other.write_ranges:
            if self._meets(interval, read=True) or self._meets(interval, read=False):
                return True
        return any(self._meets(interval, read=False) for interval in other.read_ranges)

    def _has_point(self, point: bytes, *, read: bool) -> bool:
        """Whether these txns read (``read``) or write ``point``."""
        points = self.read_points if read else self.write_points
        at = bisect.bisect_left(points, point)
        if at < len(points) and points[at] == point:
            return True
        ranges = self.read_ranges if read else self.write_ranges
        return any(start <= point and (not end or point < end) for start, end in ranges)

    def _meets(self, interval: Interval, *, read: bool) -> bool:
        """Whether these txns read (``read``) or write any key of ``interval``."""
        points = self.read_points if read else self.write_points
        at = bisect.bisect_left(points, interval[0])
        if at < len(points) and (not interval[1] or points[at] < interval[1]):
            return True
        ranges = self.read_ranges if read else self.write_ranges
        return any(_overlaps(interval, other) for other in ranges)


def ops_needed(txn: dict[str, Any]) -> int:
    """The operations etcd counts for ``txn`` against ``--max-txn-ops``: its largest
    list (compares, success or failure) plus what its nested txns need, along the
    deepest path."""
    branches = (txn.get("success", ()), txn.get("failure", ()))
    own = max(len(txn.get("compare", ())), *(len(ops) for ops in branches))
    nested = (
        ops_needed(op["request_txn"]) for ops in branches for op in ops if "request_txn" in op
    )
    return own + max(nested, default=0)


class Queued:
    """One txn waiting for its answer: ``reply`` (its own txn response, with the
    batch's header), or ``error``; neither when it was never sent (the batcher
    stopped first), and its caller sends it alone. ``ranks``: the token ranks its
    new entries took, in the order txns are queued. Its footprint and the
    operations it needs are worked out only if another txn may share its batch: a
    txn that goes alone costs nothing more than before batching."""

    __slots__ = (
        "_footprint",
        "_need",
        "done",
        "error",
        "payload",
        "ranks",
        "reply",
        "since",
        "txn",
        "withdrawn",
    )

    def __init__(self, txn: dict[str, Any], payload: bytes, ranks: int = 0) -> None:
        self.txn = txn
        self.payload = payload
        self.ranks = ranks
        self._footprint: Footprint | None = None
        self._need = 0
        self.done = trio.Event()
        self.reply: dict[str, Any] | None = None
        self.error: Exception | None = None
        self.withdrawn = False
        self.since = trio.current_time()  # queued

    def footprint(self) -> Footprint:
        if self._footprint is None:
            self._footprint = Footprint(self.txn)
        return self._footprint

    def need(self) -> int:
        if not self._need:
            self._need = ops_needed(self.txn)
        return self._need


_ENVELOPE_HEAD = b'{"compare":[],"success":['
_ENVELOPE_TAIL = b'],"failure":[]}'


class TxnBatcher:
    """Sends queued txns in batches, at most ``in_flight`` batches at a time: while
    they are in flight, arriving txns gather for the next.

    ``send`` posts one encoded txn and returns etcd's reply (raising on failure);
    ``alone_on``: the errors after which a batch of several is sent again one txn at
    a time, so that one txn etcd refuses (say, a lease that is gone) fails alone.
    Any other error fails every txn of the batch with it. ``unanswered``: the error
    of a txn whose batch was cut off in flight (the node stopping), whose fate is
    unknown as after a timeout. ``max_ranks``: the most ranks (see :class:`Queued`)
    the txns of one batch may take in a row, withdrawn ones included; None when no
    txn takes any.
    """

    def __init__(
        self,
        send: Callable[[bytes], Awaitable[dict[str, Any]]],
        *,
        alone_on: tuple[type[Exception], ...],
        unanswered: Callable[[], Exception],
        in_flight: int,
        max_ranks: int | None,
        stale: Callable[[float], Exception | None] = lambda since: None,
    ) -> None:
        self._send = send
        self.max_ranks = max_ranks
        self._alone_on = alone_on
        self._unanswered = unanswered
        self._stale = stale
        self._slots = trio.Semaphore(in_flight)
        self._queue: collections.deque[Queued] = collections.deque()
        self._arrived = trio.Event()
        self.running = False
        #: Batches of several txns that etcd answered, and the txns in them
        #: (:attr:`EtcdClient.batch_counts`).
        self.batches = 0
        self.batched = 0

    async def submit(self, queued: Queued) -> None:
        """Queue ``queued`` and wait until it is answered (or cannot be sent). A
        caller cancelled before its txn was taken into a batch withdraws it."""
        self._queue.append(queued)
        self._arrived.set()
        try:
            await queued.done.wait()
        except BaseException:
            queued.withdrawn = True  # skipped if not taken yet
            raise

    async def run(self) -> None:
        """Gather and send batches until cancelled; then every txn still queued is
        handed back unsent, for its caller to send alone."""
        self.running = True
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    while not self._queue:
                        self._arrived = trio.Event()
                        await self._arrived.wait()
                    await self._slots.acquire()
                    batch = self._take()
                    if batch:
                        nursery.start_soon(self._send_batch, batch)
                    else:
                        self._slots.release()
        finally:
            self.running = False
            while self._queue:
                self._queue.popleft().done.set()

    def _take(self) -> list[Queued]:
        """The txns at the head of the queue that may share one batch."""
        batch: list[Queued] = []
        gathered = Footprint()
        size = len(_ENVELOPE_HEAD) + len(_ENVELOPE_TAIL)
        most_needed = 0
        ranks = 0  # taken from the first txn of the batch on, withdrawn ones too
        queue = self._queue
        while queue:
            queued = queue[0]
            if batch and self.max_ranks is not None and ranks + queued.ranks > self.max_ranks:
                break
            if queued.withdrawn or self._failed_stale(queued):
                queue.popleft()
                ranks += queued.ranks if batch else 0
                continue
            if batch:
                if len(batch) == 1:  # a second may join: now the first's keys matter
                    gathered.add(batch[0].footprint())
                    most_needed = batch[0].need()
                needed = max(most_needed, queued.need())
                if len(batch) + 1 + needed > MAX_TXN_OPS:
                    break
                if size + len(queued.payload) + 20 > MAX_BATCH_BYTES:
                    break
                if gathered.clashes(queued.footprint()):
                    break
                gathered.add(queued.footprint())
                most_needed = needed
            queue.popleft()
            batch.append(queued)
            size += len(queued.payload) + 20
            ranks += queued.ranks
        return batch

    def _failed_stale(self, queued: Queued) -> bool:
        """Fail ``queued`` at once if ``stale`` says so for the time it was queued
        (etcd gave no answer to a call meanwhile): a txn waiting here is waiting
        for the window, and fails as a call waiting there does."""
        error = self._stale(queued.since)
        if error is None:
            return False
        queued.error = error
        queued.done.set()
        return True

    async def _send_batch(self, batch: list[Queued]) -> None:
        failure: Exception | None = None  # the batch's, for every txn in it
        try:
            if len(batch) == 1:
                await self._send_alone(batch[0])
                return
            payload = b"".join(
                (
                    _ENVELOPE_HEAD,
                    b",".join(b'{"request_txn":' + queued.payload + b"}" for queued in batch),
                    _ENVELOPE_TAIL,
                )
            )
            try:
                reply = await self._send(payload)
            except self._alone_on:
                for queued in batch:
                    await self._send_alone(queued)
                return
            except Exception as error:
                failure = error
                return
            self.batches += 1
            self.batched += len(batch)
            header = reply.get("header", {})
            for queued, response in zip(batch, reply.get("responses", []), strict=False):
                answer = response.get("response_txn") or {}  # this txn's alone
                answer["header"] = header
                queued.reply = answer
                queued.done.set()
        finally:
            self._slots.release()
            for queued in batch:
                if not queued.done.is_set():
                    # The batch failed, was cut off in flight (the node is stopping),
                    # or its reply had no answer for this txn: as after a timeout.
                    queued.error = failure or self._unanswered()
                    queued.done.set()

    async def _send_alone(self, queued: Queued) -> None:
        try:
            queued.reply = await self._send(queued.payload)
        except Exception as error:
            queued.error = error
        queued.done.set()
