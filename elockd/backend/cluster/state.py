"""A cluster node's books as a hand-over moves them (docs/upgrade.md).

The locks themselves stay in etcd: what moves is what this node promised its
clients on etcd's word, so that the successor can keep the promises. The node's
identity (its id, which its sessions' records name, its heartbeat lease, by which
other nodes see it alive, and the lease its sessions' keys hang on), every session
with its tag, the revision of its record (the guard of every free) and its grace;
every hold with its entry's revision, token and ``ttl=`` time left; every
waiting request, whose entries keep their place in etcd's queues while it moves;
and the tags of sessions lately taken over by another node, whose entries the
sweep leaves to that node for a while.
The successor keeps the node's leases alive from then on, so nothing in etcd
changes hands.

Pure, like :mod:`elockd.backend.memory_state`: records in, records out, times as
durations. The hand-over adds the service's counters and the parked connections.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, Layout
from elockd.backend.cluster.lease import NodeLease
from elockd.backend.cluster.ledger import (
    ClusterAnswer,
    ClusterHold,
    ClusterSession,
    ClusterWait,
    Ledger,
    ThrottleWait,
)
from elockd.backend.cluster.node import ClusterNode
from elockd.backend.cluster.operators import ClusterOperators
from elockd.backend.cluster.throttle import ClusterThrottles
from elockd.backend.interface import REFUSALS, Grant, Later
from elockd.backend.state import (
    SESSION_FIELDS,
    Record,
    RecordReader,
    StateError,
    batches,
    raw,
    restored_session,
    session_row,
    text,
    time_left,
)
from elockd.engine.gcra import Rate, Verdict
from elockd.engine.sessions import Session


class ClusterLockSpace(Protocol):
    """What a node's dump and restore read and set of
    :class:`~elockd.backend.cluster.space.ClusterLockSpace` (described, not
    imported: the space builds its dump and restore from this module)."""

    calls: EtcdCalls
    layout: Layout
    lease: NodeLease
    ledger: Ledger
    node: ClusterNode
    node_id: str
    operators: ClusterOperators
    session_ttl: int

    def adopt_identity(self, node_id: str, heartbeat_lease: int, sessions_lease: int) -> None: ...

    @property
    def throttles(self) -> ClusterThrottles: ...

    def waiting_request(
        self, session: ClusterSession, start: Callable[[], Awaitable[Any]] | None
    ) -> WaitingRequest: ...


class WaitingRequest(Later[Any]):
    """A waiting request, with its answer once it has one: a hand-over may pause its
    connection before the reply goes out, and the answer moves with it
    (:meth:`~elockd.backend.cluster.space.ClusterLockSpace.waiting_request`)."""

    __slots__ = ("answer",)

    def __init__(self, run: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(run, waits=True)
        self.answer: ClusterAnswer | None = None


KINDS = {EXCLUSIVE: "x", SHARED: "s"}
KIND_OF = {name: kind for kind, name in KINDS.items()}


class ClusterDump:
    """A node's books as records, in the order :class:`ClusterRestore` reads them."""

    def __init__(
        self, space: ClusterLockSpace, now: float, pending: Sequence[tuple[Session, Any]]
    ) -> None:
        self.space = space
        self.now = now
        self.pending = pending
        self.places: dict[Session, int] = {}
        self.waiting: set[str] = set()

    def pending_ref(self, later: Any, session: Session) -> int:
        if not isinstance(later, WaitingRequest) or (
            later.answer is None and session.id not in self.waiting
        ):
            raise StateError("a waiting request without its wait in the books")
        return self.places[session]

    def records(self) -> Iterator[Record]:
        space, now, index = self.space, self.now, self.places
        ledger = space.ledger
        yield {
            "t": "node",
            "node_id": space.node_id,
            "heartbeat_lease": space.node.heartbeat_lease,
            "sessions_lease": space.lease.id,
            # The lease's local deadline, as time left: a successor confirms nothing
            # past it either, also before it has joined (docs/cluster.md).
            "sessions_lease_left": time_left(space.lease.deadline, now),
            "prefix": text(space.layout.root),
            "session_ttl": space.session_ttl,
            "backend_unavailable": space.calls.backend_unavailable,
            "orphans": ledger.orphans,
            "shared_orphans": ledger.shared_orphans,
            "expired": ledger.expired,
            "timeouts": ledger.timeouts,
            "sessions_lost": ledger.sessions_lost,
            "killed": ledger.killed,
            # The revision every watcher's events reach (the moved connections carry
            # them): a successor with watchers replays from just after it.
            "watched_revision": space.operators.frozen_at,
            # Tags of sessions another node took over: their entries are that node's
            # to move, and the successor's sweep must leave them alone as this one
            # would.
            "moved_tags": [
                [tag, until - now] for tag, until in ledger.moved_tags.items() if until > now
            ],
        }
        # A lost session is here only while its connection ends: the successor finds
        # the node's lease gone and ends it the same way.
        sessions = list(ledger.sessions.values())

        def session_rows() -> Iterator[list[Any]]:
            for session in sessions:
                index[session] = len(index)
                yield [*session_row(session, now), session.tag, session.record_revision]

        yield from batches("cluster_sessions", session_rows())

        def hold_rows() -> Iterator[list[Any]]:
            for session in sessions:
                for hold in ledger.holds(session):
                    yield [
                        index[session],
                        KINDS[SHARED if hold.shared else EXCLUSIVE],
                        text(hold.key),
                        hold.revision,
                        hold.token,
                        now - hold.granted_at,
                        hold.ttl,
                        time_left(hold.lease_deadline, now),
                    ]

        yield from batches("cluster_holds", hold_rows())
        waits = [
            w for w in ledger.waits.values() if w.session in index and isinstance(w, ClusterWait)
        ]
        throttle_waits = [
            w for w in ledger.waits.values() if w.session in index and isinstance(w, ThrottleWait)
        ]
        yield from batches(
            "cluster_waits",
            (
                [
                    index[w.session],
                    KINDS[w.kind],
                    [text(k) for k in w.keys],
                    w.revision,
                    w.limit,
                    w.ttl,
                    w.deadline - now,
                    now - w.since,
                ]
                for w in waits
            ),
        )
        # A throttle waiter's entry keeps its place in its key's line in etcd.
        yield from batches(
            "cluster_throttle_waits",
            (
                [
                    index[w.session],
                    text(w.key),
                    [w.rate.calls, w.rate.period, w.rate.burst, w.rate.cost],
                    text(w.etcd_key),
                    w.revision,
                    w.deadline - now,
                    now - w.since,
                ]
                for w in throttle_waits
            ),
        )
        # A connection's waiting request: its answer, if it got one before it could
        # be sent, or else its session's one wait in the books.
        answered = [
            [index[session], *_answer_row(request.answer)]
            for session, request in self.pending
            if isinstance(request, WaitingRequest) and request.answer is not None
        ]
        yield from batches("cluster_answers", iter(answered))
        self.waiting = {w.session.id for w in waits} | {w.session.id for w in throttle_waits}


#: The refusals a waiting request's answer can carry, by name.
REFUSED_BY_NAME: dict[str, type[Exception]] = {kind.__name__: kind for kind in REFUSALS}


def _answer_row(answer: ClusterAnswer) -> list[Any]:
    if answer.refusal is not None:
        return ["refused", type(answer.refusal).__name__, str(answer.refusal)]
    grant = answer.grant
    assert grant is not None
    if isinstance(grant, Verdict):
        return ["verdict", *grant]
    return ["grant", grant.granted, grant.count, [text(k) for k in grant.blocked]]


def _answer(row: list[Any]) -> ClusterAnswer:
    if row[0] == "refused":
        kind = REFUSED_BY_NAME.get(row[1])
        if kind is None:
            raise StateError(f"unknown refusal {row[1]!r}")
        return ClusterAnswer(refusal=kind(row[2]))
    if row[0] == "verdict":
        return ClusterAnswer(Verdict(*row[1:]))
    granted, count, blocked = row[1:]
    return ClusterAnswer(Grant(granted, count, [raw(k) for k in blocked]))


class ClusterRestore(RecordReader):
    """Rebuilds a predecessor's books into a fresh cluster node, record by record
    (:meth:`feed`)."""

    def __init__(self, space: ClusterLockSpace, now: float) -> None:
        if space.ledger.sessions:
            raise StateError("the backend already has sessions")
        self.now = now
        self.space = space
        self.sessions: list[Session] = []
        self.answers: dict[int, ClusterAnswer] = {}  # by session place
        self.holds = 0

    def _node(self, record: Record) -> None:
        space, ledger = self.space, self.space.ledger
        if raw(record["prefix"]) != space.layout.root:
            raise StateError(
                f"--etcd-prefix {record['prefix']} there, {text(space.layout.root)} here"
            )
        # The adopted leases were granted with the old TTL; kept alive every new
        # TTL/3, a longer one would let them lapse under their sessions.
        if record.get("session_ttl", space.session_ttl) != space.session_ttl:
            raise StateError(
                f"--session-ttl {record['session_ttl']} there, {space.session_ttl} here"
            )
        if "sessions_lease" not in record:
            raise StateError(
                "the old node keeps an etcd lease per session (an older elockd): "
                "restart it instead, or move its clients with conn_id"
            )
        space.adopt_identity(record["node_id"], record["heartbeat_lease"], record["sessions_lease"])
        left = record.get("sessions_lease_left")  # absent from an elockd before 2026-11-27
        if left is not None:
            # Until the join renews the lease (or finds it gone and loses its
            # sessions), the predecessor's deadline holds here: nothing adopted is
            # confirmed past it, however long etcd takes to answer the join.
            space.lease.deadline = self.now + left
        ledger.orphans = record["orphans"]
        ledger.shared_orphans = record["shared_orphans"]
        ledger.expired = record["expired"]
        ledger.timeouts = record["timeouts"]
        ledger.sessions_lost = record["sessions_lost"]
        ledger.killed = record.get("killed", 0)  # absent before kill
        space.node.replay_from = record.get("watched_revision", 0)  # absent before watch
        space.calls.backend_unavailable = record.get("backend_unavailable", 0)
        # Absent from an elockd before 2026-11-25: nothing to leave alone then.
        ledger.moved_tags = {tag: self.now + left for tag, left in record.get("moved_tags", [])}

    def _cluster_sessions(self, record: Record) -> None:
        ledger, now = self.space.ledger, self.now
        for row in record["rows"]:
            session, grace_deadline = restored_session(ClusterSession, row, now)
            session.tag, session.record_revision = row[SESSION_FIELDS:]
            ledger.sessions[session.id] = session
            if session.tag:
                ledger.by_tag[session.tag] = session
            if grace_deadline is not None:
                ledger.sessions_in_grace += 1
                session.grace_deadline = grace_deadline
                ledger.schedule(grace_deadline, session)
            self.sessions.append(session)

    def _cluster_holds(self, record: Record) -> None:
        ledger, now = self.space.ledger, self.now
        for owner, kind, key, revision, token, age, ttl, lease_left in record["rows"]:
            session = self.sessions[owner]
            shared = KIND_OF[kind] == SHARED
            hold = ClusterHold(session, raw(key), shared, revision, token, now - age)
            hold.ttl = ttl
            (session.shared if shared else session.exclusive)[hold.key] = hold
            if lease_left is not None:
                ledger.set_lease(hold, now + lease_left)
            self.holds += 1

    def _cluster_waits(self, record: Record) -> None:
        space, now = self.space, self.now
        for owner, kind, keys, revision, limit, ttl, left, waited in record["rows"]:
            session = self.sessions[owner]
            assert isinstance(session, ClusterSession)
            kind_bytes = KIND_OF[kind]
            names = [raw(k) for k in keys]
            entries = [space.layout.entry(kind_bytes, k, session.tag) for k in names]
            wait = ClusterWait(
                session, kind_bytes, names, entries, revision, limit, ttl, now + left, now - waited
            )
            wait.suspended = True  # its connection's next task waits on for it
            space.ledger.waits[session.id] = wait
            session.pending.update(entries)  # not strays to the sweep meanwhile

    def _cluster_throttle_waits(self, record: Record) -> None:
        space, now = self.space, self.now
        for owner, key, (calls, period, burst, cost), etcd_key, revision, left, waited in record[
            "rows"
        ]:
            session = self.sessions[owner]
            assert isinstance(session, ClusterSession)
            rate = Rate(calls, period, burst, cost)
            wait = ThrottleWait(
                session, raw(key), rate, raw(etcd_key), revision, now + left, now - waited
            )
            wait.suspended = True  # its connection's next task waits on for it
            space.ledger.waits[session.id] = wait
            space.throttles.live.add(wait.etcd_key)  # not a stray to the sweep

    def _cluster_answers(self, record: Record) -> None:
        for owner, *answer in record["rows"]:
            self.answers[owner] = _answer(answer)

    def _session(self, place: int) -> ClusterSession:
        session = self.sessions[place]
        assert isinstance(session, ClusterSession)
        return session

    def pending(self, ref: int) -> Any:
        """A waiting request taken over: its answer if it had one, else its wait
        (suspended in the books)."""
        request = self.space.waiting_request(self._session(ref), None)
        request.answer = self.answers.get(ref)
        return request

    def finish(self, gone: list[Session]) -> None:
        """Their frees and record writes go to etcd once the node has joined."""
        for session in gone:
            assert isinstance(session, ClusterSession)
            self.space.node.ended_at_join.append(session)

    def counts(self) -> tuple[int, int]:
        return len(self.sessions), self.holds
