"""A small etcd in memory, under several in-process cluster nodes, whose watch a test
delivers by hand.

It applies txns as etcd does, for what the nodes' kill, acknowledgement and sweep
paths send: compares on ``CREATE``/``MOD``/``LEASE`` (with a range: every key in
it), puts (with a lease, or ``ignore_lease``), single-key deletes, nested txns and
range reads. Each write makes one revision, whose events go to every node's mailbox;
:meth:`TxnEtcd.deliver` feeds a node's mirror what is waiting for it, so a test
decides exactly when (and whether) a node hears of a change: a node cut from etcd is
one whose mailbox is never delivered. :meth:`TxnEtcd.lapse` is etcd running a lease
out: it deletes every key on it, as one revision.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

from elockd.backend.cluster.etcd.client import Event, KeyValue, TxnResult
from elockd.backend.cluster.space import ClusterLockSpace

_CHECKS: dict[str, Callable[[int, int], bool]] = {
    "EQUAL": lambda a, b: a == b,
    "NOT_EQUAL": lambda a, b: a != b,
    "LESS": lambda a, b: a < b,
    "GREATER": lambda a, b: a > b,
}
_FIELDS = {"CREATE": "create_revision", "MOD": "mod_revision", "LEASE": "lease"}


def _bytes(field: str) -> bytes:
    return base64.b64decode(field)


class TxnEtcd:
    """The keys, the revision, and a mailbox of watch events per node."""

    def __init__(self, revision: int = 100) -> None:
        self.revision = revision
        self.kvs: dict[bytes, KeyValue] = {}
        self.mailboxes: dict[int, list[Event]] = {}
        self.spaces: dict[int, ClusterLockSpace] = {}
        self.refused = 0  # txns whose compares failed
        #: Called with each revision's events as it commits (a test's probe).
        self.on_commit: Callable[[list[Event]], None] | None = None

    def attach(self, space: ClusterLockSpace) -> None:
        """Serve ``space``'s txns from here; its watch events wait in its mailbox."""
        self.spaces[id(space)] = space
        self.mailboxes[id(space)] = []
        space.calls.txn = self.txn  # type: ignore[method-assign, assignment]
        space.calls.get = self.get  # type: ignore[method-assign]

    def deliver(self, space: ClusterLockSpace) -> None:
        """``space``'s watch brings every event waiting for it."""
        events, self.mailboxes[id(space)] = self.mailboxes[id(space)], []
        if events:
            space.mirror.apply(events)

    def put(self, key: bytes, value: bytes, lease: int) -> int:
        """A write from outside the nodes' code paths (a test's setup)."""
        self.revision += 1
        self._commit([self._put(key, value, lease, ignore_lease=False)])
        return self.revision

    def lapse(self, lease: int) -> None:
        """etcd runs ``lease`` out: every key on it goes, in one revision."""
        self.revision += 1
        gone = [key for key, kv in self.kvs.items() if kv.lease == lease]
        self._commit([self._delete(key) for key in gone if key in self.kvs])

    # ------------------------------------------------------------------ txn

    async def txn(
        self,
        compare: Sequence[dict[str, Any]],
        success: Sequence[dict[str, Any]],
        *rest: Any,
        **_: Any,
    ) -> TxnResult:
        """Takes what it reads of :meth:`EtcdCalls.txn`'s arguments: the compares, and
        the operations on success and (``rest[0]``, if given) on failure."""
        failure: Sequence[dict[str, Any]] = rest[0] if rest else ()
        succeeded = all(self._holds(c) for c in compare)
        self.refused += not succeeded
        self.revision += 1
        events: list[Event] = []
        responses = [self._op(op, events) for op in (success if succeeded else failure)]
        if not events:
            self.revision -= 1  # a read-only txn makes no revision
        revision = self.revision  # (a probe may commit more before the answer)
        if events:
            self._commit(events)
        return TxnResult(succeeded, revision, responses)

    async def get(
        self, key: bytes, range_end: bytes | None = None, *, sort_by_create: bool = False
    ) -> tuple[int, list[KeyValue], int]:
        """A range read: (revision, the keys, their count), by key or create revision."""
        found = [
            kv for k, kv in self.kvs.items() if k == key or (range_end and key <= k < range_end)
        ]
        found.sort(key=(lambda kv: kv.create_revision) if sort_by_create else (lambda kv: kv.key))
        return self.revision, found, len(found)

    def _holds(self, compare: dict[str, Any]) -> bool:
        key = _bytes(compare["key"])
        field = _FIELDS[compare["target"]]
        check = _CHECKS[compare["result"]]
        operand = int(compare[field])
        if "range_end" not in compare:
            kv = self.kvs.get(key)
            return check(0 if kv is None else getattr(kv, field), operand)
        end = _bytes(compare["range_end"])
        return all(
            check(getattr(kv, field), operand) for k, kv in self.kvs.items() if key <= k < end
        )

    def _op(self, op: dict[str, Any], events: list[Event]) -> dict[str, Any]:
        if "request_put" in op:
            body = op["request_put"]
            put = self._put(
                _bytes(body["key"]),
                _bytes(body["value"]),
                int(body.get("lease", 0)),
                ignore_lease=bool(body.get("ignore_lease")),
            )
            events.append(put)
            return {"response_put": {}}
        if "request_delete_range" in op:
            key = _bytes(op["request_delete_range"]["key"])
            if key in self.kvs:
                events.append(self._delete(key))
            return {"response_delete_range": {}}
        if "request_txn" in op:
            inner = op["request_txn"]
            if all(self._holds(c) for c in inner.get("compare", [])):
                for nested in inner.get("success", []):
                    self._op(nested, events)
            return {"response_txn": {}}
        body = op["request_range"]
        key = _bytes(body["key"])
        end = _bytes(body["range_end"]) if "range_end" in body else None
        found = [kv for k, kv in sorted(self.kvs.items()) if k == key or (end and key <= k < end)]
        return {"response_range": {"count": len(found), "kvs": [self._json(kv) for kv in found]}}

    def _put(self, key: bytes, value: bytes, lease: int, *, ignore_lease: bool) -> Event:
        old = self.kvs.get(key)
        if ignore_lease:
            assert old is not None, "etcd refuses ignore_lease on a key that is not there"
            lease = old.lease
        created = self.revision if old is None else old.create_revision
        kv = self.kvs[key] = KeyValue(key, value, created, self.revision, lease)
        return Event("PUT", kv)

    def _delete(self, key: bytes) -> Event:
        del self.kvs[key]
        return Event("DELETE", KeyValue(key, b"", 0, self.revision, 0))

    def _commit(self, events: list[Event]) -> None:
        for mailbox in self.mailboxes.values():
            mailbox.extend(events)
        if self.on_commit is not None:
            self.on_commit(events)

    @staticmethod
    def _json(kv: KeyValue) -> dict[str, Any]:
        return {
            "key": base64.b64encode(kv.key).decode(),
            "value": base64.b64encode(kv.value).decode(),
            "create_revision": str(kv.create_revision),
            "mod_revision": str(kv.mod_revision),
            "lease": str(kv.lease),
        }
