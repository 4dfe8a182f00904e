"""A node whose link to etcd is slow, for real: etcd's answers reach node A 1.5 s
late (a proxy in A's network namespace holds every byte etcd sends; the kernel here
has no netem), at ``--session-ttl 5`` and the default ``--etcd-timeout 3``.

The delay is shorter than both of the node's deadlines, so it must cost nothing:
A's client keeps its lock, ``token K`` answers ``200`` throughout, and a new
``lock`` through A is granted. The scripted version, on a MockClock, is
tests/test_etcd_slow_link.py.
"""

from __future__ import annotations

import time
import uuid

import pytest
import trio

from tests.support.partition_clients import GONE, Line
from tests.support.partition_lab import lab, why_no_lab

# Seconds of real delay judged against the node's deadlines: run alone. etcd is real.
pytestmark = [
    pytest.mark.serial,
    pytest.mark.cluster,
    pytest.mark.skipif((why := why_no_lab()) is not None, reason=f"no partition lab: {why}"),
]

DELAY = 1.5
TTL = 5
HOLD = 15.0


def test_a_node_keeps_its_clients_locks_while_etcd_answers_late() -> None:
    prefix = f"/slow-{uuid.uuid4().hex[:10]}/"
    with lab() as made:
        node = made.start_node(
            "a", "--etcd-prefix", prefix, "--session-ttl", str(TTL), via_proxy=True
        )
        proxy = made.proxy
        assert proxy is not None
        replies: list[str] = []
        granted: list[tuple[str, float]] = []

        async def client() -> None:
            line = Line(await trio.open_tcp_stream(node.host, node.port))
            assert await line.request("lock K 30") == "200 Acquired"
            token = await line.request("token K")
            assert token.startswith("200 ")
            proxy.one_way, proxy.delay = True, DELAY
            until = time.monotonic() + HOLD
            while time.monotonic() < until:
                try:
                    replies.append(await line.request("token K"))
                except GONE:
                    replies.append(f"closed after {HOLD - until + time.monotonic():.1f} s")
                    return
                await trio.sleep(0.1)
            other = Line(await trio.open_tcp_stream(node.host, node.port))
            sent = time.monotonic()
            granted.append((await other.request("lock K2 30"), time.monotonic() - sent))
            replies.append(await line.request("token K"))
            assert replies[-1] == token

        try:
            made.from_clients(lambda: trio.run(client))
        finally:
            log = "".join(node.log)
            made.heal()
            made.stop_nodes()
    lost = [line for line in log.splitlines() if "lost" in line or "unavailable" in line]
    print(f"token K polls: {len(replies)}; lock K2: {granted}")
    assert set(replies) == {replies[0]} and replies[0].startswith("200 "), replies[-5:]
    assert len(replies) > HOLD / 0.5, len(replies)
    assert granted and granted[0][0] == "200 Acquired", granted
    assert lost == [], lost
