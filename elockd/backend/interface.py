"""The backend interface: what the protocol layer asks of a lock backend, and the
bookkeeping both backends keep the same way.

Two backends answer the same questions: the in-memory engine
(:class:`elockd.backend.memory.MemoryBackend`, on the pure :class:`elockd.engine.locks.LockEngine`)
and a cluster node keeping its locks in etcd
(:class:`elockd.backend.cluster.space.ClusterLockSpace`). The command handlers
(:mod:`elockd.protocol.terse`, :mod:`elockd.protocol.word`) are written once
against :class:`Backend`: they parse a request, call one operation, and format
its result. A backend never formats a reply.

An operation answers at once (a plain value) or later: a :class:`Later` wraps the
coroutine that produces the value, because the request waits for a grant or needs
the backend's I/O. The in-memory backend answers at once except when a request
waits; a cluster node answers every operation that touches etcd later.

This module is a leaf: it imports nothing of elockd but the plain records of
:mod:`elockd.engine.sessions` and the deadline heap, so both backends and the protocol
layer can depend on it without a cycle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sized
from typing import Generic, Protocol, TypeAlias, TypeVar

from elockd.engine.deadlines import Deadlines
from elockd.engine.sessions import WAITING, Hold, Session, Waiter

T = TypeVar("T")


#: Why a session's plain holds were freed, as ``on_session_end`` hears it.
ENDED_DISCONNECTED = "disconnected"
ENDED_GRACE_EXPIRED = "grace expired"
ENDED_SESSION_LIMIT = "session limit"


class TooManyHolds(Exception):
    """The session already has ``--max-holds`` holds; a new one would pass the limit."""


class QueueFull(Exception):
    """A key's queue already holds ``--max-waiters`` requests."""


class BackendUnavailable(Exception):
    """The backend cannot decide now (etcd has no quorum): the request fails closed."""


class Grant:
    """What a request to take locks got: ``granted``; for shared locks ``count``, the
    holders after it; for a refused multi-key request, the keys others hold."""

    __slots__ = ("blocked", "count", "granted")

    def __init__(self, granted: bool, count: int = 0, blocked: list[bytes] | None = None) -> None:
        self.granted = granted
        self.count = count
        self.blocked = [] if blocked is None else blocked

    def __repr__(self) -> str:
        return f"Grant({self.granted}, {self.count}, {self.blocked})"


#: The two answers of an exclusive request that carry nothing more.
GRANTED = Grant(True)
REFUSED = Grant(False)


class KeyInfo:
    """``info K``: the exclusive holder's owner and token (None when free), the
    seconds left on its lease (None without one), shared holders, waiting requests."""

    __slots__ = ("owner", "shared", "token", "ttl", "waiting")

    def __init__(
        self,
        owner: bytes | None = None,
        token: int | None = None,
        ttl: float | None = None,
        shared: int = 0,
        waiting: int = 0,
    ) -> None:
        self.owner = owner
        self.token = token
        self.ttl = ttl
        self.shared = shared
        self.waiting = waiting


class Later(Generic[T]):
    """A result that comes later. ``run`` produces it; ``waits`` marks a request
    waiting for a grant, which the server abandons when its client goes away (the
    session's disconnect then cancels the wait). A request that only needs the
    backend's I/O runs to its end."""

    __slots__ = ("run", "waits")

    def __init__(self, run: Callable[[], Awaitable[T]], *, waits: bool = False) -> None:
        self.run = run
        self.waits = waits


#: An operation's result: the value now, or later.
Result: TypeAlias = T | Later[T]

#: ``d``/``sd``/``dump``: (key, owner, address) of every hold listed, produced as the
#: dump is sent. The owner is the session's ``iam`` name, else its ``IP:PORT``.
Holders: TypeAlias = Iterator[tuple[bytes, bytes, bytes]]


class Backend(Protocol):
    """What the protocol layer, the deadline timer, ``q`` and /metrics need."""

    # Tables, read as len() by `q` and /metrics.
    @property
    def sessions(self) -> Sized: ...
    @property
    def exclusive(self) -> Sized: ...
    @property
    def shared(self) -> Sized: ...

    # Counters, kept on the way (a scrape costs O(1)).
    orphans: int
    shared_orphans: int
    expired: int
    timeouts: int
    leases: int
    sessions_in_grace: int

    @property
    def shared_holders(self) -> int: ...
    @property
    def waiting(self) -> int: ...

    # Hooks (histograms, the deadline timer, the audit log).
    on_new_deadline: Callable[[], None] | None
    on_hold_end: Callable[[bool, float], None] | None
    on_holds_end: Callable[[bool, list[float]], None] | None
    on_wait_end: Callable[[bool, float], None] | None
    on_session_end: Callable[[Session, int, int, str], None] | None

    def extra_counters(self) -> dict[str, int]: ...

    # Sessions.
    def open_session(self, session_id: str, peer: bytes) -> Session: ...
    def disconnect(self, session: Session, now: float) -> None: ...
    def take_over(self, session_id: str, current: Session) -> Result[Session | None]:
        """``conn_id ID``: the session this connection now serves, or None."""

    def rename(self, session: Session, name: bytes | None) -> Result[None]:
        """``iam``: the name ``d``, ``sd`` and ``info`` show for its holds."""

    # The terse family's one-key operations.
    def acquire(self, session: Session, key: bytes, now: float) -> Result[bool]: ...
    def release(self, session: Session, key: bytes, now: float) -> Result[bool]: ...
    def is_locked(self, key: bytes) -> Result[bool]: ...
    def share(self, session: Session, key: bytes, now: float) -> Result[int]:
        """``sg``: a shared hold without a limit; the holders after it."""

    def release_shared(self, session: Session, key: bytes, now: float) -> Result[int | None]:
        """The holders left, or None when this session held none."""

    def shared_count(self, key: bytes) -> Result[int]: ...
    def holders(self, shared: bool, key: bytes | None, *, ordered: bool = False) -> Result[Holders]:
        """Every hold of a table (``key`` None) or of one key; ``ordered``: keys in
        byte order (glockd's ``dump``)."""

    # The word family's requests.
    def lock(
        self, session: Session, keys: list[bytes], now: float, *, wait: float, ttl: float | None
    ) -> Result[Grant]:
        """Exclusive, all or nothing (several keys: ``mlock``); ``wait`` 0 tries once."""

    def lock_shared(
        self,
        session: Session,
        key: bytes,
        now: float,
        *,
        limit: int | None,
        wait: float,
        ttl: float | None,
    ) -> Result[Grant]: ...
    def release_all(self, session: Session, now: float) -> Result[None]: ...
    def renew(self, session: Session, key: bytes, now: float, ttl: float) -> bool: ...
    def token(self, session: Session, key: bytes) -> int | None: ...
    def info(self, key: bytes, now: float) -> Result[KeyInfo]: ...

    # The deadline timer.
    def next_deadline(self) -> float | None: ...
    def advance(self, now: float, budget: int | None = None) -> bool:
        """Run what is due by ``now`` (at most ``budget`` deadlines); True when more
        is due, so the timer lets other tasks run before it goes on."""

    # A hand-over (docs/upgrade.md): the connections are parked and the timer is
    # stopped; what else the backend runs on its own must stand still too.
    def freeze(self) -> None:
        """Stop changing the tables on the backend's own initiative."""

    async def settle(self) -> None:
        """Return once work already under way that changes the tables has ended."""

    def thaw(self) -> None:
        """The hand-over failed: go on as before."""

    def hand_off(self) -> None:
        """The successor has the tables: change nothing outside this process again."""


def carries(deadline: float, target: Hold | Session | Waiter) -> bool:
    """Whether a deadline-heap entry is current: its target still ends at
    ``deadline`` (a renewed or freed lease, a granted or cancelled wait, a session
    taken over or ended leaves a stale entry behind)."""
    if isinstance(target, Hold):
        return target.lease_deadline == deadline
    if isinstance(target, Waiter):
        return target.state == WAITING and target.deadline == deadline
    return target.grace_deadline == deadline and not target.connected


class Bookkeeping:
    """What both backends keep the same way: the counters `q` reads, the hooks, the
    hold limit, grace times, takeover adoption, lease deadlines, and what a hold's
    end costs in lease counts and hold-time histograms."""

    def __init__(self, *, max_holds: int = 10_000, max_waiters: int = 10_000) -> None:
        self.max_holds = max_holds
        self.max_waiters = max_waiters
        self._deadlines: Deadlines[Hold | Session | Waiter] = Deadlines(carries)
        self.on_new_deadline: Callable[[], None] | None = None
        self.on_hold_end: Callable[[bool, float], None] | None = None
        self.on_holds_end: Callable[[bool, list[float]], None] | None = None
        self.on_wait_end: Callable[[bool, float], None] | None = None
        # Hears of every session whose plain holds were freed because it ended (the
        # audit trail of orphans): (session, exclusive, shared, why).
        self.on_session_end: Callable[[Session, int, int, str], None] | None = None
        self.orphans = 0
        self.shared_orphans = 0
        self.expired = 0
        self.timeouts = 0
        self.leases = 0
        self.sessions_in_grace = 0

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

    def schedule(self, deadline: float, target: Hold | Session | Waiter) -> None:
        if self._deadlines.add(deadline, target) and self.on_new_deadline is not None:
            self.on_new_deadline()

    def next_deadline(self) -> float | None:
        """The earliest deadline in the heap (possibly a stale entry's), or None."""
        return self._deadlines.next()
