"""What both lock backends keep the same way: the bookkeeping object.

Counters ``q`` and /metrics read, the hooks the server sets (histograms, the
deadline timer, the audit log), the hold limit, grace times, takeover adoption,
lease deadlines, and what a hold's end costs in lease counts and hold-time
histograms. The in-memory engine (:class:`elockd.engine.locks.LockEngine`) is one;
a cluster node's books (:class:`elockd.backend.cluster.ledger.Ledger`) are the
other. The backend interface (:mod:`elockd.backend.interface`) holds only verbs; a
backend's ``books`` is this object, and whatever reports numbers reads them here.

Pure: no trio, no I/O; time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeAlias

from elockd.engine.deadlines import Deadlines
from elockd.engine.sessions import WAITING, Hold, Session, Waiter
from elockd.engine.watchers import Watchers


class KnowsItsDeadlines(Protocol):
    """A heap target that tells its current deadlines itself (a throttle waiter:
    its turn and its timeout, :class:`elockd.engine.throttles.ThrottleWaiter`)."""

    def is_due(self, deadline: float) -> bool: ...


#: What the deadline heap holds: lease ends, wait ends, grace ends, and the rest.
Deadlined: TypeAlias = Hold | Session | Waiter | KnowsItsDeadlines

#: Why a session's plain holds were freed, as ``on_session_end`` hears it.
ENDED_DISCONNECTED = "disconnected"
ENDED_GRACE_EXPIRED = "grace expired"
ENDED_SESSION_LIMIT = "session limit"


class TooManyHolds(Exception):
    """The session already has ``--max-holds`` holds; a new one would pass the limit."""


class QueueFull(Exception):
    """A key's queue already holds ``--max-waiters`` requests."""


class Sizes(NamedTuple):
    """How big the tables are now, as ``q`` and /metrics show them: sessions, keys
    held exclusively, keys held shared, shared holders, waiting requests (throttle
    waits too), throttle keys with state."""

    sessions: int
    locks: int
    shared_locks: int
    shared_holders: int
    waiting: int
    throttles: int = 0


def carries(deadline: float, target: Deadlined) -> bool:
    """Whether a deadline-heap entry is current: its target still ends at
    ``deadline`` (a renewed or freed lease, a granted or cancelled wait, a session
    taken over or ended leaves a stale entry behind)."""
    if isinstance(target, Hold):
        return target.lease_deadline == deadline
    if isinstance(target, Waiter):
        return target.state == WAITING and target.deadline == deadline
    if isinstance(target, Session):
        return target.grace_deadline == deadline and not target.connected
    return target.is_due(deadline)


class Bookkeeping:
    """What both backends keep the same way: the counters `q` reads, the hooks, the
    hold limit, grace times, takeover adoption, lease deadlines, and what a hold's
    end costs in lease counts and hold-time histograms."""

    def __init__(self, *, max_holds: int = 10_000, max_waiters: int = 10_000) -> None:
        self.max_holds = max_holds
        self.max_waiters = max_waiters
        self._deadlines: Deadlines[Deadlined] = Deadlines(carries)
        self.on_new_deadline: Callable[[], None] | None = None
        self.on_hold_end: Callable[[bool, float], None] | None = None
        self.on_holds_end: Callable[[bool, list[float]], None] | None = None
        # (kind, seconds): kind 0 exclusive, 1 shared (a lock's ``shared`` flag), 2 a
        # throttle (elockd.engine.throttles.THROTTLE_KIND).
        self.on_wait_end: Callable[[int, float], None] | None = None
        # Hears of every session whose plain holds were freed because it ended (the
        # audit trail of orphans): (session, exclusive, shared, why).
        self.on_session_end: Callable[[Session, int, int, str], None] | None = None
        self.orphans = 0
        self.shared_orphans = 0
        self.expired = 0
        self.timeouts = 0
        # Holds an operator freed with ``kill K`` (exclusive and shared).
        self.killed = 0
        # Throttle requests answered 200 (admitted) and 409 (throttled).
        self.admitted = 0
        self.throttled = 0
        self.leases = 0
        self.sessions_in_grace = 0
        # ``watch``: every grant and free is reported here, behind one test of
        # ``watchers.active`` (elockd.engine.watchers).
        self.watchers = Watchers()

    def sizes(self) -> Sizes:
        """The tables' sizes now: each backend counts its own tables."""
        raise NotImplementedError

    def extra_counters(self) -> dict[str, int]:
        """Backend-specific `q` counters (none unless a backend adds some)."""
        return {}

    def check_hold_room(self, session: Session, new: int) -> None:
        if len(session.exclusive) + len(session.shared) + new > self.max_holds:
            raise TooManyHolds

    # ----------------------------------------------------------- grace times

    def start_grace(self, session: Session, now: float) -> None:
        """The connection is gone and the session lives on for ``session.grace``."""
        if session.grace_deadline is None:
            self.sessions_in_grace += 1
        session.grace_deadline = now + session.grace
        self.schedule(session.grace_deadline, session)

    def stop_grace(self, session: Session) -> None:
        """The grace time is over or was cut short (a takeover); its heap entry goes
        stale."""
        if session.grace_deadline is not None:
            self.sessions_in_grace -= 1
        session.grace_deadline = None

    def adopt(self, target: Session, current: Session) -> None:
        """``conn_id``: ``current``'s connection now serves ``target``, which keeps
        its holds and takes the connection's peer (and name, if it set one)."""
        target.connected = True
        self.stop_grace(target)
        target.peer = current.peer
        if current.name is not None:
            target.name = current.name
        current.connected = False

    # ---------------------------------------------------------------- leases

    def set_lease(self, hold: Hold, deadline: float) -> None:
        """Make ``hold`` a lease ending at ``deadline`` (or move its end)."""
        if hold.lease_deadline == deadline:
            return  # its entry is in the heap already (renews pipelined in one tick)
        if hold.lease_deadline is None:
            self.leases += 1
            hold.session.leases += 1
        hold.lease_deadline = deadline
        self.schedule(deadline, hold)

    def end_lease(self, hold: Hold) -> None:
        """The hold goes (freed, expired, let go): it is no lease any more."""
        if hold.lease_deadline is not None:
            hold.lease_deadline = None  # its heap entry goes stale
            self.leases -= 1
            hold.session.leases -= 1

    def hold_ended(self, hold: Hold, now: float) -> None:
        """Account for a hold that is gone: lease counts and the hold-time hook."""
        self.end_lease(hold)
        if self.on_hold_end is not None:
            self.on_hold_end(hold.shared, now - hold.granted_at)

    # ------------------------------------------------------------- deadlines

    def schedule(self, deadline: float, target: Deadlined) -> None:
        if self._deadlines.add(deadline, target) and self.on_new_deadline is not None:
            self.on_new_deadline()

    def next_deadline(self) -> float | None:
        """The earliest deadline in the heap (possibly a stale entry's), or None."""
        return self._deadlines.next()
