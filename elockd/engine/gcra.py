"""The generic cell rate algorithm: the rule of ``throttle`` (docs/rate-limits.md).

A throttle key's whole state is one number, its theoretical arrival time (TAT):
the time at which the key would be back to a full burst. With ``T = PERIOD / COUNT``
(the emission interval) a request of cost N at ``now`` is judged by::

    new = max(TAT, now) + N·T
    admitted  iff  new - now ≤ B·T      (then TAT := new)

This is the whole rule, kept pure (time is an argument) so that the in-memory
engine, the cluster's compare-and-swap in etcd and the Hypothesis model test judge
with the same function. Floats carry the times; a ``1e-9`` s tolerance keeps a
request that lands exactly on its turn (the eleventh of ``throttle api 10 60``
asked again after ``retry`` ms) from being refused by a rounding error.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: Times closer than this count as equal (float rounding, not policy).
EPSILON = 1e-9


class Rate(NamedTuple):
    """One request's rate: ``calls`` (the wire's COUNT) per ``period`` seconds,
    ``burst`` at once, and the request's own ``cost`` (0: a peek). Per request, as
    ``limit=`` is: one key may be asked at several rates, each judged by its own."""

    calls: int
    period: float
    burst: int
    cost: int = 1

    @property
    def interval(self) -> float:
        """T: the seconds one unit of cost takes to come back."""
        return self.period / self.calls

    @property
    def capacity(self) -> float:
        """B·T: how far ahead of now the TAT may run."""
        return self.burst * self.period / self.calls


class Verdict(NamedTuple):
    """A throttle's answer, in seconds (the wire rounds them up to milliseconds):
    ``remaining`` units of burst left after it, ``reset`` until the key is back to a
    full burst, ``retry`` (refused only) until this request would pass if nobody
    else came."""

    admitted: bool
    limit: int
    remaining: int
    reset: float
    retry: float = 0.0


def judge(tat: float, now: float, rate: Rate) -> tuple[Verdict, float]:
    """Judge one request against a key whose TAT is ``tat`` (``-inf`` or any past time:
    no state). Returns the verdict and the key's TAT after it: the new one when
    admitted (unchanged for a peek, ``cost`` 0), else ``tat`` as it was."""
    calls, period, burst, cost = rate  # unpacked once: this runs on every request
    interval = period / calls
    capacity = burst * interval
    base = tat if tat > now else now
    new = base + cost * interval
    ahead = new - now
    if ahead <= capacity + EPSILON:
        remaining = int((capacity - ahead) / interval + EPSILON)
        return Verdict(True, burst, max(0, remaining), max(0.0, ahead)), new if cost else tat
    return Verdict(False, burst, 0, base - now, ahead - capacity), tat


def admit_at(tat: float, rate: Rate) -> float:
    """The earliest time a request of ``rate`` is admitted on a key at ``tat`` (a
    waiter at the head of its key's line is admitted then, if it still waits)."""
    return tat + rate.cost * rate.interval - rate.capacity


def milliseconds(seconds: float) -> int:
    """Seconds as the wire's whole milliseconds, rounded up (a client that sleeps
    ``retry`` ms and asks again is admitted): ``6.0000000001`` s is 6000 ms, not 6001."""
    return max(0, math.ceil(seconds * 1000.0 - 1e-6))
