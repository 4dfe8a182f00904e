"""The throttle table: one TAT per key and, per key, a line of waiting requests.

``throttle K COUNT PERIOD`` is judged by :func:`elockd.engine.gcra.judge`; this
module keeps what the rule needs between requests, and the waits. Pure, like the
lock engine beside it: no trio, no I/O, time passed in.

* A key has state only while its TAT is in the future: a lapsed key is the same
  as an absent one, so it is dropped (:meth:`Throttles.sweep`, run by the engine's
  ``advance``), and ``--max-throttles`` bounds the keys with state.
* A request that may wait and is not admitted at once joins its key's line. Only
  the head of a line is ever admitted, each as soon as the rate allows it, so a
  later, cheaper request never overtakes an earlier one; a request that does not
  wait is refused while a line exists (it would overtake it). The head's admission
  time and every waiter's timeout go on the engine's one deadline heap.
* A request that could not be admitted within its wait even if the line ahead of
  it is admitted at the earliest is refused at once (as Guava's
  ``tryAcquire(timeout)`` does) instead of holding a place it cannot use.
* A throttle belongs to no session, but a wait does: a waiter's disconnect cancels
  its wait and changes nothing else.
* A line may be ``--max-waiters`` long, so no request walks it: the end of each
  line's fold (every waiter admitted at its earliest) is kept and extended as
  waiters join (:class:`Tail`). A removal or an admission sets it aside; the next
  request that needs it walks the line once. A disconnect walks nothing.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

from elockd.engine.bookkeeping import Bookkeeping, QueueFull
from elockd.engine.gcra import EPSILON, Rate, Verdict, admit_at, judge
from elockd.engine.sessions import CANCELLED, GRANTED, WAITING, Session

#: The key kind a throttle wait reports to the wait-time histograms (0 and 1 are
#: the lock kinds, exclusive and shared).
THROTTLE_KIND = 2


#: Lapsed keys are dropped on boundaries of this many seconds, so that a key asked
#: over and over at a high rate (its TAT always just passed) costs no timer wake-up
#: per request, only one sweep per grain for all of them.
LAPSE_GRAIN = 1.0


def lapse_time(tat: float) -> float:
    """When to look at a key whose TAT is ``tat``: the next grain boundary after it."""
    return (math.floor(tat / LAPSE_GRAIN) + 1.0) * LAPSE_GRAIN


class TooManyThrottles(Exception):
    """``--max-throttles`` keys already have state; this request would add one."""


class ThrottleWaiter:
    """One ``throttle … wait=S`` request in its key's line.

    ``deadline`` is when it gives up; ``admit`` when it is admitted if it is the
    head of its line then (``inf`` while it is not the head). ``verdict`` is its
    answer once it has one."""

    __slots__ = (
        "admit",
        "deadline",
        "key",
        "rate",
        "session",
        "since",
        "state",
        "verdict",
        "wake",
    )

    def __init__(self, session: Session, key: bytes, rate: Rate, since: float) -> None:
        self.session = session
        self.key = key
        self.rate = rate
        self.since = since
        self.deadline = math.inf
        self.admit = math.inf
        self.state = WAITING
        self.verdict: Verdict | None = None
        self.wake: Callable[[], None] | None = None

    @property
    def waiting(self) -> bool:
        return self.state == WAITING

    def is_due(self, deadline: float) -> bool:
        """Whether a deadline-heap entry at ``deadline`` is still this waiter's."""
        return self.state == WAITING and (deadline == self.admit or deadline == self.deadline)


#: A key's line: waiters in arrival order (an ordered dict: a waiter that leaves
#: from the middle goes in O(1)).
Line = OrderedDict[ThrottleWaiter, None]


class Tail(NamedTuple):
    """Where a line ends if every waiter is admitted at its earliest: the fold of
    :meth:`Throttles._behind`, kept so that a request behind a long line costs O(1).
    Valid while the key's TAT is ``tat`` and the line has ``length`` waiters, none
    gone since (a removal drops it), and for any ``now`` up to ``first``, the head's
    turn: the fold starts at ``max(now, first)``, which is ``first`` then."""

    tat: float
    length: int
    first: float
    when: float
    end: float


class Throttles:
    """Every throttle key's TAT and line. ``books`` is the engine's bookkeeping: the
    counters (``admitted``, ``throttled``, ``timeouts``), the deadline heap and the
    wait-time hook."""

    def __init__(self, books: Bookkeeping, *, max_throttles: int = 1_000_000) -> None:
        self.books = books
        self.max_throttles = max_throttles
        self.tats: dict[bytes, float] = {}
        self.lines: dict[bytes, Line] = {}
        # Each line's Tail, while it holds (absent: walk the line when needed).
        self._tails: dict[bytes, Tail] = {}
        # The ends of lines that timeouts at ``_bounds_now`` walked: (TAT, when, end).
        self._bounds: dict[bytes, tuple[float, float, float]] = {}
        self._bounds_now = -math.inf
        # Waits by session, so that a disconnect finds its waits without a scan (in
        # the order they came: a dict, not a set, so cancelling is deterministic).
        self.by_session: dict[Session, dict[ThrottleWaiter, None]] = {}
        self.waiting = 0
        # (when to look, key): when a key may have lapsed, on LAPSE_GRAIN boundaries.
        # One entry per key with state; a key whose TAT moved on is put back when
        # it comes up.
        self._lapses: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        """Keys with state (their TAT is not known to have lapsed yet)."""
        return len(self.tats)

    # ------------------------------------------------------------- requests

    def request(
        self, session: Session, key: bytes, now: float, rate: Rate, wait: float
    ) -> Verdict | ThrottleWaiter:
        """Judge one request: its verdict now, or the waiter it became (``wait`` 0:
        never waits)."""
        tat = self.tats.get(key, -math.inf)
        line = self.lines.get(key)
        if rate.cost == 0:  # a peek: answered as if admitted, nothing changes
            return judge(tat, now, rate)[0]
        if line is None:
            verdict, new = judge(tat, now, rate)
            if verdict.admitted:
                self._set(key, new, now)
                self.books.admitted += 1
                return verdict
        else:
            verdict = self._behind(line, tat, now, rate)
        if wait <= 0 or verdict.retry > wait:
            self.books.throttled += 1
            return verdict
        if line is not None and len(line) >= self.books.max_waiters:
            raise QueueFull(key)
        return self._enqueue(session, key, now, rate, wait, line)

    def _behind(self, line: Line, tat: float, now: float, rate: Rate) -> Verdict:
        """The verdict of a request that comes after every waiter of ``line``, each
        admitted at its earliest: refused, ``retry`` until its own turn, ``reset``
        as the key is now."""
        reset = max(tat - now, 0.0)
        tail = self._tail(line, tat) if line else None
        if tail is not None and now <= tail.first:  # the kept fold, float for float
            when, tat = tail.when, tail.end
        else:  # no line, or its head's turn is past and not served yet: fold from now
            when = now
            for waiter in line:
                when = max(when, admit_at(tat, waiter.rate))
                tat = max(tat, when) + waiter.rate.cost * waiter.rate.interval
        mine = max(when, admit_at(tat, rate))
        return Verdict(False, rate.burst, 0, reset, mine - now)

    def _tail(self, line: Line, tat: float) -> Tail:
        """``line``'s :class:`Tail` from a key at ``tat``: the kept one, or walked."""
        key = next(iter(line)).key
        tail = self._tails.get(key)
        if tail is not None and tail.tat == tat and tail.length == len(line):
            return tail
        when, end, first = -math.inf, tat, math.inf
        for waiter in line:
            when = max(when, admit_at(end, waiter.rate))
            if first == math.inf:
                first = when
            end = max(end, when) + waiter.rate.cost * waiter.rate.interval
        tail = self._tails[key] = Tail(tat, len(line), first, when, end)
        return tail

    def _extend(self, key: bytes, line: Line, waiter: ThrottleWaiter) -> None:
        """``waiter`` joined the end of ``line``: its step goes on the kept Tail."""
        tail = self._tails.get(key)
        tat = self.tats.get(key, -math.inf)
        if tail is None or tail.tat != tat or tail.length != len(line) - 1:
            return  # set aside already: the next request walks the line
        when = max(tail.when, admit_at(tail.end, waiter.rate))
        end = max(tail.end, when) + waiter.rate.cost * waiter.rate.interval
        first = when if tail.length == 0 else tail.first
        self._tails[key] = Tail(tat, len(line), first, when, end)

    def _enqueue(
        self, session: Session, key: bytes, now: float, rate: Rate, wait: float, line: Line | None
    ) -> ThrottleWaiter:
        waiter = ThrottleWaiter(session, key, rate, now)
        if line is None:
            line = self.lines[key] = OrderedDict()
            tat = self.tats.get(key, -math.inf)
            self._tails[key] = Tail(tat, 0, math.inf, -math.inf, tat)
        line[waiter] = None
        self._extend(key, line, waiter)
        self.by_session.setdefault(session, {})[waiter] = None
        self.waiting += 1
        waiter.deadline = now + wait
        self.books.schedule(waiter.deadline, waiter)
        if len(line) == 1:
            self._arm(waiter, now)
        return waiter

    def _arm(self, head: ThrottleWaiter, now: float) -> None:
        """``head`` leads its line now: admit it when its rate allows. The turn is
        set half the rule's tolerance early, so that the rule agrees when it comes
        whatever the float rounding of either; and never at a time already past
        (the rule said no at ``now``)."""
        turn = admit_at(self.tats.get(head.key, -math.inf), head.rate) - EPSILON / 2
        head.admit = max(turn, now + EPSILON)
        self.books.schedule(head.admit, head)

    def _set(self, key: bytes, new: float, now: float) -> None:
        if key not in self.tats:
            if len(self.tats) >= self.max_throttles and not self._reclaim(now):
                raise TooManyThrottles(key)
            lapses = self._lapses
            earliest = lapses[0][0] if lapses else math.inf
            when = lapse_time(new)
            heapq.heappush(lapses, (when, key))
            if when < earliest and self.books.on_new_deadline is not None:
                self.books.on_new_deadline()  # the timer sleeps until the earliest
        self.tats[key] = new

    def _reclaim(self, now: float, budget: int = 64) -> bool:
        """At ``--max-throttles``: drop keys that have lapsed but wait for their
        sweep (at most ``budget`` looked at); True when room was made. A lapsed key
        has no state, so it must not keep a new one out."""
        lapses, tats = self._lapses, self.tats
        looked: list[tuple[float, bytes]] = []
        room = False
        while lapses and lapses[0][0] <= now + LAPSE_GRAIN and budget:
            budget -= 1
            entry = heapq.heappop(lapses)
            tat = tats.get(entry[1])
            if tat is None:
                continue
            if tat <= now and entry[1] not in self.lines:
                del tats[entry[1]]
                room = True
            else:
                looked.append(entry)
        for entry in looked:
            heapq.heappush(lapses, entry)
        return room

    # ------------------------------------------------------------- the line

    def due(self, waiter: ThrottleWaiter, deadline: float, now: float) -> None:
        """A heap entry of ``waiter`` came up: its turn (it is the head) or its
        timeout."""
        if deadline == waiter.admit or now >= waiter.deadline:
            # At a timeout too: a turn due at the same instant may admit it first.
            self._serve(waiter.key, now)
        if waiter.state == WAITING and now >= waiter.deadline:
            self._leave(waiter, now, timed_out=True)

    def _serve(self, key: bytes, now: float) -> None:
        """Admit the line's head while the rate allows it, in order; arm the next.

        The rule is applied at ``now``, also when the timer comes round late (a
        busy loop, a hand-over's pause): admitting as of an earlier instant would
        let a late batch pass the window bound. A head whose turn came within its
        wait is admitted, late or not; one whose turn comes after it times out."""
        line = self.lines.get(key)
        while line:
            head = next(iter(line))
            tat = self.tats.get(key, -math.inf)
            turn = max(admit_at(tat, head.rate), head.since)
            if turn > head.deadline + EPSILON and head.deadline < now:
                self._drop(head, line, now, timed_out=True)
                continue
            verdict, new = judge(tat, now, head.rate)
            if not verdict.admitted:
                self._arm(head, now)
                return
            head.admit = turn  # when its turn came: within its wait
            del line[head]
            self._tails.pop(key, None)
            self._set(key, new, now)
            self.books.admitted += 1
            self._finish(head, verdict, now)
        self.lines.pop(key, None)
        self._tails.pop(key, None)

    def cancel(self, waiter: ThrottleWaiter, now: float) -> None:
        """The waiter's client went away: it leaves its line, nothing else changes."""
        if waiter.state == WAITING:
            self._leave(waiter, now, timed_out=False)

    def cancel_session(self, session: Session, now: float) -> None:
        """Cancel every wait of a session whose connection is gone."""
        for waiter in list(self.by_session.get(session, ())):
            if waiter.state == WAITING:  # a line's turn may have ended it meanwhile
                self._leave(waiter, now, timed_out=False)

    def _leave(self, waiter: ThrottleWaiter, now: float, *, timed_out: bool) -> None:
        """A waiter leaves its line (timeout or disconnect); a new head may fit."""
        line = self.lines[waiter.key]
        was_head = next(iter(line)) is waiter
        self._drop(waiter, line, now, timed_out=timed_out)
        if not line:
            del self.lines[waiter.key]
            self._tails.pop(waiter.key, None)
        elif was_head:
            self._serve(waiter.key, now)  # the next may fit at once (a cheaper one)

    def _drop(self, waiter: ThrottleWaiter, line: Line, now: float, *, timed_out: bool) -> None:
        del line[waiter]
        self._tails.pop(waiter.key, None)
        tat = self.tats.get(waiter.key, -math.inf)
        if timed_out:  # its 409, were it asked again
            verdict = self._after_timeout(waiter, line, tat, now)
            self.books.timeouts += 1
            self.books.throttled += 1
        else:  # its client is gone, its answer unsent (one client may drop a whole
            # line at once): its own turn, without walking the line behind it
            turn = max(admit_at(tat, waiter.rate), now)
            verdict = Verdict(False, waiter.rate.burst, 0, max(tat - now, 0.0), turn - now)
        self._finish(waiter, verdict, now, state=CANCELLED)

    def _after_timeout(self, waiter: ThrottleWaiter, line: Line, tat: float, now: float) -> Verdict:
        """A timed-out waiter's 409: as :meth:`_behind` words it, but a late timer
        (a busy loop, a hand-over's pause) can time out a whole line at one ``now``,
        and a walk of the line for each would be O(line²). So the first timeout of a
        key at a given ``now`` and TAT walks the line once, and the others of that
        batch reuse its end: the line has only lost waiters since, and a shorter line
        ends no later, so their ``retry`` may count a waiter that left with them,
        never too few."""
        if self._bounds_now != now:
            self._bounds_now = now
            self._bounds.clear()
        bound = self._bounds.get(waiter.key)
        if bound is None or bound[0] != tat:
            when, end = now, tat
            for ahead in line:
                when = max(when, admit_at(end, ahead.rate))
                end = max(end, when) + ahead.rate.cost * ahead.rate.interval
            bound = self._bounds[waiter.key] = (tat, when, end)
        _, when, end = bound
        mine = max(when, admit_at(end, waiter.rate))
        return Verdict(False, waiter.rate.burst, 0, max(tat - now, 0.0), mine - now)

    def _finish(
        self, waiter: ThrottleWaiter, verdict: Verdict, now: float, state: int = GRANTED
    ) -> None:
        waiter.state = state
        waiter.verdict = verdict
        self.waiting -= 1
        waits = self.by_session.get(waiter.session)
        if waits is not None:
            waits.pop(waiter, None)
            if not waits:
                del self.by_session[waiter.session]
        if self.books.on_wait_end is not None:
            self.books.on_wait_end(THROTTLE_KIND, now - waiter.since)
        if waiter.wake is not None:
            waiter.wake()

    # ------------------------------------------------------------- lapses

    def next_lapse(self) -> float | None:
        """When a key may next lapse (its state dropped), or None."""
        return self._lapses[0][0] if self._lapses else None

    def sweep(self, now: float, budget: int = 1024) -> None:
        """Drop keys whose TAT has passed and that nobody waits on (at most
        ``budget``). Run after the deadlines due by ``now``: a key still in line
        then is one whose due turns the caller has yet to run (its budget ran
        out), so it comes up again at ``now``."""
        lapses = self._lapses
        tats = self.tats
        again: list[tuple[float, bytes]] = []
        while lapses and lapses[0][0] <= now and budget:
            budget -= 1
            _, key = heapq.heappop(lapses)
            tat = tats.get(key)
            if tat is None:
                continue
            if tat > now:
                heapq.heappush(lapses, (lapse_time(tat), key))
            elif key in self.lines:
                again.append((lapse_time(now), key))
            else:
                del tats[key]
        for entry in again:
            heapq.heappush(lapses, entry)

    # ------------------------------------------------------------- reading

    def waiters(self) -> Iterator[ThrottleWaiter]:
        """Every waiter, line by line, each line in arrival order."""
        for line in self.lines.values():
            yield from line
