"""The hand-over's state (:mod:`elockd.handover.state`): a successor rebuilt from
the records must behave exactly as the old process would have.

The example tests each move one kind of state (holds, leases, grace, queues, an
``mlock`` half taken, tokens, counters, bytes that are not ASCII) and then ask the
old service, which serves on as after a failed hand-over, and its successor the
same requests: the replies must be the same, and the expected ones. Every record
goes through ``json.dumps``/``json.loads`` first, as on the control socket.

The state machine at the end drives two engines in lockstep through random
requests, disconnects, take-overs and a moving clock, and at random points
replaces the second one by a copy of itself made the same way (on a clock of its
own). From then on both must answer every request alike and keep the same
holders, queues, tokens, leases and deadlines, in the same order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import patch

import pytest
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from elockd.backend import memory_state
from elockd.backend import state as records
from elockd.backend.cluster.etcd.client import EtcdClient
from elockd.backend.cluster.space import ClusterLockSpace
from elockd.backend.interface import QueueFull, TooManyHolds
from elockd.backend.memory import MemoryBackend, Wait
from elockd.engine.locks import FREE_SLICE
from elockd.engine.sessions import WAITING, Hold, Session, Waiter
from elockd.handover.parked import Backlog, Parked
from elockd.handover.state import ConnectionState, Record, Restorer, StateError, dump_state
from elockd.net.transport import StreamTransport
from elockd.protocol.commands import COMMANDS
from elockd.protocol.config import Config
from elockd.protocol.connection import WORD, Connection, Outcome, Service
from elockd.protocol.framing import LineReader
from tests.support.sansio import whole

#: A key of every byte a latin-1 round trip could get wrong.
HIGH_KEY = bytes(range(0x80, 0x100))


# ------------------------------------------------------------------- helpers


def new_service(
    first_token: int = 1,
    *,
    free_slice: int = FREE_SLICE,
    token: bytes | None = None,
    **settings: Any,
) -> Service:
    """A service on a fresh in-memory backend, its histograms fed (as with a
    metrics port), fencing tokens from ``first_token``; ``token``: ``auth`` wanted."""
    config = Config(**settings)
    backend = MemoryBackend(
        first_token=first_token,
        max_waiters=config.max_waiters,
        max_holds=config.max_holds,
        max_sessions=config.max_sessions,
        free_slice=free_slice,
    )
    service = Service(config, backend, COMMANDS, token)
    service.feed_timings()
    return service


def engine_of(service: Service) -> MemoryBackend:
    backend = service.backend
    assert isinstance(backend, MemoryBackend)
    return backend


def transport() -> StreamTransport:
    """A connection's transport as the successor wraps a socket (never used here)."""
    return StreamTransport(trio.testing.memory_stream_pair()[0])


def parked(conn: Connection, pending: Outcome | None = None) -> Parked:
    return Parked(
        conn, LineReader(conn.service.config.max_line), transport(), conn.peer, Backlog(pending)
    )


def over_json(records: Iterator[Record]) -> list[Record]:
    """The records as the control socket carries them (strict JSON: no NaN or
    infinity either), each checked to come back unchanged."""
    carried = []
    for record in records:
        back = json.loads(json.dumps(record, allow_nan=False))
        assert back == record, f"{record['t']} record changed through JSON"
        carried.append(back)
    return carried


def restore(
    old: Service,
    now: float,
    states: list[ConnectionState],
    successor: Service,
    clock: float,
) -> tuple[list[Record], list[Parked]]:
    """Dump ``old`` at ``now`` and rebuild it into ``successor`` at ``clock`` (its
    own time); every state with an fd gets a transport."""
    records = over_json(dump_state(old, states, now))
    restorer = Restorer(successor, clock)
    for record in records:
        restorer.feed(record)
    transports = {s.fd: transport() for s in states if s.fd is not None}
    return records, restorer.connections(dict(transports))


@dataclass
class Both:
    """The old service (serving on, as after a failed hand-over) and its successor,
    whose clock reads ``offset`` more: every request goes to both, and both must
    answer it alike."""

    old: Service
    new: Service
    offset: float
    records: list[Record]
    parked: list[Parked]
    pairs: dict[Connection, Connection] = field(default_factory=dict)

    def __post_init__(self) -> None:
        by_session = {p.conn.session.id: p.conn for p in self.parked if p.conn is not None}
        for conn in self.old.connections:
            if conn.session.id in by_session:
                self.pairs[conn] = by_session[conn.session.id]

    def ask(self, conn: Connection, line: bytes, now: float) -> bytes:
        """The reply of both to ``line``, asked on ``conn`` and on its successor."""
        old = whole(conn.handle(line, now))
        new = whole(self.pairs[conn].handle(line, now + self.offset))
        assert old == new, f"{line!r}: the successor said {new!r}, the old one {old!r}"
        return old

    def connect(self, peer: bytes) -> Connection:
        """A new connection to both; ``ask`` it on the old one's."""
        conn = Connection(self.old, peer)
        self.pairs[conn] = Connection(self.new, peer)
        return conn

    def advance(self, now: float) -> None:
        engine_of(self.old).advance(now)
        engine_of(self.new).advance(now + self.offset)

    def pending(self, conn: Connection) -> Outcome:
        """The successor's reply-later of the request ``conn`` parked with."""
        found = next(p for p in self.parked if p.conn is self.pairs[conn])
        assert found.backlog.pending is not None
        return found.backlog.pending

    def snapshots(self) -> tuple[dict[str, int], dict[str, int]]:
        return self.old.snapshot(), self.new.snapshot()


def hand_over(
    old: Service,
    now: float,
    conns: list[Connection],
    *,
    pending: dict[Connection, Outcome] | None = None,
    successor: Service | None = None,
    offset: float = 1000.0,
) -> Both:
    """Hand ``old`` over at ``now`` with ``conns`` parked (``pending`` their waiting
    requests) to ``successor``, whose clock reads ``now + offset``."""
    pending = pending or {}
    states = [ConnectionState(parked(c, pending.get(c)), fd) for fd, c in enumerate(conns)]
    new = successor or new_service()
    records, served = restore(old, now, states, new, now + offset)
    return Both(old, new, offset, records, served)


def reply(outcome: Outcome) -> bytes | None:
    """The reply of a request that waited, or None while it still waits."""
    assert isinstance(outcome.later, Wait)
    return None if outcome.later.waiter.waiting else whole(outcome)


def connect(service: Service, port: int) -> Connection:
    return Connection(service, b"10.0.0.1:%d" % port)


def waits(conn: Connection, line: bytes, now: float) -> Outcome:
    """Ask ``line``, a request that must wait: its reply-later."""
    outcome = conn.handle(line, now)
    assert isinstance(outcome, Outcome) and reply(outcome) is None, outcome
    return outcome


# ------------------------------------------------------------ exclusive holds


def test_exclusive_holds_keep_their_owner_token_lease_and_age() -> None:
    old = new_service(first_token=500)
    named, plain = connect(old, 1), connect(old, 2)
    assert whole(named.handle(b"iam nightly-backup", 0.0)) == b"1 ok\r\n"
    assert whole(named.handle(b"g k1", 0.0)) == b"1 Got Lock\r\n"
    assert whole(named.handle(b"lock k2 ttl=30", 1.0)) == b"200 Acquired\r\n"
    assert whole(plain.handle(b"g k3", 2.0)) == b"1 Got Lock\r\n"
    both = hand_over(old, 10.0, [named, plain])

    assert both.ask(plain, b"d", 10.0) == (
        b"k1: nightly-backup\r\nk2: nightly-backup\r\nk3: 10.0.0.1:2\r\nEND\r\n"
    )
    assert both.ask(named, b"token k1", 10.0) == b"200 500\r\n"
    assert both.ask(named, b"token k2", 10.0) == b"200 501\r\n"
    assert both.ask(plain, b"info k2", 10.0) == (
        b"200 key=k2 exclusive=nightly-backup shared=0 waiting=0 ttl=21.000 token=501\r\n"
    )
    assert both.ask(plain, b"g k1", 10.0) == b"0 Cannot Get Lock\r\n"
    assert both.ask(plain, b"r k1", 10.0) == b"0 Cannot Release Lock\r\n"
    assert both.ask(named, b"r k1", 20.0) == b"1 Released Lock\r\n"
    assert both.ask(plain, b"g k1", 20.0) == b"1 Got Lock\r\n"
    assert both.ask(plain, b"token k1", 20.0) == b"200 503\r\n"  # k3 had 502
    # The hold's age came along: k1 was held 20 s, in the same bucket on both sides.
    old_hold, new_hold = (s.timings.hold[False] for s in (both.old, both.new))
    assert (new_hold.counts, new_hold.sum) == (old_hold.counts, old_hold.sum)
    assert old_hold.sum == 20.0


# --------------------------------------------------------------- shared holds


def test_shared_holds_with_one_and_several_holders_per_key() -> None:
    old = new_service()
    first, second, third = (connect(old, port) for port in (1, 2, 3))
    assert whole(first.handle(b"sg alone", 0.0)) == b"1 Got Lock\r\n"
    for conn in (first, second, third):
        whole(conn.handle(b"lock_shared crowd 0 limit=3", 0.0))
    both = hand_over(old, 5.0, [first, second, third])

    assert both.ask(first, b"sd", 5.0) == (
        b"alone: 10.0.0.1:1\r\n"
        b"crowd: 10.0.0.1:1\r\ncrowd: 10.0.0.1:2\r\ncrowd: 10.0.0.1:3\r\nEND\r\n"
    )
    assert both.ask(first, b"si crowd", 5.0) == b"3 Locked\r\n"
    assert both.ask(first, b"lock_shared crowd 0 limit=3", 5.0) == b"200 3\r\n"  # holds it
    fourth = both.connect(b"10.0.0.1:4")
    assert both.ask(fourth, b"lock_shared crowd 0 limit=3", 5.0) == b"409 3\r\n"
    assert both.ask(second, b"unlock_shared crowd", 6.0) == b"200 2\r\n"
    assert both.ask(fourth, b"lock_shared crowd 0 limit=3", 6.0) == b"200 3\r\n"
    assert both.ask(first, b"sr alone", 6.0) == b"1 Released Lock\r\n"
    assert both.ask(first, b"si alone", 6.0) == b"0 Not Locked\r\n"
    assert both.snapshots()[0]["shared_holders"] == 3


# -------------------------------------------------------------------- leases


def test_a_lease_keeps_its_time_left_on_another_clock() -> None:
    old = new_service()
    holder, other = connect(old, 1), connect(old, 2)
    assert whole(holder.handle(b"lock k ttl=30", 0.0)) == b"200 Acquired\r\n"
    assert whole(holder.handle(b"sg s", 0.0)) == b"1 Got Lock\r\n"
    assert whole(holder.handle(b"renew s ttl=20", 0.0)) == b"200 Renewed\r\n"
    both = hand_over(old, 10.0, [holder, other], offset=-7.5)

    assert both.ask(other, b"info k", 10.0).endswith(b" ttl=20.000 token=1\r\n")
    both.advance(19.75)
    assert both.ask(other, b"si s", 19.75) == b"1 Locked\r\n"
    both.advance(20.0)
    assert both.ask(other, b"si s", 20.0) == b"0 Not Locked\r\n"
    both.advance(29.75)
    assert both.ask(other, b"i k", 29.75) == b"1 Locked\r\n"
    both.advance(30.0)
    assert both.ask(other, b"i k", 30.0) == b"0 Not Locked\r\n"
    old_counters, new_counters = both.snapshots()
    assert old_counters["expired"] == new_counters["expired"] == 2
    assert old_counters["leases"] == new_counters["leases"] == 0


# ------------------------------------------------------------------ sessions


def grace_state() -> tuple[Service, Connection, Connection, str]:
    """A session gone at t=1 with 5 s of grace and a hold; another connection."""
    old = new_service()
    gone, other = connect(old, 1), connect(old, 2)
    assert whole(gone.handle(b"set_timeout 5000", 0.0)) == b"200 timeout set\r\n"
    assert whole(gone.handle(b"g k", 0.0)) == b"1 Got Lock\r\n"
    gone.close(1.0)
    return old, gone, other, gone.session.id


def test_a_session_in_grace_can_be_taken_over_by_its_id() -> None:
    old, _, other, session_id = grace_state()
    both = hand_over(old, 2.0, [other], offset=333.0)
    old_counters, new_counters = both.snapshots()
    assert old_counters["sessions"] == new_counters["sessions"] == 2
    assert engine_of(both.new).sessions_in_grace == 1
    back = both.connect(b"10.0.0.1:3")
    assert both.ask(back, b"conn_id " + session_id.encode(), 5.75) == b"200 conn id set\r\n"
    both.advance(6.0)  # the grace would have ended now: it was cut short
    assert both.ask(back, b"r k", 6.0) == b"1 Released Lock\r\n"
    assert both.snapshots()[0]["orphans"] == both.snapshots()[1]["orphans"] == 0


def test_a_session_in_grace_ends_when_its_grace_would_have() -> None:
    old, _, other, session_id = grace_state()
    both = hand_over(old, 2.0, [other], offset=333.0)
    both.advance(5.75)
    assert both.ask(other, b"i k", 5.75) == b"1 Locked\r\n"
    both.advance(6.0)
    assert both.ask(other, b"i k", 6.0) == b"0 Not Locked\r\n"
    late = both.connect(b"10.0.0.1:3")
    assert both.ask(late, b"conn_id " + session_id.encode(), 6.0) == b"403 cannot set conn id\r\n"
    old_counters, new_counters = both.snapshots()
    assert old_counters["orphans"] == new_counters["orphans"] == 1
    assert old_counters["sessions"] == new_counters["sessions"] == 2


def test_a_session_that_owns_only_leases_lives_on_until_they_end() -> None:
    old = new_service()
    leaser, other = connect(old, 1), connect(old, 2)
    assert whole(leaser.handle(b"lock k ttl=60", 0.0)) == b"200 Acquired\r\n"
    assert whole(leaser.handle(b"g plain", 0.0)) == b"1 Got Lock\r\n"
    session_id = leaser.session.id
    leaser.close(1.0)  # no grace: the plain hold goes, the lease stays
    both = hand_over(old, 2.0, [other])
    assert both.ask(other, b"i plain", 2.0) == b"0 Not Locked\r\n"
    assert both.ask(other, b"i k", 2.0) == b"1 Locked\r\n"
    old_counters, new_counters = both.snapshots()
    assert old_counters["sessions"] == new_counters["sessions"] == 2
    assert engine_of(both.new).detached == engine_of(both.old).detached == 1
    both.advance(60.0)
    assert both.ask(other, b"i k", 60.0) == b"0 Not Locked\r\n"
    assert both.snapshots()[0]["sessions"] == both.snapshots()[1]["sessions"] == 1
    late = both.connect(b"10.0.0.1:3")
    assert both.ask(late, b"conn_id " + session_id.encode(), 60.0) == b"403 cannot set conn id\r\n"


def test_a_session_waiting_for_its_holds_to_be_freed_is_freed_by_the_successor() -> None:
    """A session that ended with more holds than the slice may free stays queued,
    its holds held, until the next slice: the successor runs that slice."""
    old = new_service(free_slice=1)
    gone, waiter = connect(old, 1), connect(old, 2)
    for key in (b"a", b"b"):
        whole(gone.handle(b"g " + key, 0.0))
    pending = waits(waiter, b"lock b 30", 0.0)
    session_id = gone.session.id
    gone.close(1.0)
    assert [(s.id, why) for s, why in engine_of(old)._ending] == [(session_id, "disconnected")]
    both = hand_over(old, 1.0, [waiter], pending={waiter: pending})
    assert [(s.id, why) for s, why in engine_of(both.new)._ending] == [(session_id, "disconnected")]
    assert engine_of(both.new).next_deadline() == -math.inf  # there is work now
    assert both.ask(waiter, b"i a", 1.0) == b"1 Locked\r\n"
    late = both.connect(b"10.0.0.1:3")
    assert both.ask(late, b"conn_id " + session_id.encode(), 1.0) == b"403 cannot set conn id\r\n"
    both.advance(1.0)
    assert both.ask(waiter, b"i a", 1.0) == b"0 Not Locked\r\n"
    assert reply(pending) == reply(both.pending(waiter)) == b"200 Acquired\r\n"
    assert both.ask(waiter, b"token b", 1.0) == b"200 3\r\n"
    old_counters, new_counters = both.snapshots()
    assert old_counters["orphans"] == new_counters["orphans"] == 2


@pytest.mark.parametrize("grace", [0, 3000])
def test_a_session_whose_connection_did_not_move_follows_its_grace_rule(grace: int) -> None:
    """A connection without a socket to move (TLS, WebSocket) closes at the
    hand-over: its session is disconnected then, as if its client went away."""
    old = new_service()
    stuck, moved = connect(old, 1), connect(old, 2)
    assert whole(stuck.handle(b"set_timeout %d" % grace, 0.0)) == b"200 timeout set\r\n"
    assert whole(stuck.handle(b"g k", 0.0)) == b"1 Got Lock\r\n"
    states = [ConnectionState(parked(stuck), None), ConnectionState(parked(moved), 0)]
    new = new_service()
    _, served = restore(old, 1.0, states, new, 1.0)
    assert [p.conn.session.id for p in served if p.conn] == [moved.session.id]
    engine = engine_of(new)
    session = engine.sessions.get(stuck.session.id)
    if grace:
        assert session is not None and not session.connected
        assert session.grace_deadline == 4.0 and b"k" in engine.exclusive
    else:
        assert session is None and b"k" not in engine.exclusive and engine.orphans == 1


# -------------------------------------------------------------------- queues


def test_queued_waiters_keep_their_order_and_their_pending_replies() -> None:
    old = new_service()
    holder = connect(old, 1)
    waiters = [connect(old, port) for port in (2, 3, 4)]
    assert whole(holder.handle(b"g k", 0.0)) == b"1 Got Lock\r\n"
    pending = {w: waits(w, b"lock k 30", float(n)) for n, w in enumerate(waiters)}
    both = hand_over(old, 5.0, [holder, *waiters], pending=pending)

    assert both.ask(holder, b"info k", 5.0).endswith(b" waiting=3 ttl=- token=1\r\n")
    assert [reply(both.pending(w)) for w in waiters] == [None, None, None]
    assert both.ask(holder, b"r k", 6.0) == b"1 Released Lock\r\n"
    for first, later in ((0, [1, 2]), (1, [2])):
        winner = waiters[first]
        for outcome in (pending[winner], both.pending(winner)):
            assert reply(outcome) == b"200 Acquired\r\n"
        assert [reply(both.pending(waiters[n])) for n in later] == [None] * len(later)
        assert both.ask(winner, b"unlock k", 7.0) == b"200 Unlocked\r\n"
    assert reply(both.pending(waiters[2])) == b"200 Acquired\r\n"
    assert both.ask(waiters[2], b"token k", 7.0) == b"200 4\r\n"


def test_a_queued_wait_times_out_when_it_would_have() -> None:
    old = new_service()
    holder, waiter = connect(old, 1), connect(old, 2)
    whole(holder.handle(b"g k", 0.0))
    pending = waits(waiter, b"lock k 10", 0.0)
    both = hand_over(old, 4.0, [holder, waiter], pending={waiter: pending}, offset=50.0)
    both.advance(9.75)
    assert reply(both.pending(waiter)) is None
    both.advance(10.0)
    assert reply(pending) == reply(both.pending(waiter)) == b"409 Unavailable\r\n"
    old_counters, new_counters = both.snapshots()
    assert old_counters["timeouts"] == new_counters["timeouts"] == 1
    old_waits, new_waits = (s.timings.wait[False] for s in (both.old, both.new))
    assert (new_waits.counts, new_waits.sum) == (old_waits.counts, old_waits.sum) != ([0] * 16, 0)


def test_shared_waiters_keep_their_limits_and_their_turn() -> None:
    old = new_service()
    holders = [connect(old, port) for port in (1, 2)]
    for count, conn in enumerate(holders, 1):
        assert whole(conn.handle(b"lock_shared k 0 limit=2", 0.0)) == b"200 %d\r\n" % count
    narrow, wide = connect(old, 3), connect(old, 4)
    pending = {
        narrow: waits(narrow, b"lock_shared k 30 limit=2", 1.0),
        wide: waits(wide, b"lock_shared k 30 limit=4", 2.0),  # fits, but queues behind
    }
    both = hand_over(old, 3.0, [*holders, narrow, wide], pending=pending)
    late = both.connect(b"10.0.0.1:5")
    assert both.ask(late, b"lock_shared k 0 limit=9", 3.0) == b"409 2\r\n"  # no overtaking
    assert reply(both.pending(narrow)) is None and reply(both.pending(wide)) is None
    assert both.ask(holders[0], b"unlock_shared k", 4.0) == b"200 3\r\n"  # both got in
    for conn, expected in ((narrow, b"200 2\r\n"), (wide, b"200 3\r\n")):
        assert reply(pending[conn]) == reply(both.pending(conn)) == expected


def test_an_mlock_waiter_keeps_the_keys_it_took_and_waits_for_the_rest() -> None:
    old = new_service()
    holder, multi = connect(old, 1), connect(old, 2)
    assert whole(holder.handle(b"g b", 0.0)) == b"1 Got Lock\r\n"
    pending = waits(multi, b"mlock a b c wait=30 ttl=100", 1.0)
    both = hand_over(old, 2.0, [holder, multi], pending={multi: pending})
    # a and c were free: the waiter holds them while it waits for b.
    assert both.ask(holder, b"info a", 2.0) == (
        b"200 key=a exclusive=10.0.0.1:2 shared=0 waiting=0 ttl=- token=2\r\n"
    )
    assert both.ask(holder, b"info b", 2.0).endswith(b" waiting=1 ttl=- token=1\r\n")
    assert both.ask(holder, b"g c", 2.0) == b"0 Cannot Get Lock\r\n"
    assert both.ask(holder, b"r b", 3.0) == b"1 Released Lock\r\n"
    assert reply(pending) == reply(both.pending(multi)) == b"200 Acquired\r\n"
    assert both.ask(multi, b"token b", 3.0) == b"200 4\r\n"
    assert both.ask(multi, b"info c", 3.0).endswith(b" ttl=100.000 token=3\r\n")


def test_an_mlock_waiter_that_gives_up_frees_the_keys_it_took() -> None:
    old = new_service()
    holder, multi = connect(old, 1), connect(old, 2)
    whole(holder.handle(b"g b", 0.0))
    pending = waits(multi, b"mlock a b wait=5", 0.0)
    both = hand_over(old, 1.0, [holder, multi], pending={multi: pending})
    both.advance(5.0)
    assert reply(pending) == reply(both.pending(multi)) == b"409 Unavailable b\r\n"
    assert both.ask(holder, b"i a", 5.0) == b"0 Not Locked\r\n"


# ------------------------------------------------------------ deadline order


def test_a_wait_ending_with_the_lease_it_waits_for_ends_as_it_would_have() -> None:
    """The wait's deadline went into the heap first, so it times out before the
    lease frees the key: the successor must not grant it instead."""
    old = new_service()
    holder, waiter = connect(old, 1), connect(old, 2)
    whole(holder.handle(b"g k", 0.0))
    pending = waits(waiter, b"lock k 2", 0.0)
    assert whole(holder.handle(b"renew k ttl=1", 1.0)) == b"200 Renewed\r\n"
    both = hand_over(old, 1.0, [holder, waiter], pending={waiter: pending})
    both.advance(2.0)
    assert reply(pending) == reply(both.pending(waiter)) == b"409 Unavailable\r\n"
    assert both.ask(waiter, b"i k", 2.0) == b"0 Not Locked\r\n"


def test_leases_ending_together_hand_their_keys_on_in_the_same_order() -> None:
    """Two leases ending at one instant free their keys in the order the heap had
    them (renewed b, then a), and the waiters' fencing tokens follow that order."""
    old = new_service()
    holder, for_a, for_b = connect(old, 1), connect(old, 2), connect(old, 3)
    whole(holder.handle(b"g a", 0.0))
    whole(holder.handle(b"g b", 0.0))
    pending = {for_a: waits(for_a, b"lock a 30", 0.0), for_b: waits(for_b, b"lock b 30", 0.0)}
    whole(holder.handle(b"renew b ttl=1", 0.0))
    whole(holder.handle(b"renew a ttl=1", 0.0))
    both = hand_over(old, 0.5, [holder, for_a, for_b], pending=pending)
    both.advance(1.0)
    assert both.ask(for_b, b"token b", 1.0) == b"200 3\r\n"
    assert both.ask(for_a, b"token a", 1.0) == b"200 4\r\n"


# -------------------------------------------------------------------- tokens


@pytest.mark.parametrize("successor_first", [1, 10**12])
def test_the_next_fencing_token_never_goes_back(successor_first: int) -> None:
    old = new_service(first_token=1000)
    conn = connect(old, 1)
    for n in range(5):
        whole(conn.handle(b"g k%d" % n, 0.0))
    whole(conn.handle(b"r k4", 0.0))  # its token (1004) is spent all the same
    both = hand_over(old, 0.0, [conn], successor=new_service(first_token=successor_first))
    assert whole(both.pairs[conn].handle(b"token k3", 0.0)) == b"200 1003\r\n"
    assert whole(both.pairs[conn].handle(b"lock fresh", 0.0)) == b"200 Acquired\r\n"
    assert whole(both.pairs[conn].handle(b"token fresh", 0.0)) == b"200 %d\r\n" % max(
        1005, successor_first
    )


# ------------------------------------------------------------------ counters


def test_counters_and_histograms_move_and_the_handover_is_counted() -> None:
    old = new_service(grace=0.0)
    conns = [connect(old, port) for port in (1, 2, 3)]
    first, second, third = conns
    for conn, line, now in (
        (first, b"g a", 0.0),
        (first, b"bogus", 0.0),
        (first, b"lock l ttl=1", 0.0),
        (second, b"sg s", 0.0),
        (second, b"g b", 0.0),
        (third, b"i a", 0.0),
        (third, b"q", 0.0),
    ):
        whole(conn.handle(line, now))
    assert first.handle(None, 0.0) == b"0 Line Too Long\r\n"
    waited = waits(third, b"lock a 1", 0.0)
    engine_of(old).advance(1.0)  # the lease expires, the wait times out
    assert reply(waited) == b"409 Unavailable\r\n"
    second.close(2.0)  # an orphan of each kind
    conns.remove(second)
    before = old.snapshot()
    assert (before["expired"], before["timeouts"], before["orphans"]) == (1, 1, 1)
    assert before["shared_orphans"] == before["invalid_commands"] - 1 == 1

    both = hand_over(old, 3.0, conns)
    after = both.new.snapshot()
    assert after == {**before, "handovers": 1}
    for kind in ("wait", "hold"):
        old_buckets, new_buckets = (getattr(s.timings, kind) for s in (both.old, both.new))
        assert [(b.counts, b.sum) for b in new_buckets] == [(b.counts, b.sum) for b in old_buckets]
    again = hand_over(both.new, 4.0, list(both.pairs.values()))
    assert again.new.snapshot() == {**before, "handovers": 2}


def test_auth_done_moves_and_auth_not_done_stays_wanted() -> None:
    old = new_service(token=b"T")
    passed, other = connect(old, 1), connect(old, 2)
    assert whole(passed.handle(b"auth T", 0.0)) == b"200 OK\r\n"
    assert whole(passed.handle(b"g k", 0.0)) == b"1 Got Lock\r\n"
    both = hand_over(old, 1.0, [passed, other], successor=new_service(token=b"T"))
    assert both.ask(passed, b"i k", 2.0) == b"1 Locked\r\n"
    assert both.ask(other, b"g k", 2.0) == b"0 Auth Required\r\n"
    assert both.ask(other, b"lock k", 2.0) == b"403 Auth Required\r\n"


def test_who_keeps_the_order_names_were_set_in() -> None:
    old = new_service()
    first, second, third = (connect(old, port) for port in (1, 2, 3))
    for conn, name in ((first, b"c"), (second, b"a"), (third, b"b"), (first, b"c2")):
        assert whole(conn.handle(b"iam " + name, 0.0)) == b"1 ok\r\n"
    both = hand_over(old, 1.0, [first, second, third])
    listing = b"10.0.0.1:2: a\r\n10.0.0.1:3: b\r\n10.0.0.1:1: c2\r\nEND\r\n"
    assert both.ask(second, b"who", 2.0) == listing


# ---------------------------------------------------------------------- JSON


def test_every_record_survives_json_with_bytes_above_ascii() -> None:
    """Keys, names, peers and unread bytes of every value travel as latin-1 text."""
    old = new_service()
    holder = Connection(old, b"\xfe\xff-peer:1")
    waiter = Connection(old, b"10.0.0.1:2")
    name = b"\xe9quipe-\x80\x9f"
    assert whole(holder.handle(b"iam " + name, 0.0)) == b"1 ok\r\n"
    assert whole(holder.handle(b"g " + HIGH_KEY, 0.0)) == b"1 Got Lock\r\n"
    assert whole(holder.handle(b"sg " + HIGH_KEY[::-1], 0.0)) == b"1 Got Lock\r\n"
    pending = waits(waiter, b"lock " + HIGH_KEY + b" 30", 0.0)
    holder_parked, waiter_parked = parked(holder), parked(waiter, pending)
    waiter_parked.backlog.lines = [b"g \x80\xff", None, b"r \xc3"]
    waiter_parked.reader.feed(b"sg \xf0\x9f")  # half a line, not yet read
    read_ahead = transport()
    read_ahead.read_ahead = b"\x00\x81\xff\n"  # read while the request waited
    waiter_parked.transport = read_ahead
    states = [ConnectionState(holder_parked, 0), ConnectionState(waiter_parked, 1)]
    new = new_service()
    records, served = restore(old, 1.0, states, new, 1.0)
    assert records[0]["t"] == "engine" and records[-1] == {"t": "end"}
    exclusive = next(r for r in records if r["t"] == "exclusive")
    assert exclusive["keys"] == HIGH_KEY.decode("latin-1")  # one character a byte

    new_holder, new_waiter = (p.conn for p in served)
    assert new_holder is not None and new_waiter is not None
    assert new_holder.peer == holder.peer and new_holder.session.name == name
    assert whole(new_waiter.handle(b"d", 1.0)) == HIGH_KEY + b": " + name + b"\r\nEND\r\n"
    assert whole(new_waiter.handle(b"sd", 1.0)) == HIGH_KEY[::-1] + b": " + name + b"\r\nEND\r\n"
    assert whole(new_waiter.handle(b"who", 1.0)) == b"\xfe\xff-peer:1: " + name + b"\r\nEND\r\n"
    back = served[1]
    assert back.backlog.lines == [b"g \x80\xff", None, b"r \xc3"]
    assert back.reader.feed(b"\x80\n") == [b"sg \xf0\x9f\x80"]
    assert back.transport.read_ahead == b"\x00\x81\xff\n"  # type: ignore[attr-defined]
    assert back.backlog.pending is not None
    assert whole(new_holder.handle(b"r " + HIGH_KEY, 2.0)) == b"1 Released Lock\r\n"
    assert reply(back.backlog.pending) == b"200 Acquired\r\n"


# ------------------------------------------------------------- refused input


def test_the_restorer_refuses_what_it_cannot_adopt() -> None:
    old = new_service()
    connect(old, 1)
    with pytest.raises(StateError, match="already has sessions"):
        Restorer(old, 0.0)
    restorer = Restorer(new_service(), 0.0)
    with pytest.raises(StateError, match="unexpected record 'mystery'"):
        restorer.feed({"t": "mystery"})
    with pytest.raises(StateError, match="ended early"):
        restorer.connections({})
    restorer.feed({"t": "end"})
    with pytest.raises(StateError, match="unexpected record 'end'"):
        restorer.feed({"t": "end"})


def test_a_state_of_many_rows_moves_in_batches() -> None:
    old = new_service()
    conns = [connect(old, port) for port in range(7)]
    for n, conn in enumerate(conns):
        whole(conn.handle(b"g k%d" % n, 0.0))
        whole(conn.handle(b"sg s", 0.0))
    waiting = {c: waits(c, b"lock k0 30", 0.0) for c in conns[1:]}
    with patch.object(records, "BATCH", 3), patch.object(memory_state, "HOLDS_BATCH", 3):
        both = hand_over(old, 1.0, conns, pending=waiting)
    kinds = [r["t"] for r in both.records]
    assert kinds.count("sessions") == kinds.count("exclusive") == 3  # 7 rows: 3 + 3 + 1
    assert kinds.count("waiters") == 2  # 6 rows
    assert (
        both.ask(conns[0], b"d", 1.0)
        == b"".join(b"k%d: 10.0.0.1:%d\r\n" % (n, n) for n in range(7)) + b"END\r\n"
    )
    assert both.ask(conns[0], b"r k0", 2.0) == b"1 Released Lock\r\n"
    assert reply(both.pending(conns[1])) == b"200 Acquired\r\n"


# ------------------------------------------------------- the lockstep model


KEYS = [b"a", b"\xff"]  # two keys: requests meet often
TTLS = st.sampled_from([None, None, 0.5, 1.0, 2.5])
TIMEOUTS = st.sampled_from([math.inf, 0.5, 1.0, 2.0])
LIMITS = st.integers(min_value=1, max_value=3)
#: Clock offsets of a successor: each process has its own clock. Times here are
#: multiples of 1/4, so every sum and difference is exact.
OFFSETS = st.sampled_from([0.0, 16.0, -8.0, 1024.25])
MAX_SESSIONS = 2  # detached sessions kept: low, so the limit is reached
FREE_EVERY = 1  # holds freed per slice: low, so ending sessions queue up

keys = st.sampled_from(KEYS)
picks = st.integers(min_value=0, max_value=1_000)


def model_service() -> Service:
    return new_service(max_holds=3, max_waiters=2, max_sessions=MAX_SESSIONS, free_slice=FREE_EVERY)


@dataclass
class Side:
    """One of the two services in lockstep: its clock reads the model's plus
    ``offset``; connections and their waiting requests by session id."""

    service: Service
    offset: float
    conns: dict[str, Connection] = field(default_factory=dict)
    pending: dict[str, Outcome] = field(default_factory=dict)

    @property
    def engine(self) -> MemoryBackend:
        return engine_of(self.service)

    def session(self, session_id: str) -> Session:
        return self.conns[session_id].session

    def wait(self, session_id: str, waiter: Waiter, verb: str) -> None:
        """The request now waits for its reply, as a parked connection would."""
        later = self.engine.later_for(waiter)
        peer = self.conns[session_id].peer
        finish = COMMANDS[verb.encode()].wait_reply
        assert finish is not None
        self.pending[session_id] = Outcome(later, finish, WORD, peer)


def normal(result: Any) -> Any:
    """A result as both sides can compare it: objects by what they are."""
    if isinstance(result, Waiter):
        return ("waiter", result.serial, result.state, result.taken, result.missing, result.count)
    if isinstance(result, Session):
        return ("session", result.id)
    return result


def view(side: Side) -> dict[str, Any]:
    """Everything observable of one side, with times on the model's clock."""
    engine, offset = side.engine, side.offset

    def at(when: float | None) -> float | None:
        return None if when is None else when - offset

    def hold(h: Hold) -> tuple[Any, ...]:
        return (h.session.id, h.key, h.token, at(h.granted_at), at(h.lease_deadline))

    def waiter(w: Waiter) -> tuple[Any, ...]:
        assert w.state == WAITING, "a waiter that is done still queues"
        when = (at(w.since), at(w.deadline))
        return (w.serial, w.session.id, w.keys, w.shared, w.limit, w.ttl, *when, w.taken, w.missing)

    timings = side.service.timings
    return {
        "exclusive": [(k, hold(h)) for k, h in engine.exclusive.items()],
        "shared": [(k, [hold(h) for h in engine.shared_holds(k)]) for k in engine.shared],
        "exclusive queues": [(k, [waiter(w) for w in q]) for k, q in engine._xqueues.items()],
        "shared queues": [(k, [waiter(w) for w in q]) for k, q in engine._squeues.items()],
        "sessions": [
            (
                s.id,
                s.peer,
                s.name,
                s.grace,
                s.connected,
                s.ending,
                at(s.grace_deadline),
                s.leases,
                list(s.exclusive),  # its order is the order its holds are freed in
                sorted(s.shared),  # see commuting_shared_leases
                sorted((waiter(w) for w in s.waiters), key=lambda row: row[0]),
            )
            for s in engine.sessions.values()
        ],
        "ending": [(s.id, why) for s, why in engine._ending],
        "deadlines": firing_order(engine, offset),
        "engine": (
            engine.waiting,
            engine.leases,
            engine.shared_holders,
            engine.detached,
            engine.sessions_in_grace,
            engine._next_token,
            engine._free_budget,
        ),
        "counters": {k: v for k, v in side.service.snapshot().items() if k != "handovers"},
        "timings": [(b.counts, b.sum) for b in [*timings.wait, *timings.hold]],
        "connections": list(side.conns),
        "waiting requests": sorted(side.pending),
    }


def firing_order(engine: MemoryBackend, offset: float) -> list[tuple[float, Any]]:
    """The deadlines that will fire, in the order :meth:`advance` runs them
    (equal deadlines in the order they were set): stale heap entries left out."""
    heap = engine._deadlines
    order: list[tuple[float, Any]] = []
    seen: set[int] = set()
    for deadline, _, target in sorted(heap._heap, key=lambda entry: entry[:2]):
        if id(target) in seen or not heap.is_current(deadline, target):
            continue
        seen.add(id(target))
        if isinstance(target, Hold):
            what: Any = ("lease", target.session.id, target.key, target.shared)
        elif isinstance(target, Waiter):
            what = ("wait", target.serial)
        else:
            what = ("grace", target.id)
        order.append((deadline - offset, what))
    return commuting_shared_leases(order)


def commuting_shared_leases(order: list[tuple[float, Any]]) -> list[tuple[float, Any]]:
    """``order`` with each run of shared leases that end together sorted by key
    (each key's own order kept).

    The state keeps the order of every table, but not the order of a session's own
    shared holds (the order it took them in), and nothing shows it: freeing them all
    (``unlock_all``, a disconnect) serves each key's shared queue in that order, and
    waiters granted with a ttl get leases in that order, one block of leases per key.
    What a shared lease does when it ends touches its own key only, so such blocks
    commute; the order of leases on one key, and of everything else, must match."""
    canonical: list[tuple[float, Any]] = []
    run: list[tuple[float, Any]] = []
    for entry in [*order, (math.nan, None)]:
        shared_lease = entry[1] is not None and entry[1][0] == "lease" and entry[1][3]
        if shared_lease and (not run or run[0][0] == entry[0]):
            run.append(entry)
            continue
        canonical += sorted(run, key=lambda lease: lease[1][2])
        run = [entry] if shared_lease else []
        if not shared_lease and entry[1] is not None:
            canonical.append(entry)
    return canonical


class LockstepModel(RuleBasedStateMachine):
    """Side ``a`` is never handed over; side ``b`` is, at random points."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.a = Side(model_service(), 0.0)
        self.b = Side(model_service(), 0.0)
        self.handovers = 0
        self.opened = 0
        for _ in range(4):
            self.connect()

    # ------------------------------------------------------------- helpers

    def both(self, operation: Callable[[Side, float], Any]) -> Any:
        """Run ``operation`` on each side at its own time; both must answer alike."""
        results = []
        for side in (self.a, self.b):
            try:
                results.append(normal(operation(side, self.now + side.offset)))
            except (TooManyHolds, QueueFull) as error:
                results.append(("refused", type(error).__name__))
        assert results[0] == results[1], f"copy: {results[1]!r}, original: {results[0]!r}"
        return results[0]

    def idle(self, pick: int) -> str | None:
        """A connection with no request in flight: only those send requests."""
        ready = [sid for sid in self.a.conns if sid not in self.a.pending]
        return ready[pick % len(ready)] if ready else None

    def open(self) -> str:
        session_id = f"s{self.opened}"
        peer = b"10.0.0.%d:%d" % (self.opened % 3, 4000 + self.opened)
        self.opened += 1
        for side in (self.a, self.b):
            session = side.engine.open_session(session_id, peer)
            side.conns[session_id] = Connection(side.service, peer, session)
        return session_id

    # --------------------------------------------------------------- rules

    @rule()
    def connect(self) -> None:
        if len(self.a.conns) < 6:
            self.open()

    @rule(pick=picks, grace=st.sampled_from([0.0, 1.0, 3.0]))
    def set_timeout(self, pick: int, grace: float) -> None:
        sid = self.idle(pick)
        if sid is not None:
            for side in (self.a, self.b):
                side.session(sid).grace = grace

    @rule(pick=picks, name=st.sampled_from([None, b"job", b"\xe9t\xe9"]))
    def iam(self, pick: int, name: bytes | None) -> None:
        sid = self.idle(pick)
        if sid is not None:
            self.both(lambda side, now: side.engine.rename(side.session(sid), name))

    @rule(pick=picks, key=keys, ttl=TTLS)
    def try_lock(self, pick: int, key: bytes, ttl: float | None) -> None:
        sid = self.idle(pick)
        if sid is not None:
            self.both(lambda side, now: side.engine.acquire(side.session(sid), key, now, ttl))

    @rule(pick=picks, key=keys, ttl=TTLS, timeout=TIMEOUTS)
    def wait_lock(self, pick: int, key: bytes, ttl: float | None, timeout: float) -> None:
        sid = self.idle(pick)
        if sid is None:
            return

        def wait(side: Side, now: float) -> Waiter | None:
            waiter = side.engine.wait_for(side.session(sid), key, now, ttl, timeout)
            if waiter is not None:
                side.wait(sid, waiter, "lock")
            return waiter

        self.both(wait)

    @rule(pick=picks, key=keys)
    def unlock(self, pick: int, key: bytes) -> None:
        sid = self.idle(pick)
        if sid is not None:
            self.both(lambda side, now: side.engine.release(side.session(sid), key, now))

    @rule(pick=picks, key=keys, limit=st.none() | LIMITS, ttl=TTLS)
    def try_shared(self, pick: int, key: bytes, limit: int | None, ttl: float | None) -> None:
        sid = self.idle(pick)
        if sid is not None:
            self.both(
                lambda side, now: side.engine.acquire_shared(
                    side.session(sid), key, now, limit=limit, ttl=ttl
                )
            )

    @rule(pick=picks, key=keys, limit=LIMITS, ttl=TTLS, timeout=TIMEOUTS)
    def wait_shared(
        self, pick: int, key: bytes, limit: int, ttl: float | None, timeout: float
    ) -> None:
        sid = self.idle(pick)
        if sid is None:
            return

        def wait(side: Side, now: float) -> Waiter | int:
            result = side.engine.wait_shared(
                side.session(sid), key, now, limit=limit, ttl=ttl, timeout=timeout
            )
            if isinstance(result, Waiter):
                side.wait(sid, result, "lock_shared")
            return result

        self.both(wait)

    @rule(pick=picks, key=keys)
    def unlock_shared(self, pick: int, key: bytes) -> None:
        sid = self.idle(pick)
        if sid is not None:
            self.both(lambda side, now: side.engine.release_shared(side.session(sid), key, now))

    @rule(
        pick=picks,
        wanted=st.lists(keys, min_size=1, max_size=3),
        wait=st.booleans(),
        ttl=TTLS,
        timeout=TIMEOUTS,
    )
    def mlock(
        self, pick: int, wanted: list[bytes], wait: bool, ttl: float | None, timeout: float
    ) -> None:
        sid = self.idle(pick)
        if sid is None:
            return

        def request(side: Side, now: float) -> Any:
            result = side.engine.request_many(
                side.session(sid), wanted, now, ttl=ttl, wait=wait, timeout=timeout
            )
            if isinstance(result, Waiter):
                side.wait(sid, result, "mlock")
            return result

        self.both(request)

    @rule(pick=picks, key=keys, ttl=st.sampled_from([0.5, 1.0, 2.5]))
    def renew(self, pick: int, key: bytes, ttl: float) -> None:
        sid = self.idle(pick)
        if sid is not None:
            self.both(lambda side, now: side.engine.renew(side.session(sid), key, now, ttl))

    @rule(pick=picks)
    def unlock_all(self, pick: int) -> None:
        sid = self.idle(pick)
        if sid is not None:
            self.both(lambda side, now: side.engine.release_all(side.session(sid), now))

    @rule(pick=picks)
    def give_up(self, pick: int) -> None:
        """A waiting request is cancelled (its reply then says what blocked it)."""
        waiting = sorted(self.a.pending)
        if not waiting:
            return
        sid = waiting[pick % len(waiting)]

        def cancel(side: Side, now: float) -> Any:
            later = side.pending[sid].later
            assert isinstance(later, Wait)
            return side.engine.cancel(later.waiter, now)

        self.both(cancel)

    @rule()
    def answer_done(self) -> None:
        """Waiting requests that are done answer, alike on both sides."""
        for sid in sorted(self.a.pending):
            replies = [reply(side.pending[sid]) for side in (self.a, self.b)]
            assert replies[0] == replies[1], f"{sid}: copy {replies[1]!r}, original {replies[0]!r}"
            if replies[0] is not None:
                del self.a.pending[sid], self.b.pending[sid]

    @rule(pick=picks)
    def disconnect(self, pick: int) -> None:
        if not self.a.conns:
            return
        sid = sorted(self.a.conns)[pick % len(self.a.conns)]
        for side in (self.a, self.b):
            side.conns.pop(sid).close(self.now + side.offset)
            side.pending.pop(sid, None)

    @rule(pick=picks)
    def conn_id(self, pick: int) -> None:
        """A new connection takes a disconnected session over (or is refused)."""
        gone = sorted(s.id for s in self.a.engine.sessions.values() if not s.connected)
        if not gone or len(self.a.conns) >= 7:
            return
        target = gone[pick % len(gone)]
        fresh = self.open()

        def take_over(side: Side, now: float) -> Session | None:
            conn = side.conns[fresh]
            session = side.engine.take_over(target, conn.session)
            if session is not None:
                conn.adopt(session)
                side.conns[target] = side.conns.pop(fresh)
            return session

        self.both(take_over)

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.0]), budget=st.sampled_from([None, 1, 2]))
    def advance(self, dt: float, budget: int | None) -> None:
        # advance() also says whether more is due, reading stale heap entries the
        # copy never had: what it did is compared (the invariant), not that.
        self.now += dt
        for side in (self.a, self.b):
            side.engine.advance(self.now + side.offset, budget)

    @precondition(lambda self: self.b.engine._free_budget == self.b.engine.free_slice)
    @rule(offset=OFFSETS, stuck=st.none() | picks)
    def hand_over(self, offset: float, stuck: int | None) -> None:
        """Replace side b by a copy made through the hand-over's records; the
        ``stuck`` connection's socket cannot move (TLS), so the successor
        disconnects its session, and side a closes it at that moment.

        Only between two slices of frees: the successor starts a slice of its own,
        so a hold freed inline in the old slice would be a difference in when a
        queued session is freed, not in what happens.

        The copy's deadline heap holds the live deadlines only, in the order they
        run. The original's heap still has stale entries, and one comes back to
        life when its lease is renewed to that very instant again, with its old
        place in line; the heap drops them whenever it compacts itself, so that
        place is no promise of the engine's. Side a is compacted here, as it might
        be at any time, so the two are compared on what the engine does promise."""
        self.a.engine._deadlines.compact()
        old = self.b
        ids = list(old.conns)
        states = [
            ConnectionState(parked(old.conns[sid], old.pending.get(sid)), fd)
            for fd, sid in enumerate(ids)
        ]
        if stuck is not None and ids:
            gone = ids.pop(stuck % len(ids))
            states[stuck % len(states)].fd = None
            self.a.conns.pop(gone).close(self.now + self.a.offset)
            self.a.pending.pop(gone, None)
        new = Side(model_service(), offset)
        with patch.object(records, "BATCH", 2):  # several records of each kind
            _, served = restore(
                old.service, self.now + old.offset, states, new.service, self.now + offset
            )
        for place in served:
            conn = place.conn
            assert conn is not None
            new.conns[conn.session.id] = conn
            if place.backlog.pending is not None:
                new.pending[conn.session.id] = place.backlog.pending
        assert list(new.conns) == ids
        self.b = new
        self.handovers += 1

    # ----------------------------------------------------------- invariants

    @invariant()
    def both_sides_alike(self) -> None:
        assert view(self.a) == view(self.b)
        assert self.a.service.counters.handovers == 0
        assert self.b.service.counters.handovers == self.handovers


LockstepModel.TestCase.settings = settings(
    max_examples=400, stateful_step_count=40, deadline=None, print_blob=True
)
TestLockstep = LockstepModel.TestCase


async def test_a_node_with_a_lease_per_session_is_refused_by_a_successor() -> None:
    """A cluster node from before one lease per node names no node lease in its
    state: the successor refuses it (the old node then serves on) rather than
    adopt sessions whose keys hang on leases nobody would keep alive."""

    client = EtcdClient(["http://127.0.0.1:9"])
    space = ClusterLockSpace(client, b"/p/")
    restorer = Restorer(Service(Config(), space, COMMANDS), 0.0)
    old_node = {
        "t": "node",
        "node_id": "ab12",
        "heartbeat_lease": 7,
        "prefix": records.text(b"/p/"),
    }
    with pytest.raises(StateError, match="keeps an etcd lease per session"):
        restorer.feed(old_node)
    assert space.node.adopted_sessions_lease == 0 and space.node_id != "ab12"
    await client.aclose()


def hand_over_cluster(
    old: ClusterLockSpace, new: ClusterLockSpace, *, old_now: float, new_now: float
) -> None:
    """Dump a cluster node's books (no connections) and feed them to a successor's,
    through JSON as on the control socket."""
    dumped = list(dump_state(Service(Config(), old, COMMANDS), [], now=old_now))
    restorer = Restorer(Service(Config(), new, COMMANDS), new_now)
    for record in dumped:
        restorer.feed(json.loads(json.dumps(record)))


async def test_sessions_taken_over_elsewhere_stay_left_to_that_node_after_a_handover() -> None:
    """A session another node took over by ``conn_id`` leaves its entries on this
    node's lease until that node moves them, and this node's sweep leaves that tag
    alone for a session TTL. A successor must go on leaving it alone for the time
    left, on its own clock, and forget tags whose time is up."""
    client = EtcdClient(["http://127.0.0.1:9"])
    old, new = ClusterLockSpace(client, b"/p/"), ClusterLockSpace(client, b"/p/")
    old.ledger.moved_tags = {5: 100.0 + 7.5, 6: 100.0 - 1.0}
    hand_over_cluster(old, new, old_now=100.0, new_now=1000.0)
    assert new.ledger.moved_tags == {5: 1000.0 + 7.5}
    await client.aclose()


async def test_a_cluster_nodes_count_of_etcd_not_answering_moves() -> None:
    """``backend_unavailable`` (q and /metrics) moves like every other counter."""
    client = EtcdClient(["http://127.0.0.1:9"])
    old, new = ClusterLockSpace(client, b"/p/"), ClusterLockSpace(client, b"/p/")
    old.calls.backend_unavailable = 3
    hand_over_cluster(old, new, old_now=0.0, new_now=0.0)
    assert new.backend_unavailable == 3
    await client.aclose()


@pytest.mark.parametrize(
    ("prefix", "session_ttl", "refusal"),
    [(b"/q/", 5, "--etcd-prefix /p/ there, /q/ here"), (b"/p/", 30, "--session-ttl 5 there")],
)
async def test_a_successor_with_another_prefix_or_session_ttl_is_refused(
    prefix: bytes, session_ttl: int, refusal: str
) -> None:
    """Another prefix is another lock space; another session TTL would keep the
    adopted leases alive too seldom (or needlessly often): refused, before the
    successor takes on the old node's identity."""
    client = EtcdClient(["http://127.0.0.1:9"])
    old = ClusterLockSpace(client, b"/p/")
    new = ClusterLockSpace(client, prefix, session_ttl=session_ttl)
    with pytest.raises(StateError, match=refusal):
        hand_over_cluster(old, new, old_now=0.0, new_now=0.0)
    assert new.node_id != old.node_id
    await client.aclose()


def test_a_successor_keeps_the_lease_deadline_of_its_predecessor() -> None:
    """The node's lease deadline travels as time left: a successor that has not
    joined yet (etcd down) confirms nothing past it either."""
    client = EtcdClient(["http://127.0.0.1:9"])
    old, new = ClusterLockSpace(client, b"/p/"), ClusterLockSpace(client, b"/p/")
    old.lease.set(42, 100.0 + 3.25)
    hand_over_cluster(old, new, old_now=100.0, new_now=500.0)
    assert new.lease.deadline == pytest.approx(503.25)
    assert new.node.adopted_sessions_lease == 42
