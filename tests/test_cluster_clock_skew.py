"""A cluster throttle with one node's wall clock off (docs/cluster.md, "The clock"),
as a black box: node A on the real clock, node B under libfaketime with its
``time.time()`` δ seconds off and its monotonic clock untouched.

The key is seeded with its burst through the node whose clock is behind, then
clients on both nodes hammer it with try-once requests for RUN_SECONDS. The node
ahead judges the TATs the node behind wrote δ seconds older than they are, so the
seed hands it units on top of what one server would admit: the worst case of the
skew, and the same whichever node is the one off (B behind or B ahead). With two
nodes the extra is at most min(δ·COUNT/PERIOD, B): the node ahead can carry on
from the TAT of the node behind without a gap only while that TAT is ahead of
real time. Every run must stay within ``B + W·rate + min(|δ|·rate, B) + 1`` (W
the client's window, from the first request to the last 200, which holds the
nodes'); with δ = 0 the same run stays within ``B + W·rate + 1``, and with the
skew it passes that, so the skew is real and the bound is the one that holds.

Real time: the nodes and etcd are separate processes; these run alone (serial).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import trio

from tests.support.cluster_nodes import Nodes
from tests.support.line_client import LineClient
from tests.support.skewed_clock import skewed_env

#: Needs a real etcd cluster: `pytest -m "not cluster"` leaves this module out.
pytestmark = pytest.mark.cluster

#: Per second.
COUNT = 20
#: A whole second's burst, so all of δ·COUNT/PERIOD = 10 units is within reach;
#: a quarter second's, where two nodes' extra is capped by the burst (docs/cluster.md).
WIDE, NARROW = 20, 5
#: How long the clients hammer the key after the seed.
RUN_SECONDS = 4.0
#: Each hammering node's clients.
CLIENTS_PER_NODE = 3
#: B's skew, seconds: 10 units at 20/s.
SKEW = 0.5

FIELD = re.compile(rb"(\w+)=(\d+)")

#: Run in a child under the skewed clock: its wall and monotonic readings,
#: taken around a trio sleep.
PROBE = """
import time, trio
async def main():
    wall, mono = time.time(), time.monotonic()
    await trio.sleep(0.3)
    print(wall, mono, time.time() - wall, time.monotonic() - mono)
trio.run(main)
"""


def fields(reply: bytes) -> dict[bytes, int]:
    return {name: int(value) for name, value in FIELD.findall(reply)}


@pytest.mark.parametrize("offset", [-SKEW, SKEW])
def test_libfaketime_offsets_the_wall_clock_only(offset: float) -> None:
    """The premise: under skewed_env, time.time() reads ``offset`` off, keeps
    running, and time.monotonic() is this machine's (trio's clock untouched)."""
    wall_before, mono_before = time.time(), time.monotonic()
    probe = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=skewed_env(offset),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    wall_after, mono_after = time.time(), time.monotonic()
    wall, mono, wall_step, mono_step = map(float, probe.stdout.split())
    assert wall_before + offset <= wall <= wall_after + offset, probe.stdout
    assert mono_before <= mono <= mono_after, probe.stdout
    # Both run, at the same pace (libfaketime's cache never freezes the offset): a
    # frozen wall clock would step 0, not 0.3 s; 50 ms covers a preemption between
    # the two readings while the suite's other worker runs.
    assert mono_step >= 0.29, probe.stdout
    assert abs(wall_step - mono_step) <= 0.05, probe.stdout


async def skewed_run(
    nodes: Nodes, offset: float, burst: int
) -> tuple[int, float, tuple[float, float]]:
    """Node B ``offset`` s off; the burst through the node behind; both hammered.
    Returns (admitted, the client's window W, the seconds until the seed's TAT runs
    out as the node behind and the node ahead judge, peeked back to back)."""
    request = b"throttle skew %d 1 burst=%d" % (COUNT, burst)
    a = nodes.start()
    b = nodes.start(env=skewed_env(offset)) if offset else nodes.start()
    behind, ahead = (b, a) if offset < 0 else (a, b)
    seeder, peeker = await behind.connect(), await ahead.connect()
    hammers = [await node.connect() for node in (a, b) for _ in range(CLIENTS_PER_NODE)]
    assert (await seeder.request(b"ping")) == b"200 PONG"

    admitted = 0
    start = trio.current_time()  # before the first admission
    for _ in range(burst):
        reply = await seeder.request(request)
        assert reply.startswith(b"200 "), reply
        admitted += 1
    # Back to back, a few ms apart: each node's reset is the TAT less its clock.
    behind_reset = fields(await seeder.request(request + b" cost=0"))[b"reset"]
    ahead_reset = fields(await peeker.request(request + b" cost=0"))[b"reset"]
    stop = trio.current_time() + RUN_SECONDS
    last = start  # when the last 200 came back: after every admission

    async def hammer(client: LineClient) -> None:
        nonlocal admitted, last
        while trio.current_time() < stop:
            reply = await client.request(request)
            if reply.startswith(b"200 "):
                admitted += 1
                last = trio.current_time()
            else:
                assert reply.startswith(b"409 "), reply
                await trio.sleep(min(fields(reply)[b"retry"] / 1000, 0.2))

    async with trio.open_nursery() as nursery:
        for client in hammers:
            nursery.start_soon(hammer, client)
    return admitted, last - start, (behind_reset / 1000, ahead_reset / 1000)


@pytest.mark.serial  # a rate over wall time, on real processes: run alone
@pytest.mark.parametrize(
    ("offset", "burst"),
    [(-SKEW, WIDE), (SKEW, WIDE), (-SKEW, NARROW)],
    ids=["behind", "ahead", "behind-narrow-burst"],
)
async def test_skewed_node_admits_at_most_skew_times_rate_more(
    nodes: Nodes, offset: float, burst: int
) -> None:
    """B behind or ahead by |δ|: the node ahead sees the seed's TAT |δ| sooner out,
    and the run admits more than ``B + W·rate + 1`` (whichever way B is off), but
    never more than ``B + W·rate + min(|δ|·rate, B) + 1``."""
    admitted, window, (behind_reset, ahead_reset) = await skewed_run(nodes, offset, burst)
    one_server = burst + window * COUNT
    extra = min(abs(offset) * COUNT, burst)
    bound = one_server + extra + 1
    print(
        f"δ={offset:+.1f} s, burst {burst}: admitted {admitted} in W={window:.2f} s; "
        f"one server {one_server:.1f}, bound {bound:.1f} (extra {extra:g}); "
        f"resets peeked: {behind_reset:.3f} s behind, {ahead_reset:.3f} s ahead"
    )
    # The node ahead sees the seed's TAT |δ| sooner out (not before now: 0).
    assert abs(ahead_reset - max(0.0, behind_reset - abs(offset))) <= 0.05
    assert admitted <= bound
    if extra >= 10:
        # The skew really bought units: measured 8-10 over, a margin a loaded box
        # keeps. With the narrow burst (5 extra, measured 3.5-4.5 over) the peeks
        # above are the proof that the skew is real: a count that close could be
        # eaten by a slow client.
        assert admitted > one_server + 1


@pytest.mark.serial  # a rate over wall time, on real processes: run alone
async def test_same_run_without_skew_admits_what_one_server_would(nodes: Nodes) -> None:
    """The control: the same run with both clocks real stays within ``B + W·rate + 1``
    (so the extra of the skewed runs is the skew's), and both nodes' peeks see the
    seed's TAT run out at the same time."""
    admitted, window, (a_reset, b_reset) = await skewed_run(nodes, 0.0, WIDE)
    bound = WIDE + window * COUNT + 1
    print(
        f"δ=0, burst {WIDE}: admitted {admitted} in W={window:.2f} s; bound {bound:.1f}; "
        f"resets peeked: {a_reset:.3f} s on A, {b_reset:.3f} s on B"
    )
    assert abs(a_reset - b_reset) <= 0.05
    assert admitted <= bound
