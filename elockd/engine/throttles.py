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
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator

from elockd.engine.bookkeeping import Bookkeeping, QueueFull
from elockd.engine.gcra import EPSILON, Rate, Verdict, admit_at, judge
from elockd.engine.sessions import CANCELLED, GRANTED, WAITING, Session

#: The key kind a throttle wait reports to the wait-time histograms (0 and 1 are
#: the lock kinds, exclusive and shared).
THROTTLE_KIND = 2


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


class Throttles:
    """Every throttle key's TAT and line. ``books`` is the engine's bookkeeping: the
    counters (``admitted``, ``throttled``, ``timeouts``), the deadline heap and the
    wait-time hook."""

    def __init__(self, books: Bookkeeping, *, max_throttles: int = 1_000_000) -> None:
        self.books = books
        self.max_throttles = max_throttles
        self.tats: dict[bytes, float] = {}
        self.lines: dict[bytes, Line] = {}
        # Waits by session, so that a disconnect finds its waits without a scan (in
        # the order they came: a dict, not a set, so cancelling is deterministic).
        self.by_session: dict[Session, dict[ThrottleWaiter, None]] = {}
        self.waiting = 0
        # (TAT when scheduled, key): when a key may lapse. One entry per key with
        # state; a key whose TAT moved on is put back at its new TAT when it comes up.
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
                self._set(key, new)
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
        when = now
        for waiter in line:
            when = max(when, admit_at(tat, waiter.rate))
            tat = max(tat, when) + waiter.rate.cost * waiter.rate.interval
        mine = max(when, admit_at(tat, rate))
        return Verdict(False, rate.burst, 0, reset, mine - now)

    def _enqueue(
        self, session: Session, key: bytes, now: float, rate: Rate, wait: float, line: Line | None
    ) -> ThrottleWaiter:
        waiter = ThrottleWaiter(session, key, rate, now)
        if line is None:
            line = self.lines[key] = OrderedDict()
        line[waiter] = None
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

    def _set(self, key: bytes, new: float) -> None:
        if key not in self.tats:
            if len(self.tats) >= self.max_throttles:
                raise TooManyThrottles(key)
            lapses = self._lapses
            heapq.heappush(lapses, (new, key))
            if lapses[0][1] is key and self.books.on_new_deadline is not None:
                self.books.on_new_deadline()  # the timer sleeps until the earliest
        self.tats[key] = new

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
            self._set(key, new)
            self.books.admitted += 1
            self._finish(head, verdict, now)
        self.lines.pop(key, None)

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
        elif was_head:
            self._serve(waiter.key, now)  # the next may fit at once (a cheaper one)

    def _drop(self, waiter: ThrottleWaiter, line: Line, now: float, *, timed_out: bool) -> None:
        del line[waiter]
        tat = self.tats.get(waiter.key, -math.inf)
        verdict = self._behind(line, tat, now, waiter.rate)  # its 409, were it asked again
        if timed_out:
            self.books.timeouts += 1
            self.books.throttled += 1
        self._finish(waiter, verdict, now, state=CANCELLED)

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
                heapq.heappush(lapses, (tat, key))
            elif key in self.lines:
                again.append((now, key))
            else:
                del tats[key]
        for entry in again:
            heapq.heappush(lapses, entry)

    # ------------------------------------------------------------- reading

    def waiters(self) -> Iterator[ThrottleWaiter]:
        """Every waiter, line by line, each line in arrival order."""
        for line in self.lines.values():
            yield from line
