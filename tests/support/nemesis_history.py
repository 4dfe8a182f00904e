"""What the nemesis's clients saw: every request and its reply, on one clock.

Every time here is ``time.monotonic()``, CLOCK_MONOTONIC, which is one clock for
every process of the machine (network namespaces do not change it), so the times
the clients of both nodes record can be compared with each other and with the
moments the faults were set and lifted. A wall-clock jump (libfaketime) moves a
node's ``time.time()`` only, never this clock.

A *session* is one client connection: it names itself with ``iam`` after
connecting, so that the OWNER that ``info``, ``d``, ``ls`` and ``watch`` report is
the session's name here. The checker (tests/support/nemesis_checker.py) reads a
:class:`History` and nothing else, so a synthetic one tests it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Exchange:
    """One request of one session and what came back.

    ``reply`` is the first line of the answer, ``more`` the lines that followed
    it up to ``END`` (``d``, ``ls``); both None/empty and ``received`` None when
    no answer came (the connection ended, the client crashed, the run ended)."""

    session: str
    node: str
    request: str
    sent: float
    reply: str | None = None
    received: float | None = None
    more: list[str] = field(default_factory=list)

    @property
    def verb(self) -> str:
        return self.request.split(" ", 1)[0]

    @property
    def words(self) -> list[str]:
        return self.request.split()


@dataclass
class WatchLine:
    """One line of a ``watch`` stream, as the watching session received it."""

    session: str
    node: str
    line: str
    received: float


@dataclass
class Fault:
    """One fault of a schedule as it really happened: set at ``start``, lifted at
    ``end`` (None: lasted to the end of the run)."""

    kind: str
    target: str
    start: float
    end: float | None = None
    detail: str = ""

    def __str__(self) -> str:
        end = "-" if self.end is None else f"{self.end:.3f}"
        extra = f" {self.detail}" if self.detail else ""
        return f"{self.kind} {self.target}{extra} [{self.start:.3f}, {end}]"


@dataclass
class Throttle:
    """The one rate every ``throttle`` request of a key asks (the checker's bound
    assumes one rate per key)."""

    count: int
    period: float
    burst: int


@dataclass
class History:
    """One schedule's run: the seed it came from, its settings, and what was seen."""

    seed: int
    ttl: int
    exchanges: list[Exchange] = field(default_factory=list)
    watch_lines: list[WatchLine] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: Sessions that crashed (closed without a word), and when.
    crashes: dict[str, float] = field(default_factory=dict)
    #: Throttle keys and their one rate.
    throttles: dict[str, Throttle] = field(default_factory=dict)
    #: The longest ``ttl=`` any hold was given (``renew K ttl=S``): a crashed
    #: holder's key may stay taken that long.
    lease_ttl: float = 0.0
    #: What went wrong outside the clients' view (a hand-over that failed).
    problems: list[str] = field(default_factory=list)

    def record(self, session: str, node: str, request: str, sent: float) -> Exchange:
        exchange = Exchange(session, node, request, sent)
        self.exchanges.append(exchange)
        return exchange

    def clock_jumps(self) -> float:
        """The sum of every wall-clock jump's size, seconds (the throttle's skew)."""
        total = 0.0
        for fault in self.faults:
            if fault.kind == "clock":
                total += abs(float(fault.detail))
        return total
