"""Stopping every connection at a request boundary, for a hand-over (docs/upgrade.md).

A hand-over needs the lock tables to stand still while they are copied to the
successor, and every connection to be between two requests: no reply half sent, no
line half handled. :class:`Pause` gets there without waking the connections that
are already at rest, and with no lock on the hot path:

* a connection waiting for its next request (or for the grant of a waiting
  request) is *idle*: it said so on its way into the wait (:meth:`Pause.idle`), its
  state is complete as it stands, and it counts as parked without being woken. If
  it wakes while the pause lasts (data came, a grant came) it does nothing
  observable: it parks;
* a connection working through a chunk of pipelined requests checks
  :attr:`Pause.requested` after each one and parks with the rest of the chunk as its
  backlog, once the replies it owes are sent;
* a connection whose request waits for a grant rests with that request still
  waiting in the engine: the waiter moves with the state, and whoever serves the
  connection next sends its reply.

* a connection whose client does not take its replies (a send waiting for room in
  the socket) is not left to hold everyone else: the pause interrupts the wait
  (:meth:`Pause.stall_scope`). A socket keeps what it could not send as bytes the
  connection owes, carried with it and sent first by whoever serves it next; a
  stream that cannot tell what went out (TLS, a WebSocket message) gets
  :data:`STREAM_SEND_GRACE` to finish, then ends as its send timeout would end it.

Then the decision: :meth:`Pause.resume` (the hand-over failed; every connection goes
on as if nothing had happened) or :meth:`Pause.hand_over` (the successor serves them
now; their tasks end without closing anything). Waking 1,000 idle connections to
park them cost 60 ms of the pause; counting them as they rest costs nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import trio

#: A connection's resting state as its server keeps it
#: (:class:`elockd.net.transport.Parked`): the pause only holds and hands them out.
R = TypeVar("R", bound=Hashable)

#: Once a pause is requested, how long a send that cannot be split (a TLS record, a
#: WebSocket message) may still wait for its client before it counts as stuck. A
#: client keeping up finishes well within it; one that does not read holds the
#: pause up by this much at most.
STREAM_SEND_GRACE = 0.01


class Interrupted(Exception):
    """A connection's read was interrupted because a pause was requested."""


class HandedOver(Exception):
    """The connection is the successor's now: end its task, close nothing."""


class Pause(Generic[R]):
    """The switch every connection of a service looks at (see the module docstring).
    What a connection rests as (``R``) is its server's business: the pause keeps
    them, by identity, for the hand-over to collect."""

    def __init__(self) -> None:
        self.requested = False
        self.parked: dict[int, R] = {}
        #: Connections resting in a wait right now (see :meth:`idle`).
        self.idle: set[R] = set()
        #: Sends waiting for their client right now, each with the grace it has
        #: once a pause is requested (see :meth:`stall_scope`).
        self.sending: dict[trio.CancelScope, float] = {}
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
        now = trio.current_time()
        for scope, grace in self.sending.items():
            scope.deadline = min(scope.deadline, now + grace)

    def resting(self) -> list[R]:
        """Every connection at rest now: parked, or idle in a wait."""
        parked = self.parked
        return [*parked.values(), *(rest for rest in self.idle if id(rest) not in parked)]

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
    def stall_scope(self, deadline: float, grace: float) -> Iterator[trio.CancelScope]:
        """A cancel scope for a send waiting for its client: it ends at ``deadline``
        (the send timeout), or ``grace`` after a pause is requested, before the wait
        or during it. The caller tells which by :attr:`requested`."""
        if self.requested:
            deadline = min(deadline, trio.current_time() + grace)
        with trio.CancelScope(deadline=deadline) as scope:
            self.sending[scope] = grace
            try:
                yield scope
            finally:
                del self.sending[scope]

    async def park(self, rest: R) -> None:
        """Rest until the decision: return to go on, or raise :class:`HandedOver`."""
        decided = self._decided
        self.parked[id(rest)] = rest
        self._changed.set()
        await decided.wait()
        if self._handed_over:
            raise HandedOver


#: The pause of a transport no service pauses (tests, tools): never requested.
NEVER: Pause[Any] = Pause()
