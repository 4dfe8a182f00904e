"""A small trio-native client for etcd's v3 JSON gateway (``/v3/...`` over HTTP/1.1).

Why the gateway and not gRPC: the gRPC libraries are asyncio-bound or blocking, while
plain HTTP/1.1 runs on trio sockets, so trio cancellation and timeouts work everywhere.
Unary calls go over a small pool of keep-alive connections framed by h11
(:mod:`.transport`); txns may go in batches (:mod:`.batch`). The one
long-lived watch stream per node still uses httpx, where that cost does not matter.
The gateway has quirks this module hides: keys and values travel as base64, int64
values come as JSON strings (lease IDs exceed 2**53, so nothing may pass through a
float), and fields holding their proto default (``succeeded``, ``type`` of a PUT
event, ``TTL`` of a gone lease, ``count``) are left out of replies, meaning false/0.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn

import httpx
import trio

from elockd.backend.cluster.etcd.attempts import Attempts, attempt_interval
from elockd.backend.cluster.etcd.batch import Queued, TxnBatcher, batches_in_flight
from elockd.backend.cluster.etcd.transport import Retry, Transport
from elockd.observe.logthrottle import LogThrottle

log = logging.getLogger("elockd.etcd")

_HEADERS = {"Content-Type": "application/json"}
_OPS = {"==": "EQUAL", "!=": "NOT_EQUAL", ">": "GREATER", "<": "LESS"}
# Error replies that say "this member cannot answer now", not "your request is wrong".
_RETRY_CODES = {4, 14}  # grpc DEADLINE_EXCEEDED, UNAVAILABLE
_RETRY_MARKERS = (
    "no leader",
    "timed out",
    "leader changed",
    "too many requests",
    "not capable",
    "deadline exceeded",  # a minority member answers 500 "context deadline exceeded", code 2
)
_WATCH_BACKOFF = 0.1  # between watch reconnects, so a dead cluster is not hammered
#: A member that is down fails every call: one line per endpoint this often.
_FAILURE_LOG_INTERVAL = 10.0


class EtcdUnavailable(Exception):
    """No endpoint gave an answer within the deadline (no quorum, all members down)."""


class EtcdError(Exception):
    """etcd answered with an error body; ``code`` is the grpc code, ``message`` its text."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code
        self.message = message


class WatchCompacted(Exception):
    """The watch's start revision was compacted away. Caller must resync from a fresh read."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch start revision compacted (compact_revision={compact_revision})")
        self.compact_revision = compact_revision


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # etcd's "to the end of the keyspace"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _with_range(body: dict[str, Any], range_end: bytes | None) -> dict[str, Any]:
    if range_end is not None:
        body["range_end"] = _b64(range_end)
    return body


def put_op(
    key: bytes, value: bytes, lease: int = 0, *, ignore_lease: bool = False
) -> dict[str, Any]:
    """A write; ``ignore_lease``: the key keeps the lease it is bound to (etcd 3.3+),
    so that one node can rewrite a value bound to another node's lease."""
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if ignore_lease:
        body["ignore_lease"] = True
    elif lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def range_op(
    key: bytes,
    range_end: bytes | None = None,
    *,
    count_only: bool = False,
    limit: int = 0,
    sort_by_create: bool = False,
    keys_only: bool = False,
    revision: int = 0,
) -> dict[str, Any]:
    """A read; ``revision``: as etcd had it then (0: now), if not compacted away."""
    body = _with_range({"key": _b64(key)}, range_end)
    body |= {"revision": str(revision)} if revision else {}
    body |= {"count_only": True} if count_only else {}
    body |= {"keys_only": True} if keys_only else {}
    body |= {"limit": str(limit)} if limit else {}
    body |= {"sort_target": "CREATE", "sort_order": "ASCEND"} if sort_by_create else {}
    return {"request_range": body}


def delete_op(key: bytes, range_end: bytes | None = None) -> dict[str, Any]:
    return {"request_delete_range": _with_range({"key": _b64(key)}, range_end)}


def txn_op(compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> dict[str, Any]:
    """A txn inside a txn's operations (etcd 3.3+): each entry's own guard, so one
    entry already gone does not stop the others' deletes."""
    return {"request_txn": {"compare": compare, "success": success}}


def _compare(key: bytes, op: str, target: str, field: str, operand: str) -> dict[str, Any]:
    if op not in _OPS:
        raise ValueError(f"compare op must be one of {sorted(_OPS)}, not {op!r}")
    return {"key": _b64(key), "target": target, "result": _OPS[op], field: operand}


def compare_create(
    key: bytes, op: str, revision: int, range_end: bytes | None = None
) -> dict[str, Any]:
    """With ``range_end``, ``CREATE == 0`` holds only if no key in the range exists."""
    return _with_range(_compare(key, op, "CREATE", "create_revision", str(revision)), range_end)


def compare_mod(
    key: bytes, op: str, revision: int, range_end: bytes | None = None
) -> dict[str, Any]:
    """With ``range_end``, it must hold for every key in the range (and holds for
    an empty one: etcd compares a missing key as mod revision 0)."""
    return _with_range(_compare(key, op, "MOD", "mod_revision", str(revision)), range_end)


def compare_lease(key: bytes, op: str, lease: int) -> dict[str, Any]:
    """The lease the key hangs on (etcd 3.3+)."""
    return _compare(key, op, "LEASE", "lease", str(lease))


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            key=base64.b64decode(kv.get("key", "")),
            value=base64.b64decode(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # "PUT" or "DELETE"
    kv: KeyValue

    @classmethod
    def from_json(cls, event: dict[str, Any]) -> Event:
        return cls(
            type=event.get("type", "PUT"),  # PUT is the enum default, so the gateway omits it
            kv=KeyValue.from_json(event.get("kv", {})),
        )


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[dict[str, Any]]

    def kvs(self, index: int) -> list[KeyValue]:
        reply = self.responses[index].get("response_range", {})
        return [KeyValue.from_json(kv) for kv in reply.get("kvs", [])]

    def count(self, index: int) -> int:
        return int(self.responses[index].get("response_range", {}).get("count", 0))


def _revision(reply: dict[str, Any]) -> int:
    return int(reply.get("header", {}).get("revision", 0))


def _decode(endpoint: str, status: int, content: bytes) -> dict[str, Any]:
    """A reply body, or EtcdError / Retry for an error reply (decided by code and text)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        if status >= 500:
            raise Retry(f"{endpoint}: HTTP {status}")
        raise EtcdError(status, content.decode("utf-8", "replace").strip())
    error = body.get("error")
    if status == 200 and not error:
        return body
    if isinstance(error, dict):  # an error inside a stream: {"error": {"grpc_code": ..}}
        code, message = int(error.get("grpc_code", 2)), str(error.get("message", ""))
    else:
        code, message = int(body.get("code", 2)), str(body.get("message") or error or "")
    if status >= 500 or code in _RETRY_CODES or any(marker in message for marker in _RETRY_MARKERS):
        raise Retry(f"{endpoint}: {message} (code {code})")
    raise EtcdError(code, message)


#: Calls in flight beside the window, for lease keepalives and the node's heartbeat
#: alone: a node's own backlog of requests must never delay what keeps it alive.
URGENT_SLOTS = 2


class EtcdClient:
    """Calls to a set of etcd members with failover; safe to share between tasks.

    Calls stick to one endpoint while it answers, and move to the next one when it
    fails or is slow (:meth:`call`). A trio.CapacityLimiter bounds the calls in
    flight (the window, at most ``max_concurrent``); the others queue for it in
    FIFO order, and their deadline starts only once they are sent, so a node's
    own backlog is never read as etcd not answering. Lease keepalives have
    :data:`URGENT_SLOTS` of their own. The
    window and those places also bound the keep-alive connections of unary calls
    (see :mod:`.transport`).
    Watches are not counted there: each holds an httpx streaming connection of its
    own for its whole life.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        attempt_timeout: float | None = None,
        deadline: float = 3.0,
        max_concurrent: int = 8,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._failure_logs = {
            endpoint: LogThrottle(log, logging.WARNING, _FAILURE_LOG_INTERVAL)
            for endpoint in self.endpoints
        }
        self.deadline = deadline
        #: Seconds between two attempts of a call (see :meth:`call`): its deadline
        #: cut into parts, one per endpoint and at least three. A call with a later
        #: end (a keepalive) spaces its attempts out in proportion.
        self.attempt_timeout = (
            attempt_interval(deadline, len(self.endpoints))
            if attempt_timeout is None
            else attempt_timeout
        )
        self._current = 0
        self._limiter = trio.CapacityLimiter(max_concurrent)
        self._urgent = trio.CapacityLimiter(URGENT_SLOTS)
        self._transport = Transport(max_concurrent + URGENT_SLOTS)
        #: When the last call ran out of its deadline unanswered (trio time).
        self._gave_up_at = -math.inf
        self._max_concurrent = max_concurrent
        #: Made by :meth:`run_batches`, which is told the rank rule of its txns.
        self._batcher: TxnBatcher | None = None
        # Only for watches: a stream holds its connection for life, none is worth keeping.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.attempt_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            trust_env=False,  # endpoints are explicit; never route them through a proxy
        )

    @property
    def endpoint(self) -> str:
        """The endpoint calls go to now (the sticky one)."""
        return self.endpoints[self._current]

    async def run_batches(self, *, max_ranks: int | None = None) -> None:
        """Send txns in batches (group commit) until cancelled; until it runs, and
        after, each txn is sent on its own. ``max_ranks``: the most ranks (see
        :meth:`txn`) one batch may take in a row, from the user of the client, whose
        rule it is (None when no txn takes any)."""
        self._batcher = batcher = TxnBatcher(
            lambda payload: self._call_payload("kv/txn", payload),
            alone_on=(EtcdError,),
            unanswered=lambda: EtcdUnavailable("the node stopped with this txn in flight"),
            in_flight=batches_in_flight(self._max_concurrent),
            max_ranks=max_ranks,
            stale=lambda since: self._gave_up_while_waiting("kv/txn", since),
        )
        await batcher.run()

    @property
    def batch_counts(self) -> tuple[int, int]:
        """(batches of several txns etcd answered, txns in them)."""
        batcher = self._batcher
        return (0, 0) if batcher is None else (batcher.batches, batcher.batched)

    async def aclose(self) -> None:
        self._transport.close()
        await self._http.aclose()

    async def call(
        self,
        path: str,
        body: dict[str, Any],
        *,
        urgent: bool = False,
        until: float | None = None,
    ) -> dict[str, Any]:
        """POST ``body`` to ``/v3/{path}``, failing over between endpoints until ``deadline``.

        The call first waits for a place in the window (``urgent``: one of the
        keepalives' own places). That wait is the node's own backlog, bounded by
        its connections, and is not counted against the deadline. One exception:
        if another call ran out of its deadline while this one waited, etcd was not
        answering meanwhile, and this one fails at once rather than spend a whole
        deadline of its own learning the same; so a backlog drains promptly when
        etcd is down.

        The call may take until its end: ``deadline`` seconds after it was sent,
        or ``until`` (a trio time) if that is later: a keepalive's answer is worth
        waiting for until the lease's local deadline. An attempt is never cut short
        before then: the link to every member may be slow, and an attempt cut
        sooner than the delay would never be answered. But every
        ``attempt_timeout`` (a third of the deadline, or less with more than three
        endpoints) without an answer, a fresh attempt goes to the next endpoint
        (the same one, with one endpoint), beside the earlier ones: for a hung
        member, or a request stuck in a member during an election. The first
        answer wins; the other attempts are cancelled (see :mod:`.attempts`). An
        attempt that fails (a connection error, an HTTP 5xx, an error reply meaning
        "not now": no leader, timed out, leader changed, ...; a reply body over 64
        MiB) is followed by the next one at once. At the call's end it raises
        EtcdUnavailable. Any other error reply raises EtcdError at once.

        An attempt may commit while the next one is sent, so a request may be
        applied twice. That is fine only because callers
        send nothing but idempotent or compare-guarded requests (a txn that checks
        before it writes), whose second application is a no-op or fails its
        compare; keep it that way.
        """
        payload = json.dumps(body).encode()
        return await self._call_payload(path, payload, urgent=urgent, until=until)

    async def _call_payload(
        self, path: str, payload: bytes, *, urgent: bool = False, until: float | None = None
    ) -> dict[str, Any]:
        """:meth:`call` with the body encoded already."""
        limiter = self._urgent if urgent else self._limiter
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            queued_at = trio.current_time()
            await limiter.acquire()
            # Only a call that really waited: one sent at once is not failed for a
            # call that happened to give up while it passed its checkpoint.
            if (error := self._gave_up_while_waiting(path, queued_at)) is not None:
                limiter.release()
                raise error from None
        try:
            now = trio.current_time()
            end = now + self.deadline
            if until is not None and until > end:
                end = until
            interval = self.attempt_timeout * (end - now) / self.deadline
            return await Attempts(self, path, payload).run(end, interval)
        finally:
            limiter.release()

    def _gave_up_while_waiting(self, path: str, since: float) -> EtcdUnavailable | None:
        """The error for a call that has waited to be sent since ``since`` if another
        call ran out of its deadline meanwhile: etcd is not answering, and a backlog
        must drain in one deadline, not one per call (or per batch)."""
        if self._gave_up_at <= since:
            return None
        return EtcdUnavailable(
            f"etcd gave no answer to {path}: another call ran out of its "
            f"{self.deadline}s while this one waited to be sent"
        )

    def _give_up(self, path: str, took: float, last: str) -> NoReturn:
        self._gave_up_at = trio.current_time()
        raise EtcdUnavailable(f"etcd gave no answer to {path} within {took:g}s ({last})")

    def _log_failure(self, endpoint: str, failure: str) -> None:
        """An endpoint that failed an attempt, with its URL and the cause, at most
        once per endpoint every ``_FAILURE_LOG_INTERVAL`` seconds."""
        cause = failure.removeprefix(f"{endpoint}: ")
        fields = {"endpoint": endpoint, "cause": cause}
        self._failure_logs[endpoint]("etcd endpoint failed", fields=fields)

    def _decoded(self, endpoint: str, status: int, content: bytes) -> dict[str, Any]:
        return _decode(endpoint, status, content)

    async def txn(
        self,
        compare: Sequence[dict[str, Any]],
        success: Sequence[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
        *,
        ranks: int = 0,
    ) -> TxnResult:
        """One txn; while :meth:`run_batches` runs, sent in a batch with the txns
        that wait beside it (group commit, see :mod:`.batch`), with the same
        answer as alone. ``ranks``: how many ranks its new entries take, of the
        run of ``max_ranks`` a batch may hold (the caller's rule)."""
        body = {"compare": list(compare), "success": list(success), "failure": list(failure)}
        payload = json.dumps(body).encode()
        reply: dict[str, Any] | None = None
        batcher = self._batcher
        if batcher is not None and batcher.running:
            queued = Queued(body, payload, ranks)
            await batcher.submit(queued)
            error = queued.error
            if isinstance(error, EtcdUnavailable):
                raise EtcdUnavailable(str(error)) from None  # one object per waiting task
            if isinstance(error, EtcdError):
                raise EtcdError(error.code, error.message) from None
            if error is not None:
                raise error
            reply = queued.reply
        if reply is None:  # no batching, or the batcher stopped before sending it
            reply = await self._call_payload("kv/txn", payload)
        return TxnResult(
            succeeded=bool(reply.get("succeeded", False)),
            revision=_revision(reply),
            responses=list(reply.get("responses", [])),
        )

    async def get(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        sort_by_create: bool = False,
        limit: int = 0,
        count_only: bool = False,
    ) -> tuple[int, list[KeyValue], int]:
        """(header revision, kvs, count). Linearizable: a minority member cannot answer."""
        op = range_op(
            key, range_end, sort_by_create=sort_by_create, limit=limit, count_only=count_only
        )
        reply = await self.call("kv/range", op["request_range"])
        kvs = [KeyValue.from_json(kv) for kv in reply.get("kvs", [])]
        return _revision(reply), kvs, int(reply.get("count", 0))

    async def put(self, key: bytes, value: bytes, lease: int = 0, *, urgent: bool = False) -> int:
        """``urgent``: on the keepalives' places (a node's heartbeat), never queued
        behind the node's requests."""
        body = put_op(key, value, lease)["request_put"]
        return _revision(await self.call("kv/put", body, urgent=urgent))

    async def lease_grant(self, ttl: int) -> tuple[int, int]:
        reply = await self.call("lease/grant", {"TTL": str(ttl)})
        return int(reply["ID"]), int(reply.get("TTL", 0))

    async def lease_keepalive(self, lease: int, *, until: float | None = None) -> int:
        """Remaining TTL in seconds; 0 means the lease is gone (expired or revoked).
        ``until``: a trio time up to which the answer is still of use (the lease's
        local deadline), if later than the call's deadline (see :meth:`call`)."""
        body = {"ID": str(lease)}
        reply = await self.call("lease/keepalive", body, urgent=True, until=until)
        return int(reply.get("result", {}).get("TTL", 0))

    async def lease_revoke(self, lease: int) -> bool:
        """False when the lease was already gone (or a retried revoke had already won)."""
        try:
            await self.call("lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if exc.code == 5 or "lease not found" in exc.message:
                return False
            raise
        return True

    async def lease_keys(self, lease: int) -> list[bytes] | None:
        """Keys attached to the lease, or None when the lease is gone."""
        reply = await self.call("kv/lease/timetolive", {"ID": str(lease), "keys": True})
        if int(reply.get("TTL", -1)) < 0:
            return None
        return [base64.b64decode(key) for key in reply.get("keys", [])]

    def watch(
        self, key: bytes, range_end: bytes, start_revision: int, *, silence: float | None = None
    ) -> Watch:
        """Every change in [key, range_end) from ``start_revision`` on, as event batches.

        ``start_revision`` 0 means "from now". Use ``async with client.watch(..) as w:
        async for batch in w`` so the stream is closed when the consumer stops. With
        ``silence``, a stream that sends nothing for that long is taken for a hung
        member and resumed on the next endpoint (the caller makes sure a healthy
        stream is never that quiet, e.g. with a periodic write under the prefix).
        """
        return Watch(self, key, range_end, start_revision, silence)


class Watch(AsyncIterator[list[Event]]):
    """A watch that survives member failures without losing or repeating an event.

    On any stream failure (connection error, EOF, an error message) it reconnects to
    the next endpoint with ``start_revision = last + 1``, forever. ``last`` advances
    only on revisions known to be complete: the events' own mod_revisions (etcd never
    splits one revision across messages), the header of a progress notification
    (sent only to watchers that are caught up), and the header of the "created"
    reply of a watch from now. It never uses the header of an events message or of
    a "created" reply with a start revision: while catching up, those carry the
    store's current revision, ahead of the events delivered so far.

    A connect that etcd does not answer in time is tried again on the next
    endpoint with twice the time (see ``_connect_time``), so a watch connects over
    a link slower than any fixed bound short of its silence.

    Limits: one consumer task. Without ``silence``, a member that hangs (SIGSTOP,
    silent partition) while serving an open stream stalls the watch until its
    connection breaks, because the stream has no read timeout.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        range_end: bytes,
        start: int,
        silence: float | None = None,
    ) -> None:
        self._client = client
        self._silence = math.inf if silence is None else silence
        self._create: dict[str, Any] = {
            "key": _b64(key),
            "range_end": _b64(range_end),
            "progress_notify": True,
        }
        self._from_now = start <= 0
        self.last_revision = max(start - 1, 0)  # every event up to here was delivered
        #: etcd's revision when the current stream was created: the events up to it
        #: are a replay of what happened before (see QueueMirror.catch_up_to).
        self.created_at = 0
        self._index = client._current
        #: How long the next connect may take, until etcd's "created" reply: the
        #: time between two attempts of a call first (a hung member costs no more
        #: than it costs a call), twice as long after each that ran out, up to the longer of the
        #: deadline and ``silence`` (over a slow link a connect takes two trips: a
        #: fixed bound shorter than that would never connect).
        self._connect_time = client.attempt_timeout
        self._longest_connect = max(
            client.deadline, client.attempt_timeout, 0 if silence is None else silence
        )
        self._response: httpx.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self._closed = False

    @property
    def endpoint(self) -> str:
        """The endpoint serving (or about to serve) the stream."""
        return self._client.endpoints[self._index]

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        await self._drop()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> list[Event]:
        while not self._closed:
            try:
                if self._lines is None:
                    await self._connect()
                assert self._lines is not None
                line = None
                with trio.move_on_after(self._silence):
                    line = await self._lines.__anext__()
                if line is None:
                    raise Retry(f"{self.endpoint}: watch silent for {self._silence} s")
                events = self._absorb(line)
            except WatchCompacted:
                await self.aclose()
                raise
            except (httpx.HTTPError, Retry, StopAsyncIteration, ValueError, KeyError, TypeError):
                await self._drop()
                self._index = (self._index + 1) % len(self._client.endpoints)
                await trio.sleep(_WATCH_BACKOFF)
                continue
            if events:
                return events
        raise StopAsyncIteration

    async def _connect(self) -> None:
        create = dict(self._create)
        if not (self._from_now and self.last_revision == 0):
            create["start_revision"] = str(self.last_revision + 1)
        client = self._client
        request = client._http.build_request(
            "POST",
            f"{self.endpoint}/v3/watch",
            content=json.dumps({"create_request": create}).encode(),
            headers=_HEADERS,
            timeout=httpx.Timeout(self._connect_time, read=None),
        )
        response: httpx.Response | None = None
        # The headers come with the "created" reply; a hung member never sends them.
        with trio.move_on_after(self._connect_time):
            response = await client._http.send(request, stream=True)
        if response is None:
            took = self._connect_time
            self._connect_time = min(2 * took, self._longest_connect)
            raise Retry(f"{self.endpoint}: watch not created within {took:g}s")
        self._connect_time = client.attempt_timeout
        self._response = response
        if response.status_code != 200:  # even a 4xx: the spec is "retry for ever"
            body = (await response.aread())[:200]
            raise Retry(f"{self.endpoint}: watch got HTTP {response.status_code}: {body!r}")
        self._lines = response.aiter_lines()

    def _absorb(self, line: str) -> list[Event]:
        """Events of one stream message that were not delivered yet; advances last_revision."""
        if not line.strip():
            return []
        message = json.loads(line)
        if "error" in message:
            raise Retry(f"{self.endpoint}: watch error {message['error']}")
        result = message["result"]
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                raise WatchCompacted(compacted)
            raise Retry(f"{self.endpoint}: watch canceled: {result.get('cancel_reason', '')}")
        raw = result.get("events", [])
        if raw:
            events = [Event.from_json(event) for event in raw]
            fresh = [event for event in events if event.kv.mod_revision > self.last_revision]
            self.last_revision = max(self.last_revision, *(e.kv.mod_revision for e in events))
            return fresh
        if result.get("created"):
            self.created_at = _revision(result)
        if not result.get("created") or (self._from_now and self.last_revision == 0):
            self.last_revision = max(self.last_revision, _revision(result))
        return []

    async def _drop(self) -> None:
        lines, response = self._lines, self._response
        self._lines = self._response = None
        with trio.CancelScope(shield=True):
            if lines is not None:
                # httpx reads through a chain of async generators, and trio warns about
                # each one collected while suspended. Resuming the chain in a cancelled
                # scope ends every link at once: Cancelled rises from the network read.
                with trio.CancelScope() as drain, contextlib.suppress(Exception):
                    drain.cancel()
                    while True:
                        await lines.__anext__()
            if response is not None:
                with trio.move_on_after(self._client.attempt_timeout):
                    await response.aclose()
