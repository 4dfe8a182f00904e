"""A cluster node's own books: its sessions, their holds, their deadlines, its counters.

No I/O and no etcd (a session's record lock, a ``trio.Lock`` held only around the
writes of its record, is the one trio object here). etcd decides who holds what;
these books are what this node has promised its own
clients on etcd's word, kept apart from the etcd conversations of the parts
(:mod:`.records`, :mod:`.ends`, :mod:`.takeover`, :mod:`.recipe`, :mod:`.node`)
because all of them read and change them. They are what ``q`` and /metrics read,
what the ``on_*`` hooks report from, and the part that is closest to the in-memory
engine's own bookkeeping (:mod:`elockd.engine.locks`).

A hold's fencing token is worked out by the rule in :mod:`.tokens`, from its
entry's create revision and rank and the cluster's token floor kept here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from elockd.backend.cluster.layout import EXCLUSIVE, SHARED
from elockd.backend.cluster.tokens import fencing_token
from elockd.backend.interface import Grant
from elockd.engine.bookkeeping import Bookkeeping, Sizes
from elockd.engine.gcra import Rate, Verdict
from elockd.engine.sessions import Hold, Session

if TYPE_CHECKING:
    from elockd.backend.cluster.calls import EtcdCalls
    from elockd.backend.cluster.mirror import QueueMirror


class ClusterHold(Hold):
    """A hold whose truth is an etcd entry: ``revision`` guards its deletion."""

    __slots__ = ("revision", "ttl")

    def __init__(
        self, session: Session, key: bytes, shared: bool, revision: int, token: int, now: float
    ) -> None:
        super().__init__(session, key, shared, token, now)
        self.revision = revision
        self.ttl: float | None = None


#: Session's own slot for ``abort``, under ClusterSession's property of that name.
_SESSION_ABORT = Session.__dict__["abort"]


class ClusterSession(Session):
    """A session of this node, with the tag that names it in its entries' keys (0
    until it first needs etcd: a session that takes no lock writes nothing there).
    Its entries hang on the node's etcd lease."""

    __slots__ = (
        "lost",
        "pending",
        "record_lock",
        "record_revision",
        "tag",
    )

    def __init__(self, session_id: str, peer: bytes) -> None:
        self.lost = False  # before Session's __init__ sets abort (see below)
        super().__init__(session_id, peer)
        self.tag = 0
        # Entries a request of this session is creating right now: not strays.
        self.pending: set[bytes] = set()
        self.record_revision = 0  # mod revision of our last write of its record
        self.record_lock = trio.Lock()

    @property
    def abort(self) -> Callable[[], None] | None:
        abort: Callable[[], None] | None = _SESSION_ABORT.__get__(self, Session)
        return abort

    @abort.setter
    def abort(self, abort: Callable[[], None] | None) -> None:
        """How the session's connection is ended. A session lost before its
        connection was served (a successor that found the node's lease gone as it
        joined, before any connection of it ran) is ended as soon as it is."""
        _SESSION_ABORT.__set__(self, abort)
        if abort is not None and self.lost:
            abort()


@dataclass(eq=False)
class ClusterWait:
    """A request of ``session`` whose entries (``revision``) wait in etcd's queues for
    ``keys``. Its task runs the wait, and the books keep this copy of it, so that a
    hand-over can move it (docs/upgrade.md). ``suspended``: its task ended while a
    hand-over copied the books, and the next task that serves its connection (here
    after a failed hand-over, or on the successor) waits on for it."""

    session: ClusterSession
    kind: bytes
    keys: list[bytes]
    entries: list[bytes]
    revision: int
    limit: int
    ttl: float | None
    deadline: float  # by this node's clock
    since: float
    suspended: bool = False


@dataclass(eq=False)
class ThrottleWait:
    """A ``throttle ... wait=S`` request of ``session`` in its key's line: its entry
    (``etcd_key``, created at ``revision``), its rate and deadline (this node's
    monotonic clock). Kept in the books as a lock wait is, so that a hand-over can
    move it (docs/upgrade.md); ``suspended`` as there."""

    session: ClusterSession
    key: bytes
    rate: Rate
    etcd_key: bytes
    revision: int
    deadline: float  # by this node's clock
    since: float
    suspended: bool = False


@dataclass(eq=False)
class ClusterAnswer:
    """How a waiting request ended: its grant, or the refusal it raised. Kept with
    the request, because a hand-over may pause its connection before the reply goes
    out: the reply is then whoever serves the connection next's to send."""

    grant: Grant | Verdict | None = None
    refusal: Exception | None = None

    def give(self) -> Grant | Verdict:
        if self.refusal is not None:
            raise self.refusal
        assert self.grant is not None
        return self.grant


class Ledger(Bookkeeping):
    """This node's sessions (by id and by tag), the holds they have, and what
    every backend keeps (:class:`~elockd.engine.bookkeeping.Bookkeeping`: counters,
    hooks, the heap of lease and grace ends): the cluster backend's ``books``. The
    lock tables' sizes are the mirror's (the cluster's, not this node's), and the
    count of etcd calls that failed is the calls wrapper's."""

    def __init__(
        self, max_holds: int, max_waiters: int, mirror: QueueMirror, calls: EtcdCalls
    ) -> None:
        super().__init__(max_holds=max_holds, max_waiters=max_waiters)
        self.mirror = mirror
        self.calls = calls
        self.token_floor = 0
        self.sessions: dict[str, ClusterSession] = {}
        self.by_tag: dict[int, ClusterSession] = {}
        #: Tags of sessions another node took over, until when (this node's clock):
        #: their entries still on this node's lease are that node's to move or free.
        self.moved_tags: dict[int, float] = {}
        #: Tags of sessions whose entries a takeover here is moving onto this node's
        #: lease: the stray sweep leaves them until their holds are recorded.
        self.adopting: set[int] = set()
        self.sessions_lost = 0
        self.local_waiting = 0
        #: The waiting request of each session that has one, by session id.
        self.waits: dict[str, ClusterWait | ThrottleWait] = {}

    def sizes(self) -> Sizes:
        # From the node's copy, which trails etcd; ``waiting`` also counts this
        # node's own waits that etcd has answered and the copy does not show yet.
        mirror = self.mirror
        return Sizes(
            len(self.sessions),
            mirror.exclusive_locks(),
            mirror.shared_locks(),
            mirror.shared_holders(),
            mirror.waiting() + mirror.unseen_waiting_entries() + mirror.throttles.waiting,
            mirror.throttles.size(),
        )

    def extra_counters(self) -> dict[str, int]:
        """`q` lines only a cluster node has."""
        return {
            "backend_unavailable": self.calls.backend_unavailable,
            "local_waiting": self.local_waiting,
            "sessions_lost": self.sessions_lost,
        }

    # --------------------------------------------------------------- sessions

    def open_session(self, session_id: str, peer: bytes) -> ClusterSession:
        """A new session of this node: it writes nothing to etcd until it first
        takes a lock (see :meth:`.records.SessionRecords.ensure_record`)."""
        session = ClusterSession(session_id, peer)
        self.sessions[session_id] = session
        return session

    def let_go(self, session: ClusterSession) -> None:
        """The session is no longer this node's (ended, lost or moved)."""
        self.sessions.pop(session.id, None)
        wait = self.waits.get(session.id)
        if wait is not None and wait.session is session:
            del self.waits[session.id]
        if self.by_tag.get(session.tag) is session:
            del self.by_tag[session.tag]

    def suspended_wait(self, session: ClusterSession) -> ClusterWait | ThrottleWait | None:
        """The wait a hand-over stopped for ``session``, to be waited on for it."""
        wait = self.waits.get(session.id)
        if wait is None or wait.session is not session or not wait.suspended:
            return None
        return wait

    def local_hold(self, tag: int, key: bytes) -> ClusterHold | None:
        """The exclusive hold on ``key`` of this node's session ``tag``."""
        session = self.by_tag.get(tag)
        hold = session.exclusive.get(key) if session is not None else None
        return hold if isinstance(hold, ClusterHold) else None

    # ------------------------------------------------------------------ holds

    def holds(self, session: Session) -> list[ClusterHold]:
        holds: list[ClusterHold] = []
        for table in (session.exclusive, session.shared):
            for hold in table.values():
                assert isinstance(hold, ClusterHold)
                holds.append(hold)
        return holds

    def record_hold(
        self,
        session: ClusterSession,
        kind: bytes,
        key: bytes,
        revision: int,
        now: float,
        rank: int = 0,
    ) -> ClusterHold:
        """A hold this node now keeps for ``session``; ``rank`` is its entry's (see
        :func:`.tokens.fencing_token`)."""
        shared = kind == SHARED
        token = fencing_token(self.token_floor, revision, rank)
        hold = ClusterHold(session, key, shared, revision, token, now)
        (session.shared if shared else session.exclusive)[key] = hold
        return hold

    def untrack(self, hold: ClusterHold) -> None:
        """Forget a hold locally (etcd is told separately, or already knows)."""
        table = hold.session.shared if hold.shared else hold.session.exclusive
        if table.get(hold.key) is hold:
            del table[hold.key]
        self.end_lease(hold)

    def drop(self, hold: ClusterHold, now: float, why: bytes | None = None) -> None:
        """Forget a hold that ended (released, orphaned, expired): it counts. With
        ``why``, its entry is about to be deleted for that reason (or etcd deletes
        it with the node's lease): what this node's watchers hear when it goes."""
        table = hold.session.shared if hold.shared else hold.session.exclusive
        if table.get(hold.key) is hold:
            del table[hold.key]
        self.hold_ended(hold, now)
        session = hold.session
        if why is not None and isinstance(session, ClusterSession) and session.tag:
            kind = SHARED if hold.shared else EXCLUSIVE
            entry = self.mirror.layout.entry(kind, hold.key, session.tag)
            self.mirror.freeing(entry, hold.revision, why)

    # ----------------------------------------------------------------- timers

    def due(self, now: float) -> Iterator[ClusterHold | ClusterSession]:
        """Every lease end (a hold) and grace end (a session) due by ``now``."""
        for _, target in self._deadlines.due(now):
            assert isinstance(target, ClusterHold | ClusterSession)
            yield target
