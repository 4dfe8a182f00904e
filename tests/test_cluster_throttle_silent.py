"""A throttle line whose head's node falls silent (docs/cluster.md, "Throttles on a
cluster"): the head is passed over ``--throttle-line-grace`` after its turn came
(1 s by default), and the waiters behind it are admitted at the rate from then on,
long before etcd lapses the silent node's lease; the head, when its node comes
back, is not admitted on the place it lost.

Real time: etcd and the nodes are separate processes. The node is silenced with
SIGSTOP (its etcd lease is still renewed by nobody, but lapses only after
``--session-ttl``, 10 s here: well after everything this test looks at).
"""

from __future__ import annotations

import pytest
import trio

from tests.support.cluster_nodes import Nodes
from tests.support.polling import eventually, stats_showing

pytestmark = pytest.mark.cluster

#: Long, so that the silent node's lease outlives the test's window.
TTL = "10"
#: One unit every 2 s, burst 1.
REQUEST = b"throttle q 1 2 burst=1"
#: The grace by default.
GRACE = 1.0


@pytest.mark.serial  # bounds of a few hundred ms on real processes: run alone
async def test_a_silent_head_is_passed_over_after_the_grace(nodes: Nodes) -> None:
    a, b = nodes.start("--session-ttl", TTL), nodes.start("--session-ttl", TTL)
    first, head = await a.connect(), await a.connect()
    behind, next_behind, observer = await b.connect(), await b.connect(), await b.connect()
    start = trio.current_time()
    assert (await first.request(REQUEST)).startswith(b"200 ")
    # The head's turn comes 2 s after the first admission: its node is stopped
    # before, so it never takes it.
    await head.send(REQUEST + b" wait=30\n")
    await eventually(lambda: stats_showing(observer, waiting=1))
    a.stop()
    try:
        assert trio.current_time() - start < 1.5, "the head's node stopped too late"
        await behind.send(REQUEST + b" wait=30\n")
        await eventually(lambda: stats_showing(observer, waiting=2))
        await next_behind.send(REQUEST + b" wait=30\n")
        with trio.fail_after(8):
            reply = await behind.line()
            passed = trio.current_time() - start
            next_reply = await next_behind.line()
            after = trio.current_time() - start
        print(f"behind admitted {passed:.3f} s after the first, the next {after:.3f} s")
        assert reply.startswith(b"200 "), reply
        assert next_reply.startswith(b"200 "), next_reply
        # Not before the head's turn (2 s) and the grace; well before etcd lapses
        # the silent node's lease (10 s, at the earliest ~6.7 s after the stop).
        assert 2 + GRACE <= passed <= 2 + GRACE + 0.8, passed
        # From then on at the rate: one unit every 2 s.
        assert 1.95 <= after - passed <= 2.3, (passed, after)
    finally:
        a.cont()
    # The passed-over head, back, finds its place gone: not admitted on it (the
    # rate allows nobody until 2 s after the last admission anyway).
    with trio.fail_after(5):
        back = await head.line()
    assert back.startswith(b"409 "), back
    # A wait whose place was passed over ends as one that ran out, and counts so.
    await eventually(lambda: stats_showing(first, timeouts=1))
