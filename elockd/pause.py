"""Stopping every connection at a request boundary, for a hand-over (docs/upgrade.md).

A hand-over needs the lock tables to stand still while they are copied to the
successor, and every connection to be between two requests: no reply half sent, no
line half handled. :class:`Pause` gets there without a lock on the hot path:

* a connection waiting for its next request is woken (its read is cancelled) and
  parks at once;
* a connection working through a chunk of pipelined requests checks
  :attr:`Pause.requested` after each one and parks with the rest of the chunk as its
  backlog, once the replies it owes are sent;
* a connection whose request waits for a grant parks with that request still
  waiting in the engine: the waiter moves with the state, and whoever serves the
  connection next sends its reply.

A parked connection then learns the decision: :meth:`Pause.resume` (the hand-over
failed; it goes on as if nothing had happened) or :meth:`Pause.hand_over` (the
successor serves it now; its task ends without closing anything).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from elockd.framing import LineReader
    from elockd.protocol import Connection, Outcome
    from elockd.transport import Transport


class Interrupted(Exception):
    """A connection's read was interrupted because a pause was requested."""


class HandedOver(Exception):
    """The connection is the successor's now: end its task, close nothing."""


@dataclass
class Backlog:
    """What a connection had been asked but not yet answered when it parked: a
    request still waiting for its grant, then the lines after it."""

    pending: Outcome | None = None
    lines: list[bytes | None] = field(default_factory=list)


@dataclass
class Parked:
    """One connection at rest: everything needed to serve it on, here or elsewhere.
    ``conn`` is None for a connection parked before it handled anything (it has no
    session yet)."""

    conn: Connection | None
    reader: LineReader
    transport: Transport
    peer: bytes
    backlog: Backlog


class Pause:
    """The switch every connection of a service looks at (see the module docstring)."""

    def __init__(self) -> None:
        self.requested = False
        self.parked: dict[int, Parked] = {}
        self._idle: set[trio.CancelScope] = set()
        self._decided = trio.Event()
        self._handed_over = False
        self._changed = trio.Event()

    @property
    def handed_over(self) -> bool:
        """Whether the successor has everything (this process only exits now)."""
        return self._handed_over

    # ----------------------------------------------------------------- the owner

    def request(self) -> None:
        """Ask every connection to stop at its next request boundary."""
        self.requested = True
        self._handed_over = False
        self._decided = trio.Event()
        for scope in list(self._idle):
            scope.cancel()

    async def wait_for_change(self, timeout: float) -> None:
        """Return when a connection parks, or after ``timeout`` (connections that end
        instead of parking say nothing)."""
        self._changed = trio.Event()
        with trio.move_on_after(timeout):
            await self._changed.wait()

    def resume(self) -> None:
        """The hand-over failed: every parked connection goes on."""
        self.requested = False
        self.parked = {}
        self._decided.set()

    def hand_over(self) -> None:
        """The successor took everything: parked connections end, closing nothing."""
        self._handed_over = True
        self._decided.set()

    # ------------------------------------------------------------ the connections

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Around a read that may wait for long: a pause cancels it, and the caller
        sees :class:`Interrupted` (and parks)."""
        if self.requested:
            raise Interrupted
        scope = trio.CancelScope()
        self._idle.add(scope)
        try:
            with scope:
                yield
        finally:
            self._idle.discard(scope)
        if scope.cancelled_caught:
            raise Interrupted

    async def park(self, parked: Parked) -> None:
        """Rest until the decision: return to go on, or raise :class:`HandedOver`."""
        decided = self._decided
        self.parked[id(parked.transport)] = parked
        self._changed.set()
        await decided.wait()
        if self._handed_over:
            raise HandedOver


#: The pause of a transport no service pauses (tests, tools): never requested.
NEVER = Pause()
