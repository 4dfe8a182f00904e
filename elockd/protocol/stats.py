"""Counters and their renderings for ``q`` and ``stats``.

The server keeps only what the engine cannot tell: per-verb request counts,
invalid commands and live connections, as plain ints on the hot path. Everything
else (keys, holders, orphans, leases, waiters) is read from the backend's books
(:class:`~elockd.engine.bookkeeping.Bookkeeping`) when asked,
so no number is kept twice and a snapshot is always consistent.

The wait-time and hold-time histograms (:class:`Timings`) are plain ints too, fed
by the engine's ``on_wait_end`` / ``on_hold_end`` hooks; :mod:`elockd.net.metrics`
exposes them to Prometheus.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elockd.engine.bookkeeping import Bookkeeping


#: Verbs whose ``command_<verb>`` line `q` always prints, even at 0.
ALWAYS_SHOWN_VERBS = (b"d", b"dump", b"g", b"i", b"q", b"r", b"sd", b"sg", b"si", b"sr")


class Counters:
    """What the connection layer counts."""

    __slots__ = ("commands", "connections", "handovers", "invalid_commands")

    def __init__(self, verbs: list[bytes]) -> None:
        self.commands: dict[bytes, int] = dict.fromkeys(verbs, 0)
        self.invalid_commands = 0
        self.connections = 0
        # Hand-overs to a successor this server's state went through (docs/upgrade.md).
        self.handovers = 0


def snapshot(books: Bookkeeping, counters: Counters) -> dict[str, int]:
    """Every `q` counter, sorted by name: the backend's from its books."""
    sizes = books.sizes()
    values = {
        "admitted": books.admitted,
        "connections": counters.connections,
        "expired": books.expired,
        "handovers": counters.handovers,
        "invalid_commands": counters.invalid_commands,
        "killed": books.killed,
        "leases": books.leases,
        "locks": sizes.locks,
        "orphans": books.orphans,
        "sessions": sizes.sessions,
        "shared_holders": sizes.shared_holders,
        "shared_locks": sizes.shared_locks,
        "shared_orphans": books.shared_orphans,
        "throttled": books.throttled,
        "throttles": sizes.throttles,
        "timeouts": books.timeouts,
        "waiting": sizes.waiting,
        **books.extra_counters(),
    }
    for verb, count in counters.commands.items():
        if count or verb in ALWAYS_SHOWN_VERBS:
            values["command_" + verb.decode("ascii")] = count
    return dict(sorted(values.items()))


def render_stats(values: dict[str, int], clients: int) -> bytes:
    """elock's `stats`: its own three first, then every other counter once, sorted."""
    first = {"clients": clients, "locks": values["locks"], "monitoring": values["sessions"]}
    lines = ["200 STATS\r\n"]
    lines += [f"STAT {name} {value}\r\n" for name, value in first.items()]
    lines += [f"STAT {name} {value}\r\n" for name, value in values.items() if name not in first]
    lines.append("END\r\n")
    return "".join(lines).encode("ascii")


#: Bucket upper bounds (seconds) of the wait-time histograms: waits are mostly
#: short, and a request rarely waits more than a few minutes.
WAIT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
#: Bucket upper bounds (seconds) of the hold-time histograms: from a quick critical
#: section to a job that runs all night.
HOLD_BUCKETS = (
    0.001,
    0.01,
    0.1,
    1.0,
    10.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    4 * 3600.0,
    12 * 3600.0,
    86400.0,
)


class Buckets:
    """A histogram as plain ints: what :meth:`observe` costs is one bisect and two
    additions, cheap enough for every release on the hot path.

    prometheus_client's ``Histogram.observe`` takes a lock and walks its buckets on
    every call; this does neither, and the collector turns it into a
    ``HistogramMetricFamily`` only when scraped. ``counts[i]`` counts observations in
    bucket ``i`` alone (not cumulative); the last slot is the +Inf bucket.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le).
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def observe_many(self, seconds: list[float]) -> None:
        """Observe a batch: sort once, then one bisect per bucket bound (all in C)
        instead of a Python step per value."""
        seconds.sort()
        below = 0
        for index, bound in enumerate(self.bounds):
            upto = bisect_right(seconds, bound, below)
            self.counts[index] += upto - below
            below = upto
        self.counts[-1] += len(seconds) - below
        self.sum += sum(seconds)

    @property
    def count(self) -> int:
        """Observations so far: summed at scrape time, one addition less per observe."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of observations <= le)`` pairs, ``+Inf`` last."""
        result = []
        running = 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            result.append((bound, running))
        return result


class Timings:
    """Wait-time and hold-time histograms per kind, fed by the engine's hooks.

    Indexed by the engine's ``shared`` flag: ``[False]`` is exclusive, ``[True]``
    shared, so a hook call is one list index and one observe. Waits have a third
    kind, ``[2]`` (:data:`~elockd.engine.throttles.THROTTLE_KIND`): throttle waits.
    """

    __slots__ = ("hold", "wait")

    def __init__(self) -> None:
        self.wait = [Buckets(WAIT_BUCKETS), Buckets(WAIT_BUCKETS), Buckets(WAIT_BUCKETS)]
        self.hold = [Buckets(HOLD_BUCKETS), Buckets(HOLD_BUCKETS)]

    def wait_ended(self, kind: int, seconds: float) -> None:
        self.wait[kind].observe(seconds)

    def holds_ended(self, shared: bool, seconds: list[float]) -> None:
        self.hold[shared].observe_many(seconds)

    def hold_ended(self, shared: bool, seconds: float) -> None:
        # Buckets.observe inlined: this runs on every release, the hottest path
        # after acquire, and a second Python call costs as much as the work.
        buckets = self.hold[shared]
        buckets.counts[bisect_left(buckets.bounds, seconds)] += 1
        buckets.sum += seconds
