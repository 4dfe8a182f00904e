"""The in-memory backend: the pure :class:`~elockd.engine.locks.LockEngine` behind the
:class:`~elockd.backend.interface.Backend` interface.

The engine decides everything and answers at once; the only thing it cannot do
without trio is wait. So this subclass adds what the interface needs on top of the
engine's own operations (which it inherits as they are, so ``g`` and ``r`` cost no
extra call): a request that queues comes back as a :class:`~elockd.backend.interface.Later`
whose coroutine waits for the engine to wake its :class:`~elockd.engine.sessions.Waiter`,
on the grant or on the timeout (the engine keeps every deadline).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from elockd.backend.interface import (
    GRANTED,
    REFUSED,
    Backend,
    Evicted,
    Grant,
    Holders,
    KeyInfo,
    KeyRow,
    KeyRows,
    Later,
    Result,
)
from elockd.backend.memory_state import MemoryDump, MemoryRestore
from elockd.backend.rows import rows_in_batches
from elockd.engine.bookkeeping import Sizes
from elockd.engine.gcra import Rate, Verdict
from elockd.engine.locks import LockEngine
from elockd.engine.sessions import Hold, Session, Waiter
from elockd.engine.throttles import ThrottleWaiter
from elockd.engine.watchers import grant_line


class Wait(Later[Grant]):
    """A request waiting in the engine: its :class:`~elockd.engine.sessions.Waiter` is
    there to look at (tests, and anyone tracing waits)."""

    __slots__ = ("waiter",)

    def __init__(self, run: Callable[[], Awaitable[Grant]], waiter: Waiter) -> None:
        super().__init__(run, waits=True)
        self.waiter = waiter


class ThrottleWait(Later[Verdict]):
    """A throttle request waiting in its key's line: its
    :class:`~elockd.engine.throttles.ThrottleWaiter` is there to look at (a hand-over
    names a parked connection's waiting request by it)."""

    __slots__ = ("waiter",)

    def __init__(self, run: Callable[[], Awaitable[Verdict]], waiter: ThrottleWaiter) -> None:
        super().__init__(run, waits=True)
        self.waiter = waiter


async def until_woken(waiter: Waiter | ThrottleWaiter) -> None:
    """Sleep until the engine wakes ``waiter`` (its wait ended, either way); at once
    when it has already ended."""
    if waiter.waiting:
        woken = trio.Event()
        waiter.wake = woken.set
        try:
            await woken.wait()
        finally:
            waiter.wake = None


class MemoryBackend(LockEngine, Backend):
    """Every lock in this process's memory; see :class:`~elockd.engine.locks.LockEngine`.
    The engine keeps its own books: it is its :class:`~elockd.engine.bookkeeping.Bookkeeping`."""

    kind = "memory"

    @property
    def books(self) -> MemoryBackend:
        return self

    def sizes(self) -> Sizes:
        return Sizes(
            len(self.sessions),
            len(self.exclusive),
            len(self.shared),
            self.shared_holders,
            self.waiting + self.throttles.waiting,
            len(self.throttles),
        )

    # ------------------------------------------------------------- sessions

    def rename(self, session: Session, name: bytes | None) -> None:
        session.name = name  # holds show session.owner, read when they are shown

    # ------------------------------------------------------------ the terse family

    def holders(self, shared: bool, key: bytes | None, *, ordered: bool = False) -> Holders:
        """Weakly consistent, as Redis's SCAN: the keys are a snapshot of the table
        (8 bytes each, not the reply), and each key's holders are read when its turn
        comes. A hold present for the whole dump is listed exactly once (its key is
        in the snapshot once); one taken or freed meanwhile may or may not be."""
        table = self.shared if shared else self.exclusive
        keys = (sorted(table) if ordered else list(table)) if key is None else [key]
        holds_of = self.shared_holds if shared else self.exclusive_holds
        return (
            (hold.key, hold.session.owner, hold.session.peer) for k in keys for hold in holds_of(k)
        )

    # ------------------------------------------------------------- the word family

    def lock(
        self, session: Session, keys: list[bytes], now: float, *, wait: float, ttl: float | None
    ) -> Result[Grant]:
        if len(keys) == 1:
            if not wait:
                return GRANTED if self.acquire(session, keys[0], now, ttl) else REFUSED
            waiter = self.wait_for(session, keys[0], now, ttl, timeout=wait)
            return GRANTED if waiter is None else self.later_for(waiter)
        result = self.request_many(session, keys, now, ttl=ttl, wait=wait > 0, timeout=wait)
        if result is None:
            return GRANTED
        if isinstance(result, list):
            return Grant(False, blocked=result)
        return GRANTED if result.granted else self.later_for(result)

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
        if not wait or limit is None:
            granted, count = self.acquire_shared(session, key, now, limit=limit, ttl=ttl)
            return Grant(granted, count)
        result = self.wait_shared(session, key, now, limit=limit, ttl=ttl, timeout=wait)
        if isinstance(result, int):
            return Grant(True, result)
        return self.later_for(result)

    def throttle(
        self, session: Session, key: bytes, now: float, rate: Rate, *, wait: float
    ) -> Result[Verdict]:
        got = self.throttles.request(session, key, now, rate, wait)
        return got if isinstance(got, Verdict) else self.throttle_later(got)

    def info(self, key: bytes, now: float) -> KeyInfo:
        hold: Hold | None = self.exclusive.get(key)
        found = KeyInfo(shared=self.shared_count(key), waiting=self.waiting_for(key))
        if hold is not None:
            found.owner = hold.session.owner
            found.token = hold.token
            if hold.lease_deadline is not None:
                found.ttl = max(0.0, hold.lease_deadline - now)
        return found

    def watch_keys(self, prefix: bytes, after: bytes | None, count: int) -> list[bytes]:
        """From the ordered key index, as ``ls`` reads it: O(keys under ``prefix``)."""
        self.index.ensure(lambda: itertools.chain(self.exclusive, self.shared))
        return self.index.keys_after(prefix, after, count)

    def watch_lines(self, key: bytes) -> list[bytes]:
        lines = [
            grant_line(key, h.session.owner, False, h.token) for h in self.exclusive_holds(key)
        ]
        lines.extend(
            grant_line(key, h.session.owner, True, count)
            for count, h in enumerate(self.shared_holds(key), 1)
        )
        return lines

    # ------------------------------------------------------------- operators

    def listing(
        self, prefix: bytes, now: float, *, older: float | None, limit: int | None
    ) -> KeyRows:
        """Read from the ordered key index (:mod:`elockd.engine.keyindex`) a batch at
        a time, each key's row when its batch comes (ages as of ``now``, the
        request's time); keys of the index that are no longer live are skipped. A
        batch that yields no row yields None, so that the reply lets other
        connections run."""
        self.index.ensure(lambda: itertools.chain(self.exclusive, self.shared))
        batches = self.index.starting_with(prefix)
        return rows_in_batches(batches, lambda key: self._row_for(key, now), older, limit)

    def _row_for(self, key: bytes, now: float) -> KeyRow | None:
        """The ``ls`` row of ``key`` as the tables have it now (None: not live)."""
        hold = self.exclusive.get(key)
        entry = self.shared.get(key)
        if hold is None and entry is None:
            return None
        row = KeyRow(key, None, 0, self.waiting_for(key), None, None, None)
        oldest = None
        if hold is not None:
            row.owner = hold.session.owner
            row.token = hold.token
            oldest = hold.granted_at
            if hold.lease_deadline is not None:
                row.ttl = max(0.0, hold.lease_deadline - now)
        if entry is not None:
            holds = [entry] if isinstance(entry, Hold) else list(entry.values())
            row.shared = len(holds)
            first = min(h.granted_at for h in holds)
            oldest = first if oldest is None else min(oldest, first)
        if oldest is not None:
            row.age = max(0.0, now - oldest)
        return row

    def kill(self, key: bytes, now: float) -> list[Evicted]:
        return [
            Evicted(hold.session.owner, hold.session.peer, hold.shared, hold.token)
            for hold in self.evict(key, now)
        ]

    # -------------------------------------------- hand-over (docs/upgrade.md)
    # Once the connections are parked and the timer stopped, nothing else changes
    # these tables, and nothing of them lives outside this process: freeze, settle,
    # thaw and hand_off have nothing to do.

    def dump(self, now: float, pending: Sequence[tuple[Session, Any]]) -> MemoryDump:
        return MemoryDump(self, now, pending)

    def restore(self, now: float) -> MemoryRestore:
        return MemoryRestore(self, now, self.later_for, self.throttle_later)

    # ---------------------------------------------------------------- waiting

    def later_for(self, waiter: Waiter) -> Wait:
        """The reply-later of a request waiting as ``waiter`` (also for a waiter
        taken over from a predecessor, docs/upgrade.md)."""

        async def granted_or_not() -> Grant:
            await until_woken(waiter)  # the engine wakes it: granted, or timed out
            return self._outcome(waiter)

        return Wait(granted_or_not, waiter)

    def throttle_later(self, waiter: ThrottleWaiter) -> ThrottleWait:
        """The reply-later of a throttle request waiting in its key's line (also for
        one taken over from a predecessor)."""

        async def admitted_or_not() -> Verdict:
            await until_woken(waiter)  # the table wakes it: admitted, or timed out
            assert waiter.verdict is not None
            return waiter.verdict

        return ThrottleWait(admitted_or_not, waiter)

    def _outcome(self, waiter: Waiter) -> Grant:
        if waiter.shared:
            count = waiter.count if waiter.granted else self.shared_count(waiter.keys[0])
            return Grant(waiter.granted, count)
        if waiter.granted:
            return GRANTED
        return Grant(False, blocked=self.blocked_keys(waiter))
