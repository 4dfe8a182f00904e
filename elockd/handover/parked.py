"""A connection's resting state, for a hand-over: what it was asked and has not
answered yet, and everything else needed to serve it on, here or in a successor.

The connection loop (:mod:`elockd.net.serving`) calls the steps here only when a
reply is not ready or a pause was requested: the fast path, a chunk of requests
answered at once, never touches them. :class:`~elockd.handover.pause.Pause` holds
these states by identity; the hand-over (:mod:`elockd.handover.exchange`) collects
and moves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elockd.handover.pause import Pause
from elockd.protocol.connection import Connection, Outcome, Reply
from elockd.protocol.framing import LineReader

if TYPE_CHECKING:
    from elockd.net.transport import Transport


@dataclass(slots=True)
class Backlog:
    """What a connection had been asked but not yet answered when it parked: a
    request still waiting for its grant, then the lines after it: ``lines`` from
    ``start`` on. The chunk's list is kept whole with an index, so that marking the
    place costs nothing per request (a slice per request would make a pipelined
    chunk of 30,000 dumps quadratic)."""

    pending: Outcome | None = None
    lines: list[bytes | None] = field(default_factory=list)
    start: int = 0

    def remaining(self) -> list[bytes | None]:
        """The lines not yet handled."""
        return self.lines[self.start :] if self.start else self.lines

    def keep(self, lines: list[bytes | None], start: int) -> None:
        """Remember ``lines[start:]`` as not yet handled (nothing, past the end)."""
        if start >= len(lines):
            lines, start = [], 0
        self.lines, self.start = lines, start

    def take(self) -> list[bytes | None]:
        """The lines not yet handled, which are now the caller's to handle."""
        lines = self.remaining()
        self.lines, self.start = [], 0
        return lines

    def awaiting(self, reply: Reply, lines: list[bytes | None], start: int) -> None:
        """A reply that is not ready is awaited: meanwhile the connection rests with
        ``lines[start:]`` unanswered, and with the request itself if it waits for
        a grant (the waiter moves with the state)."""
        self.keep(lines, start)
        if isinstance(reply, Outcome) and reply.waits:
            self.pending = reply

    def answered(self) -> None:
        """The awaited reply went out: nothing is owed but what the loop holds."""
        self.pending = None
        self.lines, self.start = [], 0


@dataclass(eq=False, slots=True)
class Parked:
    """One connection's resting state: everything needed to serve it on, here or
    elsewhere. Each connection has one, kept up to date whenever it rests (compared
    by identity). ``conn`` is None for a connection parked before it handled
    anything (it has no session yet)."""

    conn: Connection | None
    reader: LineReader
    transport: Transport
    peer: bytes
    backlog: Backlog

    async def park_between(
        self, pause: Pause[Parked], lines: list[bytes | None], start: int
    ) -> None:
        """Paused between two requests of a chunk: ``lines[start:]`` is the
        backlog; rest until the hand-over's decision (:meth:`Pause.park`)."""
        self.backlog.keep(lines, start)
        await pause.park(self)
