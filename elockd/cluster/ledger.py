"""A cluster node's own books: its sessions, their holds, their deadlines, its counters.

Pure: no I/O and no etcd. etcd decides who holds what; these books are what this
node has promised its own clients on etcd's word, kept apart from the etcd
conversations of :mod:`.ownership`, :mod:`.recipe` and :mod:`.node` because all
three read and change them. They are what ``q`` and /metrics read, what the
``on_*`` hooks report from, and the part that is closest to the in-memory engine's
own bookkeeping (:mod:`elockd.locks`).

A hold's fencing token is its entry's create revision plus the cluster's token
floor (``<prefix>meta/token_floor``, which :mod:`.node` loads at join): tokens then
increase across keys, nodes and rebuilt clusters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import trio

from elockd.backend import TooManyHolds
from elockd.cluster.layout import SHARED
from elockd.deadlines import Deadlines
from elockd.sessions import Hold, Session


class ClusterHold(Hold):
    """A hold whose truth is an etcd entry: ``revision`` guards its deletion."""

    __slots__ = ("revision", "ttl")

    def __init__(
        self, session: Session, key: bytes, shared: bool, revision: int, floor: int, now: float
    ) -> None:
        super().__init__(session, key, shared, floor + revision, now)
        self.revision = revision
        self.ttl: float | None = None


class ClusterSession(Session):
    """A session of this node, with the etcd lease its entries are bound to."""

    __slots__ = (
        "abort",
        "expires_at",
        "lease",
        "lost",
        "pending",
        "record_lock",
        "record_revision",
    )

    def __init__(self, session_id: str, peer: bytes) -> None:
        super().__init__(session_id, peer)
        self.lease = 0
        # Entries a request of this session is creating right now: not strays.
        self.pending: set[bytes] = set()
        self.expires_at = math.inf  # by this node's clock: when etcd may drop the lease
        self.record_revision = 0  # mod revision of our last write of its record
        self.record_lock = trio.Lock()
        self.lost = False
        self.abort: Callable[[], None] | None = None  # ends its connection


class Ledger:
    """This node's sessions (by id and by etcd lease), the holds they have, the heap
    of lease and grace ends, and the counters and hooks the server reads."""

    def __init__(self, max_holds: int) -> None:
        self.max_holds = max_holds
        self.token_floor = 0
        self.sessions: dict[str, ClusterSession] = {}
        self.by_lease: dict[int, ClusterSession] = {}
        self.deadlines: Deadlines[ClusterHold | ClusterSession] = Deadlines(_carries)
        self.on_new_deadline: Callable[[], None] | None = None
        self.on_hold_end: Callable[[bool, float], None] | None = None
        self.on_holds_end: Callable[[bool, list[float]], None] | None = None
        self.on_wait_end: Callable[[bool, float], None] | None = None
        self.orphans = 0
        self.shared_orphans = 0
        self.expired = 0
        self.timeouts = 0
        self.leases = 0
        self.sessions_in_grace = 0
        self.sessions_lost = 0
        self.local_waiting = 0

    # --------------------------------------------------------------- sessions

    def let_go(self, session: ClusterSession) -> None:
        """The session is no longer this node's (ended, lost or moved)."""
        self.sessions.pop(session.id, None)
        if self.by_lease.get(session.lease) is session:
            del self.by_lease[session.lease]

    def local_hold(self, lease: int, key: bytes) -> ClusterHold | None:
        """The exclusive hold on ``key`` of this node's session with ``lease``."""
        session = self.by_lease.get(lease)
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
        self, session: ClusterSession, kind: bytes, key: bytes, revision: int, now: float
    ) -> ClusterHold:
        shared = kind == SHARED
        hold = ClusterHold(session, key, shared, revision, self.token_floor, now)
        (session.shared if shared else session.exclusive)[key] = hold
        return hold

    def untrack(self, hold: ClusterHold) -> None:
        """Forget a hold locally (etcd is told separately, or already knows)."""
        table = hold.session.shared if hold.shared else hold.session.exclusive
        if table.get(hold.key) is hold:
            del table[hold.key]
        if hold.lease_deadline is not None:
            hold.lease_deadline = None
            self.leases -= 1

    def drop(self, hold: ClusterHold, now: float) -> None:
        self.untrack(hold)
        if self.on_hold_end is not None:
            self.on_hold_end(hold.shared, now - hold.granted_at)

    def check_hold_room(self, session: Session, new: int) -> None:
        if len(session.exclusive) + len(session.shared) + new > self.max_holds:
            raise TooManyHolds

    # ----------------------------------------------------------------- timers

    def set_lease(self, hold: ClusterHold, deadline: float) -> None:
        if hold.lease_deadline == deadline:
            return  # its entry is in the heap already (renews pipelined in one tick)
        if hold.lease_deadline is None:
            self.leases += 1
        hold.lease_deadline = deadline
        self.schedule(deadline, hold)

    def schedule(self, deadline: float, target: ClusterHold | ClusterSession) -> None:
        if self.deadlines.add(deadline, target) and self.on_new_deadline is not None:
            self.on_new_deadline()

    def next_deadline(self) -> float | None:
        return self.deadlines.next()

    def due(self, now: float) -> Iterator[ClusterHold | ClusterSession]:
        """Every lease end (a hold) and grace end (a session) due by ``now``."""
        for _, target in self.deadlines.due(now):
            yield target


def _carries(deadline: float, target: ClusterHold | ClusterSession) -> bool:
    """Whether a deadline-heap entry is current (its lease or grace still ends then)."""
    if isinstance(target, ClusterSession):
        return target.grace_deadline == deadline and not target.connected
    return target.lease_deadline == deadline
