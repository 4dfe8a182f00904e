"""The hand-over carries the throttle table (docs/upgrade.md): every key's TAT and
every waiter in its key's line, with its rate, its place, its time left and, for
a line's head, its turn.

In-process first, as tests/test_handover_state.py does it: the old service serves
on as after a failed hand-over, its successor reads a clock of its own, and both
are asked the same requests and must answer alike. Then against real processes:
a throttled run through a hand-over keeps its rate, and a request that was waiting
in line before it is admitted by the successor, in its turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import pytest
import trio

from elockd.backend import memory_state
from elockd.backend import state as records
from elockd.backend.memory import ThrottleWait
from elockd.engine.throttles import ThrottleWaiter
from elockd.handover.state import ConnectionState
from elockd.protocol.connection import Connection, Outcome, Service
from tests.support.line_client import LineClient
from tests.support.polling import eventually
from tests.support.sansio import whole
from tests.support.server_process import stop_server
from tests.test_handover import ask, old_server, take_over, wait_exit
from tests.test_handover import connect as tcp_connect
from tests.test_handover_state import (
    HIGH_KEY,
    connect,
    engine_of,
    hand_over,
    new_service,
    over_json,
    parked,
    restore,
)

#: ``throttle api 10 60``, asked the eleventh time at once: the issue's example.
ELEVENTH = b"409 limit=10 remaining=0 retry=6000 reset=60000\r\n"


def answer(outcome: Outcome) -> bytes | None:
    """The reply of a throttle request that waited, or None while it still waits."""
    later = outcome.later
    assert isinstance(later, ThrottleWait)
    return None if later.waiter.waiting else whole(outcome)


def waits(conn: Connection, line: bytes, now: float) -> Outcome:
    """Ask ``line``, a throttle request that must wait in line: its reply-later."""
    outcome = conn.handle(line, now)
    assert isinstance(outcome, Outcome) and answer(outcome) is None, outcome
    return outcome


def line_of(service: Service, key: bytes) -> list[ThrottleWaiter]:
    return list(engine_of(service).throttles.lines.get(key, ()))


def full_burst(conn: Connection, now: float) -> None:
    """``throttle api 10 60`` ten times at ``now``: its whole burst."""
    for n in range(10):
        assert whole(conn.handle(b"throttle api 10 60", now)) == (
            b"200 limit=10 remaining=%d reset=%d\r\n" % (9 - n, 6000 * (n + 1))
        )


# ---------------------------------------------------------------------- TATs


def test_a_key_at_full_burst_stays_limited_after_the_handover() -> None:
    old = new_service()
    conn = connect(old, 1)
    full_burst(conn, 0.0)
    assert whole(conn.handle(b"throttle api 10 60", 0.0)) == ELEVENTH
    both = hand_over(old, 0.0, [conn], offset=1024.25)

    assert both.ask(conn, b"throttle api 10 60", 0.0) == ELEVENTH
    assert both.ask(conn, b"throttle api 10 60 cost=0", 0.0) == (  # a peek
        b"200 limit=10 remaining=0 reset=60000\r\n"
    )
    assert both.ask(conn, b"throttle api 10 60", 5.75) == (
        b"409 limit=10 remaining=0 retry=250 reset=54250\r\n"
    )
    assert both.ask(conn, b"throttle api 10 60", 6.0) == (
        b"200 limit=10 remaining=0 reset=60000\r\n"
    )
    assert both.ask(conn, b"throttle api 10 60", 6.0) == ELEVENTH
    old_counters, new_counters = both.snapshots()
    assert old_counters["throttles"] == new_counters["throttles"] == 1
    assert old_counters["admitted"] == new_counters["admitted"] == 11
    assert old_counters["throttled"] == new_counters["throttled"] == 4


def test_a_lapsed_key_is_left_behind_and_the_rest_keep_their_time_left() -> None:
    """A key whose TAT has passed is the same as no key: it does not move. One
    still ahead keeps its time left on the successor's clock."""
    old = new_service()
    conn = connect(old, 1)
    assert whole(conn.handle(b"throttle gone 10 1", 0.0)).startswith(b"200 ")  # TAT 0.1
    assert whole(conn.handle(b"throttle kept 1 4", 0.0)).startswith(b"200 ")  # TAT 4
    both = hand_over(old, 1.0, [conn], offset=-0.5)  # the old one has not swept yet
    assert engine_of(both.old).throttles.tats.keys() == {b"gone", b"kept"}
    assert engine_of(both.new).throttles.tats == {b"kept": 3.5}
    assert [entry[1] for entry in engine_of(both.new).throttles._lapses] == [b"kept"]
    both.advance(1.0)
    assert both.snapshots()[0]["throttles"] == both.snapshots()[1]["throttles"] == 1
    assert both.ask(conn, b"throttle kept 1 4", 3.75) == (
        b"409 limit=1 remaining=0 retry=250 reset=250\r\n"
    )
    both.advance(5.0)  # kept lapsed on both, and was dropped at the grain after
    assert both.snapshots()[0]["throttles"] == both.snapshots()[1]["throttles"] == 0


# --------------------------------------------------------------------- lines


def costly_line(old: Service) -> tuple[Connection, list[Connection], dict[Connection, Outcome]]:
    """A key at 1 per second with a burst of 5, spent at t=0, and three waiters of
    costs 5, 1 and 1 queued in that order: turns at 5, 6 and 7 (the cheap ones
    would fit at once, but never overtake)."""
    spender = connect(old, 1)
    assert whole(spender.handle(b"throttle k 10 10 burst=5 cost=5", 0.0)) == (
        b"200 limit=5 remaining=0 reset=5000\r\n"
    )
    waiters = [connect(old, port) for port in (2, 3, 4)]
    pending = {
        conn: waits(conn, b"throttle k 10 10 burst=5 cost=%d wait=30" % cost, when)
        for conn, cost, when in zip(waiters, (5, 1, 1), (0.0, 0.25, 0.5), strict=True)
    }
    return spender, waiters, pending


def test_waiters_of_costs_5_1_1_are_admitted_in_that_order_after_the_handover() -> None:
    old = new_service()
    spender, waiters, pending = costly_line(old)
    both = hand_over(old, 1.0, [spender, *waiters], pending=pending, offset=1024.25)

    # One that does not wait is refused with its turn behind the whole line.
    assert both.ask(spender, b"throttle k 10 10 burst=5", 1.0) == (
        b"409 limit=5 remaining=0 retry=7000 reset=4000\r\n"
    )
    both.advance(4.75)
    assert [answer(both.pending(w)) for w in waiters] == [None, None, None]
    for now, first in ((5.0, 0), (6.0, 1), (7.0, 2)):
        both.advance(now - 0.25)
        assert answer(both.pending(waiters[first])) is None
        both.advance(now)
        for outcome in (pending[waiters[first]], both.pending(waiters[first])):
            assert answer(outcome) == b"200 limit=5 remaining=0 reset=5000\r\n"
        assert [answer(both.pending(w)) for w in waiters[first + 1 :]] == [None] * (2 - first)
    old_counters, new_counters = both.snapshots()
    assert old_counters["waiting"] == new_counters["waiting"] == 0
    old_waits, new_waits = (s.timings.wait[2] for s in (both.old, both.new))
    assert (new_waits.counts, new_waits.sum) == (old_waits.counts, old_waits.sum)
    assert old_waits.sum == 5.0 + 5.75 + 6.5


def test_a_waiter_keeps_its_rate_place_wait_and_turn_on_another_clock() -> None:
    old = new_service()
    spender, waiters, pending = costly_line(old)
    offset = -3.5
    both = hand_over(old, 1.0, [spender, *waiters], pending=pending, offset=offset)
    before, after = line_of(both.old, b"k"), line_of(both.new, b"k")
    assert [w.session.id for w in after] == [w.session.id for w in before]
    for was, now in zip(before, after, strict=True):
        assert (now.key, now.rate, now.state) == (was.key, was.rate, was.state)
        assert now.since - offset == was.since
        assert now.deadline - offset == was.deadline
        assert now.admit - offset == was.admit  # inf but for the head
    assert [w.admit for w in after[1:]] == [float("inf")] * 2
    throttles = engine_of(both.new).throttles
    assert throttles.waiting == 3
    assert {s.id: len(w) for s, w in throttles.by_session.items()} == {
        w.session.id: 1 for w in waiters
    }


def test_a_disconnect_after_the_handover_cancels_the_restored_wait() -> None:
    """The successor knows each session's waits: the head's client goes away, its
    wait ends (409, nothing else changes) and the next in line fits at once."""
    old = new_service()
    spender, waiters, pending = costly_line(old)
    both = hand_over(old, 1.0, [spender, *waiters], pending=pending)
    head = waiters[0]
    head.close(2.0)
    both.pairs[head].close(2.0 + both.offset)
    for outcome in (pending[head], both.pending(head)):
        # Never sent (its client is gone): its own turn, not walked behind the line.
        assert answer(outcome) == b"409 limit=5 remaining=0 retry=3000 reset=3000\r\n"
    # The two cheap ones fit at once now (the key had room for 5 at t=2).
    for conn, expected in (
        (waiters[1], b"remaining=1 reset=4000"),
        (waiters[2], b"remaining=0 reset=5000"),
    ):
        for outcome in (pending[conn], both.pending(conn)):
            assert answer(outcome) == b"200 limit=5 " + expected + b"\r\n"
    for service in (both.old, both.new):
        throttles = engine_of(service).throttles
        assert (throttles.by_session, throttles.lines, throttles.waiting) == ({}, {}, 0)


def test_a_connection_whose_socket_cannot_move_leaves_the_line() -> None:
    """A TLS connection closes at the hand-over: its wait is cancelled there."""
    old = new_service()
    spender, waiters, pending = costly_line(old)
    states = [
        ConnectionState(parked(spender), 0),
        ConnectionState(parked(waiters[0], pending[waiters[0]]), None),
        *(ConnectionState(parked(w, pending[w]), n) for n, w in enumerate(waiters[1:], 1)),
    ]
    new = new_service()
    restore(old, 1.0, states, new, 1.0)
    assert [w.session.id for w in line_of(new, b"k")] == [waiters[2].session.id]
    assert engine_of(new).throttles.waiting == 1


# ------------------------------------------------------- turns during the pause


def test_a_turn_that_came_during_the_pause_admits_the_waiter() -> None:
    """The old timer stops at the pause: a head whose turn, and whose wait, ran out
    meanwhile is admitted by the successor (its turn came first), as the old one
    would have on its next tick; it does not time out."""
    old = new_service()
    spender, waiter = connect(old, 1), connect(old, 2)
    full_burst(spender, 0.0)
    pending = waits(waiter, b"throttle api 10 60 wait=6", 0.0)  # retry 6: its turn at 6
    both = hand_over(old, 7.0, [spender, waiter], pending={waiter: pending}, offset=100.125)
    both.advance(7.0)
    for outcome in (pending, both.pending(waiter)):
        assert answer(outcome) == b"200 limit=10 remaining=0 reset=59000\r\n"
    assert both.snapshots()[0]["timeouts"] == both.snapshots()[1]["timeouts"] == 0


def test_a_request_admitted_before_the_pause_but_not_yet_answered_is_answered() -> None:
    old = new_service()
    spender, waiter = connect(old, 1), connect(old, 2)
    full_burst(spender, 0.0)
    pending = waits(waiter, b"throttle api 10 60 wait=10", 0.0)
    engine_of(old).advance(6.0)  # admitted; its connection parks before it replies
    both = hand_over(old, 6.5, [spender, waiter], pending={waiter: pending})
    for outcome in (pending, both.pending(waiter)):
        assert answer(outcome) == b"200 limit=10 remaining=0 reset=60000\r\n"
    assert both.ask(spender, b"throttle api 10 60", 6.5) == (
        b"409 limit=10 remaining=0 retry=5500 reset=59500\r\n"
    )


# -------------------------------------------------------------------- format


def test_every_throttle_record_moves_in_batches_with_bytes_above_ascii() -> None:
    old = new_service()
    conns = [connect(old, port) for port in range(5)]
    keys = [HIGH_KEY + b"%d" % n for n in range(7)]
    for key in keys:
        assert whole(conns[0].handle(b"throttle " + key + b" 1 60", 0.0)).startswith(b"200 ")
    pending = {c: waits(c, b"throttle " + keys[0] + b" 1 60 wait=600", 0.0) for c in conns}
    with patch.object(records, "BATCH", 2), patch.object(memory_state, "HOLDS_BATCH", 3):
        both = hand_over(old, 1.0, conns, pending=pending)
    kinds = [r["t"] for r in both.records]
    assert kinds.count("throttle_keys") == 3 and kinds.count("throttle_waiters") == 3
    assert list(engine_of(both.new).throttles.tats) == keys
    assert [w.session.id for w in line_of(both.new, keys[0])] == [c.session.id for c in conns]
    both.advance(60.0)
    assert [answer(both.pending(c)) is not None for c in conns] == [
        True,
        False,
        False,
        False,
        False,
    ]


def test_a_state_without_throttles_has_no_throttle_records_and_restores() -> None:
    """A predecessor from before throttles wrote no throttle records and no
    ``admitted``/``throttled`` counters: its state restores as it did."""
    old = new_service()
    holder = connect(old, 1)
    assert whole(holder.handle(b"g k", 0.0)) == b"1 Got Lock\r\n"
    state = over_json(memory_state.MemoryDump(engine_of(old), 0.0, []).records())
    assert not [r for r in state if r["t"].startswith("throttle")]
    del state[0]["admitted"], state[0]["throttled"]
    new = new_service()
    restorer = new.backend.restore(0.0)
    for record in state:
        restorer.feed(record)
    restorer.finish([])
    assert restorer.counts() == (1, 1)
    engine = engine_of(new)
    assert (engine.admitted, engine.throttled, len(engine.throttles)) == (0, 0, 0)
    back = Connection(new, holder.peer, restorer.sessions[0])
    assert whole(back.handle(b"throttle t 1 1", 0.0)) == b"200 limit=1 remaining=0 reset=1000\r\n"
    assert whole(back.handle(b"i k", 0.0)) == b"1 Locked\r\n"


# ------------------------------------------------------------ real processes


@dataclass
class ThrottledRun:
    """Clients asking ``line`` (a throttle without wait) in a loop, each sleeping
    the ``retry`` of a 409 before it asks again, as a polite client does: when
    each 200 came, and any reply that was neither."""

    line: bytes
    admitted: list[float] = field(default_factory=list)
    errors: list[bytes] = field(default_factory=list)
    stop: trio.Event = field(default_factory=trio.Event)

    async def client(self, client: LineClient) -> None:
        while not self.stop.is_set():
            reply = await ask(client, self.line)
            refused = re.fullmatch(rb"409 limit=\d+ remaining=0 retry=(\d+) reset=\d+\r\n", reply)
            if reply.startswith(b"200 "):
                self.admitted.append(trio.current_time())
            elif refused is not None:
                await trio.sleep(int(refused[1]) / 1000)
            else:
                self.errors.append(reply)


async def waiting_shows(client: LineClient, count: int) -> bool:
    return (await client.stats())["waiting"] == count


#: The run's rate: 20 per second, bursts of 10 (a lost TAT would admit 10 more at
#: once, well past the bound).
RATE, BURST = 20, 10


@pytest.mark.serial
async def test_a_handover_in_the_middle_of_a_throttled_run_keeps_the_rate(tmp_path: Path) -> None:
    """Issue 27: four clients on one key at 20/s with bursts of 10 through a
    hand-over admit at most ``10 + 20 * elapsed`` in all (no burst when the
    successor starts), and a request queued before it (``wait=5``) is admitted by
    the successor in its turn, 4.5 s after the one before it."""
    control = tmp_path / "control.sock"
    with old_server(control) as (old, port):
        spender, waiter = await tcp_connect(port), await tcp_connect(port)
        before_spent = trio.current_time()
        assert await ask(spender, b"throttle slow 1 4.5 burst=1") == (
            b"200 limit=1 remaining=0 reset=4500\r\n"
        )
        spent = trio.current_time()
        await waiter.send(b"throttle slow 1 4.5 burst=1 wait=5\n")
        await eventually(lambda: waiting_shows(spender, 1), what="the waiter in line")
        run = ThrottledRun(b"throttle k %d 1 burst=%d" % (RATE, BURST))
        clients = [await tcp_connect(port) for _ in range(4)]
        async with trio.open_nursery() as nursery:
            started = trio.current_time()
            for client in clients:
                nursery.start_soon(run.client, client)
            await trio.sleep(0.5)
            new = await trio.to_thread.run_sync(lambda: take_over(control))
            try:
                assert await wait_exit(old, 10) == 0
                handed_over = trio.current_time()
                with trio.fail_after(8):
                    turn = await waiter.line()
                answered = trio.current_time()
                await trio.sleep(max(0.5, started + 3.0 - trio.current_time()))
                run.stop.set()
            except BaseException:
                stop_server(new)
                raise
        ended = trio.current_time()
        try:
            elapsed = ended - started
            after = sum(1 for when in run.admitted if when > handed_over)
            print(
                f"hand-over done {handed_over - started:.2f} s into a {elapsed:.2f} s run: "
                f"{len(run.admitted)} admitted ({after} after it), bound "
                f"{BURST + RATE * elapsed:.1f}; the waiter answered "
                f"{answered - spent:.3f} s after the one before it"
            )
            assert run.errors == []
            assert len(run.admitted) <= BURST + RATE * elapsed + 1, "a burst on the successor"
            assert len(run.admitted) >= 0.7 * RATE * elapsed, "the rate stalled"
            assert after >= 0.7 * RATE * (ended - handed_over), "the successor stalled"
            # The waiter: admitted by the successor, in its turn.
            assert turn == b"200 limit=1 remaining=0 reset=4500\r\n"
            assert handed_over < answered, f"the hand-over took {handed_over - started:.2f} s"
            assert answered - before_spent >= 4.5 - 0.005, answered - before_spent
            assert answered - spent < 4.5 + 0.3, answered - spent
            assert (await spender.stats())["handovers"] == 1
        finally:
            stop_server(new)
