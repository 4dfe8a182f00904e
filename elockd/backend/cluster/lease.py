"""The node's lease: what etcd's ``concurrency/session.go`` is to its own client.

One etcd lease per node rather than per session (as etcd's own lock service shares
one among a session's locks): keepalives grow with nodes, not sessions. Every
session record and queue entry of the node's sessions hangs on it
(``--session-ttl``), so a dead node's sessions are freed by etcd when it runs out.

Here is all of it, as in etcd's ``Session``: the lease's id, its grant, its
keepalive and its revoke, and the *local deadline* (:func:`lease_deadline`) after
which the node confirms nothing held under it, whatever the keepalive loop is doing
(it may be stuck in a call for ``--etcd-timeout``). When the lease is gone, or may
be, every session that wrote under it is lost: this module says when, and the
session ends (:mod:`.ends`) say what that means for a session. The keeper's loop
that calls :meth:`NodeLease.keep_alive` every TTL/3 is the node's (:mod:`.node`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.ledger import ClusterSession
from elockd.backend.interface import BackendUnavailable

#: Seconds before etcd could expire the node's lease at the earliest that the node
#: stops confirming anything held under it (see :func:`lease_deadline`).
LEASE_MARGIN = 0.5
#: How far this host's clock may run slow against the etcd leader's, as a fraction
#: of the time measured (an NTP-disciplined clock is off by parts per million; a
#: VM's clock that jumps or drifts by this much is broken anyway).
CLOCK_RATE_ERROR = 0.02


def lease_deadline(sent: float, ttl: float) -> float:
    """When the node stops confirming holds under a lease whose last keepalive (or
    grant) was *sent* at ``sent`` and answered with ``ttl`` seconds.

    Why this is ahead of any moment another node could be granted those locks:
    etcd's leader restarts a lease's TTL when it applies the keepalive, which is
    after we sent it, so etcd cannot expire the lease before ``sent + ttl`` as
    measured on the leader's clock (a leader change only resets the TTL to the
    full value, later still; etcd checks for expired leases every 0.5 s, which
    only makes its expiry later). Another node's grant follows that expiry. This
    node's clock may run slower than the leader's by ``CLOCK_RATE_ERROR`` of the
    TTL, and acting on the deadline takes time: the timer fires in a busy event
    loop, connections are closed, and a reply already written reaches its client
    one trip later. ``LEASE_MARGIN`` covers that. So nothing this node confirms
    after the deadline, and nothing it confirmed before, overlaps a grant made
    elsewhere after etcd's expiry, as long as the loop lags less than the margin
    (docs/cluster.md, "What is guaranteed")."""
    return sent + ttl * (1 - CLOCK_RATE_ERROR) - LEASE_MARGIN


class NodeLease:
    """The etcd lease every record and entry of this node's sessions hangs on: its
    id (0 until the node has joined, and after etcd let it run out until the node
    has a new one) and the local deadline after which the node confirms nothing
    held under it (infinity with no lease).

    ``lose_all`` is told why when the lease is gone (or may be): every session that
    wrote under it is then lost."""

    def __init__(self, calls: EtcdCalls, ttl: int, lose_all: Callable[[str], None]) -> None:
        self.calls = calls
        self.ttl = ttl
        self._lose_all = lose_all
        self.id = 0
        self.deadline = math.inf
        #: When the sessions under a lease were last lost: what a request read
        #: before it may describe holds etcd has freed since, whatever lease the
        #: node has by the time it answers (see :meth:`cannot_vouch`).
        self.lost_at = -math.inf
        #: Set while the node has a lease: a request waits on it while the node
        #: gets a new one (see :meth:`wait_for_lease`).
        self._ready = trio.Event()
        #: Set (and replaced) whenever the lease or its deadline changes: the
        #: node's deadline timer sleeps on it (see :meth:`enforce_deadline`).
        self._moved = trio.Event()

    def current(self) -> int:
        """The node's lease, for a write: never 0, which would make a key that
        outlives the node."""
        if not self.id:
            raise BackendUnavailable("this node has no etcd lease (etcd let it run out)")
        return self.id

    def renewed(self, lease: int, sent: float, ttl: float) -> None:
        """etcd confirmed ``lease`` (granted, or kept alive) for ``ttl`` seconds in
        answer to a call sent at ``sent``."""
        self.set(lease, lease_deadline(sent, ttl))

    def set(self, lease: int, deadline: float) -> None:
        """The node's lease (new, renewed, or a predecessor's) and its local
        deadline; 0 and infinity for none."""
        self.id = lease
        self.deadline = deadline
        if lease:
            self._ready.set()
        elif self._ready.is_set():
            self._ready = trio.Event()
        self._moved.set()
        self._moved = trio.Event()

    # ------------------------------------------------------ the local deadline

    async def enforce_deadline(self) -> None:
        """The node's deadline timer: the moment the lease passes its local
        deadline, every session under it is lost (connections closed, logged), not
        at the next keepalive round, which may be stuck in a call to etcd for up to
        ``--etcd-timeout``. Runs until cancelled."""
        while True:
            with trio.move_on_at(self.deadline):
                await self._moved.wait()
                continue
            self.check_expiry()
            if self.calls.frozen and self.id:
                # A hand-over copies the books and keeps them as they are; the
                # successor checks the lease before it serves on.
                await self.calls.thawed()

    def past_deadline(self) -> bool:
        """Has the lease passed its local deadline? Changes nothing: while a
        hand-over copies the books (when :meth:`gone` leaves them as they are) and
        on a successor that has not joined yet, this alone refuses confirmations."""
        return trio.current_time() >= self.deadline

    def confirm(self, session: ClusterSession) -> None:
        """Before anything held under the node's lease is confirmed to a client (a
        grant, ``token``, ``renew``, a lock already held): the lease is within its
        local deadline and the session was not lost. BackendUnavailable else."""
        self.check_expiry()
        if session.lost or self.past_deadline():
            raise BackendUnavailable("session lost: this node's etcd lease ran out")

    def cannot_vouch(self, asked: float) -> bool:
        """The deadline gate (:meth:`~elockd.backend.interface.Backend.deadline_gate`),
        asked after the last await of every reply about a hold read at ``asked``:
        True past the local deadline (the sessions are then lost, as at the timer);
        True without a lease (lost, and no new one yet: etcd may not be answering,
        and the node's copy of the queues may be frozen at the moment it was cut
        off); and True when the sessions were lost since ``asked``, even if the node
        has a new lease by now: what the request read (an etcd answer that came just
        before a pause, say) may describe holds etcd freed meanwhile."""
        self.check_expiry()
        return not self.id or trio.current_time() >= self.deadline or self.lost_at >= asked

    async def wait_for_lease(self) -> None:
        """Return once the node has a lease, waiting up to the etcd deadline while
        it gets a new one: a node that finds its lease gone (after a pause, or an
        outage) asks for a new one at once, and a request that comes meanwhile is
        served once it has it, not refused for a gap of one etcd round trip.
        BackendUnavailable if etcd does not give one within the deadline."""
        self.check_expiry()
        if not self.id:
            with trio.move_on_after(self.calls.deadline):
                await self._ready.wait()
        self.current()

    def check_expiry(self) -> None:
        """If the lease has passed its local deadline (no keepalive answered in time:
        a pause, an outage, a partition), etcd may expire it at any moment and
        another node grant its locks: the sessions' holds are no longer this node's
        to promise. Fail closed, and get a new lease."""
        if trio.current_time() >= self.deadline:
            self.gone("etcd was not reached in time to keep the node's lease")

    def gone(self, why: str) -> None:
        """etcd no longer has the node's lease, or may not: every session that wrote
        anything there is lost, and the node wants a new lease at once. Not while a
        hand-over copies the books: whoever serves on finds out at its first
        keepalive."""
        if self.calls.frozen or not self.id:
            return
        old = self.id
        self.set(0, math.inf)
        self._lost(why)
        self.calls.keeper_wanted.set()  # a new lease at once

        # If etcd still has it (its keepalives got through, but their answers came
        # late), its entries would block their queues until etcd expires it: revoke
        # it, if etcd answers. Not before the lost sessions' connections had the
        # margin to close: a revoke lets other nodes grant their locks at once, and
        # losing a session only cancels its connection's task, which closes it when
        # it runs.
        async def revoke_later() -> None:
            await trio.sleep(LEASE_MARGIN)
            await self.calls.revoke_quietly(old)

        self.calls.spawn(revoke_later, "revoke a lapsed lease")

    def _lost(self, why: str) -> None:
        """Every session under the lease is lost, now (the gate reads when)."""
        self.lost_at = trio.current_time()
        self._lose_all(why)

    # ------------------------------------------------- grant, keepalive, revoke
    # The node's start-up and its keeper call these and count or retry a failure
    # by their own rules: etcd's errors come out as they are (calls.unmapped).

    async def adopt(self, lease: int) -> None:
        """At join: a predecessor's lease (a hand-over) if it still lives, else a
        new one, and with it every adopted session is lost."""
        if lease:
            sent = trio.current_time()
            remaining = await self.calls.unmapped.lease_keepalive(lease)
            if remaining:
                self.renewed(lease, sent, remaining)
                return
            self._lost("the node's etcd lease ran out during the hand-over")
        await self.grant()

    async def grant(self) -> None:
        """A new lease of ``--session-ttl`` seconds."""
        sent = trio.current_time()
        lease, ttl = await self.calls.unmapped.lease_grant(self.ttl)
        self.renewed(lease, sent, ttl)

    async def keep_alive(self) -> None:
        """One keepalive of the lease, or a new lease when it is gone; while a
        hand-over copies the books, wait for it to end instead (or for whoever
        serves on to get one)."""
        lease = self.id
        if not lease:
            if self.calls.frozen:
                await self.calls.thawed()  # or whoever serves on gets one
            else:
                await self.grant()
            return
        sent = trio.current_time()
        # Its answer is of use until the local deadline (it moves the deadline on),
        # however slow etcd's answers come: waited for that long, if that is longer
        # than --etcd-timeout.
        until = self.deadline
        remaining = await self.calls.unmapped.lease_keepalive(lease, until=until)
        if self.id != lease:
            return
        if remaining == 0:
            self.gone("etcd expired the node's lease")
        else:
            self.renewed(lease, sent, remaining)

    async def revoke(self) -> None:
        """The node is leaving: revoke its lease, so the locks of its sessions go at
        once rather than after the session TTL. A session another node has taken
        over has moved onto that node's lease and is not touched."""
        if self.id:
            await self.calls.revoke_quietly(self.id)
