"""The backend interface: what the protocol layer asks of a lock backend (the verbs;
the counters both backends keep live in their ``books``).

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

The interface is the verbs and nothing else. What a backend counts, and the
hooks that report it, live in its bookkeeping object (``books``, an
:class:`elockd.engine.bookkeeping.Bookkeeping`); what a hand-over moves, the
backend writes and reads itself (:meth:`Backend.dump`, :meth:`Backend.restore`,
records as :mod:`elockd.backend.state` frames them). One vocabulary for both
backends: a lock's kind is ``shared: bool``, and "no limit" is ``None``.

This module imports nothing of elockd but the engine and the record format, so
both backends and the protocol layer can depend on it without a cycle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, TypeAlias, TypeVar

from elockd.backend.state import TableDump, TableRestore
from elockd.engine.bookkeeping import Bookkeeping, QueueFull, TooManyHolds
from elockd.engine.gcra import Rate, Verdict
from elockd.engine.sessions import Session
from elockd.engine.throttles import TooManyThrottles

# Re-exported: the engine's refusals are every backend's.
__all__ = ["QueueFull", "TooManyHolds", "TooManyThrottles"]

T = TypeVar("T")


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


#: What a backend may refuse a request with, in any family.
REFUSALS = (TooManyHolds, QueueFull, TooManyThrottles, BackendUnavailable)

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


class KeyRow:
    """``ls``: one key with a hold or a waiter. The fields of :class:`KeyInfo`, plus
    ``age``: seconds since the oldest hold on the key was granted (None: the key
    has waiters and no hold)."""

    __slots__ = ("age", "key", "owner", "shared", "token", "ttl", "waiting")

    def __init__(
        self,
        key: bytes,
        owner: bytes | None,
        shared: int,
        waiting: int,
        age: float | None,
        token: int | None,
        ttl: float | None,
    ) -> None:
        self.key = key
        self.owner = owner
        self.shared = shared
        self.waiting = waiting
        self.age = age
        self.token = token
        self.ttl = ttl

    def __repr__(self) -> str:
        return (
            f"KeyRow({self.key!r}, owner={self.owner!r}, shared={self.shared}, "
            f"waiting={self.waiting}, age={self.age}, token={self.token}, ttl={self.ttl})"
        )


class Evicted(NamedTuple):
    """``kill K``: one hold an operator freed: its session's owner (as ``d`` shows
    it) and ``IP:PORT``, its kind, and its fencing token (0 for a shared hold)."""

    owner: bytes
    peer: bytes
    shared: bool
    token: int


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

#: ``ls``: the rows, produced as the reply is sent. A ``None`` among them stands for
#: a stretch of keys read and left out (``older=``): the reply yields to other
#: connections there, so a long filtered scan never holds the server. A backend
#: that has no such stretches never yields one.
KeyRows: TypeAlias = Iterator[KeyRow | None]

#: ``d``/``sd``/``dump``: (key, owner, address) of every hold listed, produced as the
#: dump is sent. The owner is the session's ``iam`` name, else its ``IP:PORT``.
Holders: TypeAlias = Iterator[tuple[bytes, bytes, bytes]]


class Backend(ABC):
    """The verbs a lock backend answers: what the protocol layer, the deadline
    timer and the hand-over ask of it, and nothing else."""

    #: Which tables a hand-over state carries: a successor must run the same kind.
    kind: ClassVar[str]

    @property
    @abstractmethod
    def books(self) -> Bookkeeping:
        """Counters, table sizes and hooks: what `q` and /metrics read, and what the
        server points at its histograms, timer and audit log."""

    # Sessions.
    @abstractmethod
    def open_session(self, session_id: str, peer: bytes) -> Session: ...
    @abstractmethod
    def disconnect(self, session: Session, now: float) -> None: ...
    @abstractmethod
    def take_over(self, session_id: str, current: Session) -> Result[Session | None]:
        """``conn_id ID``: the session this connection now serves, or None."""

    @abstractmethod
    def rename(self, session: Session, name: bytes | None) -> Result[None]:
        """``iam``: the name ``d``, ``sd`` and ``info`` show for its holds."""

    # The terse family's one-key operations (``i`` and ``si`` ask ``info``, ``sg``
    # asks ``lock_shared``).
    @abstractmethod
    def acquire(self, session: Session, key: bytes, now: float) -> Result[bool]:
        """``g``: ``lock`` of one key, tried once, without a lease."""

    @abstractmethod
    def release(self, session: Session, key: bytes, now: float) -> Result[bool]: ...
    @abstractmethod
    def release_shared(self, session: Session, key: bytes, now: float) -> Result[int | None]:
        """The holders left, or None when this session held none."""

    @abstractmethod
    def holders(self, shared: bool, key: bytes | None, *, ordered: bool = False) -> Result[Holders]:
        """Every hold of a table (``key`` None) or of one key; ``ordered``: keys in
        byte order (glockd's ``dump``)."""

    # The word family's requests.
    @abstractmethod
    def lock(
        self, session: Session, keys: list[bytes], now: float, *, wait: float, ttl: float | None
    ) -> Result[Grant]:
        """Exclusive, all or nothing (several keys: ``mlock``); ``wait`` 0 tries once."""

    @abstractmethod
    def lock_shared(
        self,
        session: Session,
        key: bytes,
        now: float,
        *,
        limit: int | None,
        wait: float,
        ttl: float | None,
    ) -> Result[Grant]:
        """Shared; ``limit`` None: no limit (``sg``), else at most that many holders."""

    @abstractmethod
    def release_all(self, session: Session, now: float) -> Result[None]: ...
    @abstractmethod
    def renew(self, session: Session, key: bytes, now: float, ttl: float) -> bool: ...
    def token(self, session: Session, key: bytes) -> int | None:
        """The fencing token of the session's exclusive hold on ``key`` (None: it
        holds none), as the session's own books have it."""
        hold = session.exclusive.get(key)
        return None if hold is None else hold.token

    @abstractmethod
    def info(self, key: bytes, now: float) -> Result[KeyInfo]: ...

    # The deadline gate: every reply that confirms, describes or lists a hold passes
    # it after the last await of its request (elockd.protocol.connection.gated).
    def deadline_gate(self) -> Callable[[float], bool] | None:
        """What the gate asks, as late as it can, before a reply about a hold is
        sent, given when its request was read: True when this backend can no longer
        vouch for what it answers about holds (a cluster node past its lease's
        local deadline, without a lease, or whose sessions were lost since the
        request was read), and the reply becomes the family's refusal. None when every answer
        holds good whenever it is sent (one process's memory decides alone): then
        no reply pays for a check at all."""
        return None

    # ``watch`` (elockd.engine.watchers): the backend reports every grant and free
    # to ``books.watchers``; a new watcher first gets a snapshot, from here.
    def watch_keys(self, prefix: bytes, after: bytes | None, count: int) -> list[bytes]:
        """Up to ``count`` keys that start with ``prefix``, in byte order, from the
        first (``after`` None) or just past ``after``: every key held now among them,
        and perhaps some no longer held (they show no line). A new watcher's snapshot
        reads them a batch at a time (:func:`elockd.engine.watchers.snapshot`), so
        it costs the keys under its prefix and holds one batch of them."""
        raise NotImplementedError(f"{self.kind} backend: watch")

    def watch_lines(self, key: bytes) -> list[bytes]:
        """The ``+`` lines of every hold on ``key`` now, as a snapshot shows them
        (the exclusive holder, then shared holders with ``holders=1..N``)."""
        raise NotImplementedError(f"{self.kind} backend: watch")

    # Operators (docs/protocol.md: ``ls``, ``kill``).
    @abstractmethod
    def listing(
        self, prefix: bytes, now: float, *, older: float | None, limit: int | None
    ) -> Result[KeyRows]:
        """``ls``: every key with a hold or a waiter that starts with ``prefix``, in
        byte order, produced lazily as the reply is sent (weakly consistent, as
        :meth:`holders`: a key live for the whole listing is listed exactly once).
        ``older``: only keys whose oldest hold is at least that many seconds old;
        ``limit``: at most that many rows (the handler asks for one more than the
        client's N, to learn whether to say there are more). Costs O(keys listed),
        not O(every key)."""

    @abstractmethod
    def kill(self, key: bytes, now: float) -> Result[list[Evicted]]:
        """``kill K``: free every hold on ``key`` (exclusive and shared) whoever owns
        it, counting each in ``books.killed``; the holds freed. Waiters are served as
        on a release, and the next exclusive grant has a larger fencing token. The
        caller checked that the connection is an operator's."""

    @abstractmethod
    def throttle(
        self, session: Session, key: bytes, now: float, rate: Rate, *, wait: float
    ) -> Result[Verdict]:
        """``throttle K COUNT PERIOD``: admitted or not by the GCRA
        (:mod:`elockd.engine.gcra`); ``wait`` 0 answers at once, else the request
        may wait that long in the key's line (``session`` owns the wait, not the
        key: its disconnect cancels it). Refused with :class:`TooManyThrottles` at
        ``--max-throttles`` keys, :class:`QueueFull` at ``--max-waiters`` in line."""

    # The deadline timer, and the backend's own work beside it.
    @abstractmethod
    def next_deadline(self) -> float | None: ...
    @abstractmethod
    def advance(self, now: float, budget: int | None = None) -> bool:
        """Run what is due by ``now`` (at most ``budget`` deadlines); True when more
        is due, so the timer lets other tasks run before it goes on."""

    def background(self) -> Callable[..., Awaitable[None]] | None:
        """The task the backend runs for as long as the server does (started with
        ``nursery.start``), or None when it needs none."""
        return None

    # A hand-over (docs/upgrade.md): the connections are parked and the timer is
    # stopped; what else the backend runs on its own must stand still too. A
    # backend that runs nothing on its own has nothing to do in these four.
    def freeze(self) -> None:
        """Stop changing the tables on the backend's own initiative."""
        return None  # a backend that runs nothing on its own

    async def settle(self) -> None:
        """Return once work already under way that changes the tables has ended."""
        return None  # a backend that runs nothing on its own

    def thaw(self) -> None:
        """The hand-over failed: go on as before."""
        return None  # a backend that runs nothing on its own

    def hand_off(self) -> None:
        """The successor has the tables: change nothing outside this process again."""
        return None  # a backend that runs nothing on its own

    @abstractmethod
    def dump(self, now: float, pending: Sequence[tuple[Session, Later[Any]]]) -> TableDump:
        """The tables as hand-over records; ``pending``: the waiting requests parked
        connections still have to answer, with their sessions."""

    @abstractmethod
    def restore(self, now: float) -> TableRestore:
        """Takes a predecessor's records into this fresh backend (one with no
        sessions yet, else :class:`~elockd.backend.state.StateError`)."""
