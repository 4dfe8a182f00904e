"""The lock engine: every rule about who may hold what, and nothing else.

Pure Python: no trio, no sockets, no clock. Every call that depends on time takes
``now`` (seconds on any monotonic scale) from the caller, so the server passes
``trio.current_time()`` and the tests pass whatever they like. Waiting is expressed
as :class:`Waiter` records; when a waiter is granted the engine calls its ``wake``
callback, which the server points at a ``trio.Event``.

Tables
    * ``exclusive``: key -> the one :class:`Hold` (``g``, ``lock``, ``mlock``).
    * ``shared``: key -> its one Hold, or {session: Hold} once a second session
      holds it (``sg``, ``lock_shared``). A key may be held both ways at once; the
      tables are independent, as in elockd.
    * per-key FIFO queues of waiters, one set for each table. A queue is an
      insertion-ordered dict, so a waiter that leaves from the middle (its wait timed
      out, its client went away) costs O(1): 10,000 waits on one key timing out
      together must not cost 10,000 x 10,000 steps.
    * one heap of deadlines (lease ends, grace ends, wait ends). Entries are never
      removed from the middle; a stale entry (the lease was renewed or freed) is
      recognised when it reaches the top and dropped, so renewing costs O(log n) and
      nothing scans. The heap compacts itself once it doubles, so a renew flood
      leaves it at about twice the live deadlines (:mod:`elockd.engine.deadlines`).

Bounded slices of work
    Whatever a crowd can trigger at once is done in slices, so that no other client
    waits behind it (Redis frees big values lazily for the same reason):
    :meth:`advance` takes a ``budget`` of deadlines to run, and a session that ends
    while holding locks is freed inline only while this slice's budget of holds
    lasts; past it, it joins a queue that :meth:`advance` works through, a slice at a
    time. Until then its holds stay held: a hold is free only when the engine says so,
    so exclusion and grant order are exactly what they would be without slicing.

Invariants (checked by the model test in ``tests/test_engine_model.py``)
    * at most one exclusive holder per key;
    * a free exclusive key has no queue: a release hands the key to the head waiter
      immediately, so a try-once request can never overtake a waiter;
    * a shared waiter with ``limit=N`` is granted only while fewer than N hold the key;
    * a waiter is granted at most once, and never after it was cancelled.

Multi-key locks never deadlock: a waiter takes a key only when the key is free and
no older waiter queues for it (or it is itself the head of that key's queue). The
queues therefore all agree on one order, the order of arrival, so the oldest waiter
is never blocked by a younger one: only by plain holders, who release eventually.
The same order means that single-key requests arriving after a multi-key waiter
queue behind it: it is not starved.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator

from elockd.engine.bookkeeping import (
    ENDED_DISCONNECTED,
    ENDED_GRACE_EXPIRED,
    ENDED_SESSION_LIMIT,
    Bookkeeping,
    QueueFull,
    TooManyHolds,
)
from elockd.engine.keyindex import KeyIndex
from elockd.engine.sessions import CANCELLED, GRANTED, WAITING, Hold, Session, Waiter
from elockd.engine.throttles import Throttles, ThrottleWaiter
from elockd.engine.watchers import EXPIRED, KILLED, ORPHANED, RELEASED, free_line, grant_line

# Re-exported: the engine's callers (and its tests) name them through this module.
__all__ = [
    "CANCELLED",
    "ENDED_DISCONNECTED",
    "ENDED_GRACE_EXPIRED",
    "ENDED_SESSION_LIMIT",
    "FREE_SLICE",
    "GRANTED",
    "WAITING",
    "Blocked",
    "LockEngine",
    "QueueFull",
    "TooManyHolds",
    "Waiter",
]


#: Holds freed per slice when sessions end in a crowd (10,000 connections holding a
#: million locks dropping at once). About a millisecond of work; a single session
#: is never split, so one slice frees at most this plus ``max_holds``.
FREE_SLICE = 2000


Queue = OrderedDict[Waiter, None]


#: What :meth:`LockEngine.request_many` returns when it cannot grant at once and may
#: not wait: the keys held by other sessions.
Blocked = list[bytes]


#: What ``pop`` answers for a key not noted stale (a stale note's value is None).
NEW = object()


class LockEngine(Bookkeeping):
    """Exclusive and counted shared locks with FIFO waits, leases and sessions."""

    def __init__(
        self,
        *,
        first_token: int = 1,
        max_waiters: int = 10_000,
        max_holds: int = 10_000,
        max_sessions: int = 10_000,
        max_throttles: int = 1_000_000,
        free_slice: int = FREE_SLICE,
        on_new_deadline: Callable[[], None] | None = None,
        on_hold_end: Callable[[bool, float], None] | None = None,
        on_wait_end: Callable[[int, float], None] | None = None,
        on_holds_end: Callable[[bool, list[float]], None] | None = None,
    ) -> None:
        """``first_token`` seeds the fencing-token counter (the server passes the wall
        clock in nanoseconds, so tokens keep increasing across restarts).
        ``on_new_deadline`` is called when the earliest deadline moves earlier, so a
        timer task can re-arm; ``on_hold_end(shared, seconds)`` feeds hold-time
        histograms (``on_holds_end(shared, [seconds, ...])`` takes the holds a
        session frees at once, in one call) and ``on_wait_end(shared, seconds)``
        wait-time histograms (called once per request that waited, however its wait
        ended; ``shared`` is 0 or 1 for a lock, 2 for a throttle wait).
        ``max_sessions`` bounds the sessions kept without a connection;
        ``free_slice`` is how many holds of ending sessions one slice frees.
        ``max_throttles`` bounds the throttle keys with state (:attr:`throttles`).
        ``on_session_end(session, exclusive, shared, why)`` hears of every session whose
        plain holds were freed because it ended (the audit trail of orphans)."""
        super().__init__(max_holds=max_holds, max_waiters=max_waiters)
        self.sessions: dict[str, Session] = {}
        self.exclusive: dict[bytes, Hold] = {}
        # A shared key taken by one holder maps to that Hold; from a second holder on
        # to {session: Hold}. A dict per key costs 224 bytes, more than the hold
        # itself, and most shared keys have a single holder. Read it through
        # shared_count / shared_holds.
        self.shared: dict[bytes, Hold | dict[Session, Hold]] = {}
        self._xqueues: dict[bytes, Queue] = {}
        self._squeues: dict[bytes, Queue] = {}
        # Sessions whose holds wait to be freed in a later slice, and how many holds
        # this slice may still free inline (reset by advance()).
        self._ending: deque[tuple[Session, str]] = deque()
        self.free_slice = free_slice
        self._free_budget = free_slice
        self._arrivals = itertools.count(1)
        self._next_token = first_token
        self.max_sessions = max_sessions
        self.on_new_deadline = on_new_deadline
        self.on_hold_end = on_hold_end
        self.on_wait_end = on_wait_end
        self.on_holds_end = on_holds_end
        self.waiting = 0
        # Kept as ints on the existing paths so /metrics reads them in O(1): counting
        # them at scrape time would walk every shared key or every session.
        self.shared_holders = 0
        # Sessions in self.sessions without a connection (grace, leases, or ending).
        self.detached = 0
        # ``throttle``: its own namespace of keys, on this engine's deadline heap.
        self.throttles = Throttles(self, max_throttles=max_throttles)
        # ``ls``: the keys in byte order, kept lazily (elockd.engine.keyindex): a key
        # that goes is noted stale, one that comes back is taken out of the note,
        # inline (dict operations), and only a key new to the index is inserted.
        self.index = KeyIndex()
        self._stale = self.index.stale

    # ---------------------------------------------------------------- sessions

    def open_session(self, session_id: str, peer: bytes) -> Session:
        session = Session(session_id, peer)
        self.sessions[session_id] = session
        return session

    def disconnect(self, session: Session, now: float) -> None:
        """The session's connection is gone: cancel its waits, then free its plain
        holds now (grace 0) or when its grace time ends. Leases stay.

        A session that would live on without a connection while ``max_sessions``
        already do ends at once instead, leases and all (docs/protocol.md: Sessions)."""
        session.connected = False
        self.detached += 1
        for waiter in list(session.waiters):
            self.cancel(waiter, now)
        if session in self.throttles.by_session:
            self.throttles.cancel_session(session, now)
        lives_on = session.grace > 0 or session.leases > 0
        if lives_on and self.detached > self.max_sessions:
            self._end_now(session, now)
        elif session.grace > 0:
            self.start_grace(session, now)
        else:
            self._end_grace(session, now)

    def _end_now(self, session: Session, now: float) -> None:
        """Over ``max_sessions``: every hold goes, leases too, counted as orphans."""
        exclusive, shared = len(session.exclusive), len(session.shared)
        self.orphans += exclusive
        self.shared_orphans += shared
        for hold in [*session.exclusive.values(), *session.shared.values()]:
            self._free(hold, now, ORPHANED)
        self._forget_if_done(session)
        if self.on_session_end is not None:
            self.on_session_end(session, exclusive, shared, ENDED_SESSION_LIMIT)

    def take_over(self, session_id: str, current: Session) -> Session | None:
        """``conn_id ID``: move the connection of ``current`` (which must hold and
        wait for nothing) onto the disconnected session ``session_id``."""
        target = self.sessions.get(session_id)
        if target is None or target.connected or target.ending or not current.is_empty():
            return None
        self.detached -= 1
        self.adopt(target, current)
        self.sessions.pop(current.id, None)
        return target

    def _end_grace(self, session: Session, now: float, why: str = ENDED_DISCONNECTED) -> None:
        """Free the session's plain holds (they are orphans now): inline while this
        slice's budget lasts, else in a later slice of :meth:`advance`."""
        self.stop_grace(session)
        holds = len(session.exclusive) + len(session.shared)
        if holds > self._free_budget:
            session.ending = True  # its holds stay held until then; conn_id refuses it
            if not self._ending and self.on_new_deadline is not None:
                self.on_new_deadline()  # wake the timer: there is work now
            self._ending.append((session, why))
            return
        self._free_budget -= holds
        self._free_orphans(session, now, why)

    def _free_orphans(self, session: Session, now: float, why: str) -> None:
        if session.leases:
            exclusive = [h for h in session.exclusive.values() if h.lease_deadline is None]
            shared = [h for h in session.shared.values() if h.lease_deadline is None]
            self.orphans += len(exclusive)
            self.shared_orphans += len(shared)
            for hold in [*exclusive, *shared]:
                self._free(hold, now, ORPHANED)
            freed = len(exclusive), len(shared)
        else:
            freed = len(session.exclusive), len(session.shared)
            self._free_everything(session, now)
        session.ending = False
        self._forget_if_done(session)
        if self.on_session_end is not None and (freed[0] or freed[1]):
            self.on_session_end(session, *freed, why)

    def _free_ending(self, now: float) -> None:
        """Free queued ending sessions, whole, until this slice's budget is spent."""
        while self._ending and self._free_budget > 0:
            session, why = self._ending.popleft()
            self._free_budget -= len(session.exclusive) + len(session.shared)
            self._free_orphans(session, now, why)

    def _free_everything(self, session: Session, now: float) -> None:
        """:meth:`_free` for every hold of a session that owns no lease and waits for
        nothing, in one pass: when thousands of connections drop at once (a network
        partition, a client fleet restart) this is most of the server's work, and
        per-hold calls would double it. Waiters are still woken key by key."""
        exclusive = self.exclusive
        xqueues, squeues = self._xqueues, self._squeues
        self.orphans += len(session.exclusive)
        self.shared_orphans += len(session.shared)
        watchers = self.watchers if self.watchers.active else None
        shared, stale = self.shared, self._stale
        for key in session.exclusive:
            del exclusive[key]
            stale[key] = None  # its table has no hold left (see KeyIndex.stale)
            if watchers is not None:
                watchers.free(key, session.owner, False, 0, ORPHANED)
        for key, hold in session.shared.items():
            if shared[key] is hold:  # the key's only holder: _unshare's common case
                del shared[key]
                stale[key] = None
            else:
                self._unshare(hold)
            if watchers is not None:
                watchers.free(key, session.owner, True, self.shared_count(key), ORPHANED)
        self.shared_holders -= len(session.shared)
        freed_exclusive, freed_shared = session.exclusive, session.shared
        for is_shared, freed in ((False, freed_exclusive), (True, freed_shared)):
            if freed:
                self._report_hold_times(is_shared, [now - h.granted_at for h in freed.values()])
        session.exclusive, session.shared = {}, {}
        for key in freed_exclusive:
            if key in xqueues:
                self._serve_exclusive(key, now)
        for key in freed_shared:
            if key in squeues:
                self._serve_shared(key, now)

    def _report_hold_times(self, shared: bool, seconds: list[float]) -> None:
        if self.on_holds_end is not None:
            self.on_holds_end(shared, seconds)
        elif self.on_hold_end is not None:
            for each in seconds:
                self.on_hold_end(shared, each)

    def _forget_if_done(self, session: Session) -> None:
        if (
            not session.connected
            and session.grace_deadline is None
            and session.leases == 0
            and not session.ending
            and self.sessions.pop(session.id, None) is not None
        ):
            self.detached -= 1

    # --------------------------------------------------------------- exclusive

    def acquire(self, session: Session, key: bytes, now: float, ttl: float | None = None) -> bool:
        """Try once. A holder asking again keeps its one hold (``ttl`` sets its lease)."""
        hold = self.exclusive.get(key)
        if hold is None:
            # The check of check_hold_room, inlined: this is the hottest call of all.
            if len(session.exclusive) + len(session.shared) >= self.max_holds:
                raise TooManyHolds
            self._grant_exclusive(session, key, now, ttl)
            return True
        if hold.session is session:
            if ttl is not None:
                self.set_lease(hold, now + ttl)
            return True
        return False

    def wait_for(
        self,
        session: Session,
        key: bytes,
        now: float,
        ttl: float | None = None,
        timeout: float = math.inf,
    ) -> Waiter | None:
        """Acquire, or queue first come, first served, for at most ``timeout`` seconds
        (then the waiter is cancelled and woken). None means granted at once."""
        if self.acquire(session, key, now, ttl):
            return None
        self.check_hold_room(session, 1)
        self._check_room(self._xqueues, (key,))
        waiter = Waiter(session, (key,), shared=False, limit=1, ttl=ttl, since=now)
        _enqueue(self._xqueues, key, waiter)
        self._add_waiter(waiter, now + timeout)
        return waiter

    def release(self, session: Session, key: bytes, now: float) -> bool:
        hold = session.exclusive.get(key)
        if hold is None:
            return False
        self._free(hold, now)
        return True

    def _grant_exclusive(self, session: Session, key: bytes, now: float, ttl: float | None) -> Hold:
        stale = self._stale
        if key in stale:  # bytecode, not a call: this runs on every g
            del stale[key]
        elif key not in self.shared:
            self._index_key(key)  # neither noted stale nor held: new to the index
        hold = Hold(session, key, False, self._next_token, now)
        self._next_token += 1
        self.exclusive[key] = hold
        session.exclusive[key] = hold
        if ttl is not None:
            self.set_lease(hold, now + ttl)
        if self.watchers.active and (watching := self.watchers.matching(key)):
            line = grant_line(key, session.owner, False, hold.token)
            self.watchers.send(watching, key, line)
        return hold

    # --------------------------------------------------------------- multi-key

    def request_many(
        self,
        session: Session,
        keys: Iterable[bytes],
        now: float,
        *,
        ttl: float | None = None,
        wait: bool = False,
        timeout: float = math.inf,
    ) -> Waiter | Blocked | None:
        """All-or-nothing exclusive hold of ``keys``.

        Returns None when granted at once, the keys held by others when it may not
        wait, else a Waiter (waiting at most ``timeout`` seconds) that already holds
        every key it could take fairly.
        """
        wanted = tuple(dict.fromkeys(keys))
        blocked = [k for k in wanted if self._held_by_other(session, k)]
        if not blocked:
            self.check_hold_room(session, sum(k not in session.exclusive for k in wanted))
            for key in wanted:
                self.acquire(session, key, now, ttl)
            return None
        if not wait:
            return blocked
        missing = [k for k in wanted if k not in session.exclusive]
        self.check_hold_room(session, len(missing))
        self._check_room(self._xqueues, missing)
        waiter = Waiter(session, wanted, shared=False, limit=1, ttl=ttl, since=now)
        waiter.missing = len(missing)
        self._add_waiter(waiter, now + timeout)
        for key in missing:
            if key in self.exclusive:
                _enqueue(self._xqueues, key, waiter)
            else:  # free, hence no queue: nobody older wants it
                self._take_for(waiter, key, now)
        return waiter

    def _held_by_other(self, session: Session, key: bytes) -> bool:
        hold = self.exclusive.get(key)
        return hold is not None and hold.session is not session

    def _take_for(self, waiter: Waiter, key: bytes, now: float) -> None:
        self._grant_exclusive(waiter.session, key, now, None)
        waiter.taken.append(key)
        waiter.missing -= 1
        if waiter.missing == 0:
            self._complete(waiter, now)

    # ------------------------------------------------------------------ shared

    def acquire_shared(
        self,
        session: Session,
        key: bytes,
        now: float,
        *,
        limit: int | None = None,
        ttl: float | None = None,
    ) -> tuple[bool, int]:
        """Try once: (granted, holders after the request).

        Without a limit it always succeeds. With one, it succeeds only while fewer
        than ``limit`` hold the key and nobody queues for it (no overtaking).
        """
        own = session.shared.get(key)
        if own is not None:
            if ttl is not None:
                self.set_lease(own, now + ttl)
            return True, self.shared_count(key)
        count = self.shared_count(key)
        if limit is not None and (count >= limit or key in self._squeues):
            return False, count
        self.check_hold_room(session, 1)
        return True, self._grant_shared(session, key, now, ttl)

    def _grant_shared(self, session: Session, key: bytes, now: float, ttl: float | None) -> int:
        """Add a shared hold on ``key`` (a session that has one keeps it): the holder
        count."""
        if key in session.shared:
            return self.shared_count(key)
        stale = self._stale.pop(key, NEW) is not NEW
        if not stale and key not in self.shared and key not in self.exclusive:
            self._index_key(key)  # neither noted stale nor held: new to the index
        hold = Hold(session, key, True, 0, now)
        entry = self.shared.get(key)
        if entry is None:
            self.shared[key] = hold
            count = 1
        elif isinstance(entry, Hold):
            self.shared[key] = {entry.session: entry, session: hold}
            count = 2
        else:
            entry[session] = hold
            count = len(entry)
        self.shared_holders += 1
        session.shared[key] = hold
        if ttl is not None:
            self.set_lease(hold, now + ttl)
        if self.watchers.active and (watching := self.watchers.matching(key)):
            self.watchers.send(watching, key, grant_line(key, session.owner, True, count))
        return count

    def wait_shared(
        self,
        session: Session,
        key: bytes,
        now: float,
        *,
        limit: int,
        ttl: float | None = None,
        timeout: float = math.inf,
    ) -> Waiter | int:
        """Acquire with a limit, or queue FIFO for at most ``timeout`` seconds. An int
        is the holder count of a grant."""
        granted, count = self.acquire_shared(session, key, now, limit=limit, ttl=ttl)
        if granted:
            return count
        self.check_hold_room(session, 1)
        self._check_room(self._squeues, (key,))
        waiter = Waiter(session, (key,), shared=True, limit=limit, ttl=ttl, since=now)
        _enqueue(self._squeues, key, waiter)
        self._add_waiter(waiter, now + timeout)
        return waiter

    def release_shared(self, session: Session, key: bytes, now: float) -> int | None:
        """Free this session's shared hold: holders left (after any hand-over), or
        None when it held none."""
        hold = session.shared.get(key)
        if hold is None:
            return None
        self._free(hold, now)
        return self.shared_count(key)

    def shared_count(self, key: bytes) -> int:
        entry = self.shared.get(key)
        if entry is None:
            return 0
        return 1 if isinstance(entry, Hold) else len(entry)

    def _unshare(self, hold: Hold) -> None:
        """Take a shared hold out of the key's entry; the entry goes with its last
        holder. A dict stays a dict down to one holder: a busy key would otherwise
        build and drop one on every second grant."""
        key = hold.key
        entry = self.shared[key]
        if isinstance(entry, Hold):
            del self.shared[key]
        else:
            del entry[hold.session]
            if entry:
                return
            del self.shared[key]
        self._stale[key] = None  # its table has no hold left (see KeyIndex.stale)

    # ------------------------------------------------------------ both tables

    def _index_key(self, key: bytes) -> None:
        """A key granted for the first time since the index last swept it away."""
        due = self.index.add(key, len(self.exclusive) + len(self.shared))
        if due and self.on_new_deadline is not None:
            self.on_new_deadline()  # wake the timer: a sweep is due

    def is_live(self, key: bytes) -> bool:
        """Whether ``key`` has a hold (in memory a key with a waiter has one too: a
        free key has no queue, and a shared queue waits only while its head's limit
        is reached, a limit of 1 or more)."""
        return key in self.exclusive or key in self.shared

    def evict(self, key: bytes, now: float) -> list[Hold]:
        """``kill K``: free every hold on ``key``, exclusive and shared, whoever owns
        it, as a release would (its waiters are served, the next exclusive grant takes
        a larger fencing token); the holds freed, counted in ``killed``."""
        holds = [*self.exclusive_holds(key), *self.shared_holds(key)]
        for hold in holds:
            self._free(hold, now, KILLED)
            self._forget_if_done(hold.session)
        self.killed += len(holds)
        return holds

    def release_all(self, session: Session, now: float) -> None:
        for hold in list(session.exclusive.values()):
            self._free(hold, now)
        for hold in list(session.shared.values()):
            self._free(hold, now)

    def renew(self, session: Session, key: bytes, now: float, ttl: float) -> bool:
        """Make this session's hold of key (exclusive, else shared) a lease ending
        ``ttl`` seconds from now."""
        hold = session.exclusive.get(key) or session.shared.get(key)
        if hold is None:
            return False
        self.set_lease(hold, now + ttl)
        return True

    def _free(self, hold: Hold, now: float, why: bytes = RELEASED) -> None:
        """Remove a hold from every table, then hand the key to its next waiter(s).
        ``why`` it went is what watchers hear (released, expired, orphaned, killed):
        its free comes before the grants it makes.

        Every release runs this, so :meth:`hold_ended` (and its ``end_lease``) is
        written out here rather than called: two calls less per release. A change to
        what a hold's end accounts for goes in both places."""
        session, key = hold.session, hold.key
        if hold.lease_deadline is not None:
            hold.lease_deadline = None  # its heap entry goes stale
            self.leases -= 1
            session.leases -= 1
        if self.on_hold_end is not None:
            self.on_hold_end(hold.shared, now - hold.granted_at)
        if hold.shared:
            self._unshare(hold)
            self.shared_holders -= 1
            del session.shared[key]
            if self.watchers.active and (watching := self.watchers.matching(key)):
                line = free_line(key, session.owner, True, self.shared_count(key), why)
                self.watchers.send(watching, key, line)
            if key in self._squeues:
                self._serve_shared(key, now)
        else:
            del self.exclusive[key]
            del session.exclusive[key]
            self._stale[key] = None  # its table has no hold left (see KeyIndex.stale)
            if self.watchers.active and (watching := self.watchers.matching(key)):
                self.watchers.send(watching, key, free_line(key, session.owner, False, 0, why))
            if session.waiters:
                self._requeue_lost_key(session, key)
            if key in self._xqueues:
                self._serve_exclusive(key, now)

    def _requeue_lost_key(self, session: Session, key: bytes) -> None:
        """An ``mlock`` waiter counted a key its session already held as done; that
        hold's lease just ended, so the waiter needs the key again and queues for it,
        ahead of the waiters that arrived after it. Without this it would be granted
        while missing a key."""
        for waiter in session.waiters:
            if not waiter.shared and key in waiter.keys:
                waiter.missing += 1
                if key in waiter.taken:
                    waiter.taken.remove(key)
                # In its place by arrival, not at the back: every queue must keep the
                # one order of arrival, or two mlocks could each hold what the other
                # waits for (see the module docstring).
                queue = _enqueue(self._xqueues, key, waiter)
                for later in [w for w in queue if w.serial > waiter.serial]:
                    queue.move_to_end(later)

    def _serve_exclusive(self, key: bytes, now: float) -> None:
        queue = self._xqueues.get(key)
        if queue:
            waiter, _ = queue.popitem(last=False)
            if not queue:
                del self._xqueues[key]
            self._take_for(waiter, key, now)

    def _serve_shared(self, key: bytes, now: float) -> None:
        """Grant queued shared waiters, oldest first, while the head fits its limit."""
        queue = self._squeues.get(key)
        while queue:
            waiter = next(iter(queue))
            if self.shared_count(key) >= waiter.limit:
                return
            del queue[waiter]
            if not queue:
                del self._squeues[key]
            waiter.count = self._grant_shared(waiter.session, key, now, None)
            waiter.missing = 0
            self._complete(waiter, now)

    # ----------------------------------------------------------------- waiters

    def _check_room(self, queues: dict[bytes, Queue], keys: Iterable[bytes]) -> None:
        for key in keys:
            queue = queues.get(key)
            if queue is not None and len(queue) >= self.max_waiters:
                raise QueueFull(key)

    def _add_waiter(self, waiter: Waiter, deadline: float) -> None:
        waiter.serial = next(self._arrivals)
        waiter.session.waiters.add(waiter)
        self.waiting += 1
        if deadline < math.inf:
            waiter.deadline = deadline
            self.schedule(deadline, waiter)

    def _complete(self, waiter: Waiter, now: float) -> None:
        waiter.state = GRANTED
        waiter.session.waiters.discard(waiter)
        self.waiting -= 1
        if self.on_wait_end is not None:
            self.on_wait_end(waiter.shared, now - waiter.since)
        if waiter.ttl is not None:
            table = waiter.session.shared if waiter.shared else waiter.session.exclusive
            for key in waiter.keys:
                self.set_lease(table[key], now + waiter.ttl)
        if waiter.wake is not None:
            waiter.wake()

    def cancel(self, waiter: Waiter, now: float, *, timed_out: bool = False) -> Blocked:
        """Give up a wait (timeout or disconnect): leave every queue, free what an
        ``mlock`` took meanwhile. Returns the keys still held by others."""
        if waiter.state != WAITING:
            return []
        waiter.state = CANCELLED
        waiter.session.waiters.discard(waiter)
        self.waiting -= 1
        if self.on_wait_end is not None:
            self.on_wait_end(waiter.shared, now - waiter.since)
        if timed_out:
            self.timeouts += 1
        queues = self._squeues if waiter.shared else self._xqueues
        for key in waiter.keys:
            queue = queues.get(key)
            if queue is not None and queue.pop(waiter, False) is None and not queue:
                del queues[key]
        blocked = self.blocked_keys(waiter)
        if waiter.shared:
            self._serve_shared(waiter.keys[0], now)  # a new head may fit its limit
        else:
            for key in waiter.taken:
                self._free(waiter.session.exclusive[key], now)
        return blocked

    def blocked_keys(self, waiter: Waiter) -> Blocked:
        """The keys that keep ``waiter`` from its grant: held by other sessions (a
        shared waiter names its key: it waits for room under its limit)."""
        if waiter.shared:
            return list(waiter.keys)
        return [k for k in waiter.keys if self._held_by_other(waiter.session, k)]

    def _time_out(self, waiter: Waiter, now: float) -> None:
        """A wait reached its deadline: it gives up, and its client hears at once."""
        self.cancel(waiter, now, timed_out=True)
        if waiter.wake is not None:
            waiter.wake()

    # ------------------------------------------------------------------ leases

    def next_deadline(self) -> float | None:
        """When :meth:`advance` next has work (possibly a stale entry), or None;
        minus infinity while ending sessions wait to be freed."""
        if self._ending or self.index.sweeping:
            return -math.inf
        deadline = self._deadlines.next()
        lapse = self.throttles.next_lapse()
        if lapse is None:
            return deadline
        return lapse if deadline is None else min(deadline, lapse)

    def advance(self, now: float, budget: int | None = None) -> bool:
        """Run what is due: queued session frees, then lease, grace and wait ends.

        With a ``budget``, stop after that many deadlines (and one slice of frees),
        so the caller can let other work run between slices; True means more is due.
        """
        self._free_budget = self.free_slice
        self._free_ending(now)
        if self.index.sweeping:
            self.index.sweep(self.is_live, self.free_slice)
        if budget is None:
            budget = -1
        for deadline, target in self._deadlines.due(now):
            if isinstance(target, Hold):
                self.expired += 1
                self._free(target, now, EXPIRED)
                self._forget_if_done(target.session)
            elif isinstance(target, Waiter):
                self._time_out(target, now)
            elif isinstance(target, Session):
                self._end_grace(target, now, ENDED_GRACE_EXPIRED)
            else:
                assert isinstance(target, ThrottleWaiter)
                self.throttles.due(target, deadline, now)
            budget -= 1
            if budget == 0:
                break
        self.throttles.sweep(now)  # after the turns due: a line gone frees its key
        if budget < 0:  # no budget: finish every queued free as well
            while self._ending:
                self._free_budget = self.free_slice
                self._free_ending(now)
            while self.index.sweep(self.is_live, self.free_slice):
                pass
        self._free_budget = self.free_slice
        next_due = self.next_deadline()
        return next_due is not None and next_due <= now

    # ----------------------------------------------------------- introspection

    def exclusive_holds(self, key: bytes | None = None) -> Iterator[Hold]:
        if key is None:
            yield from self.exclusive.values()
        elif (hold := self.exclusive.get(key)) is not None:
            yield hold

    def shared_holds(self, key: bytes | None = None) -> Iterator[Hold]:
        entries = self.shared.values() if key is None else [self.shared.get(key)]
        for entry in entries:
            if isinstance(entry, Hold):
                yield entry
            elif entry is not None:
                yield from entry.values()

    def waiting_for(self, key: bytes) -> int:
        """Requests waiting for ``key``, in either table."""
        return len(self._xqueues.get(key, ())) + len(self._squeues.get(key, ()))


def _enqueue(queues: dict[bytes, Queue], key: bytes, waiter: Waiter) -> Queue:
    """Append ``waiter`` to the queue of ``key`` (made on first use); the queue."""
    queue = queues.get(key)
    if queue is None:
        queue = queues[key] = OrderedDict()
    queue[waiter] = None
    return queue
