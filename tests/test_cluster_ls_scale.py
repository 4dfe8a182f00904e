"""``ls`` on cluster nodes holding 50,000 locks (docs/protocol.md: ``ls``; issue 28's
bound is a million, measured by bench/cluster_ls_scale.py): a prefix costs the keys
under it on every node's mirror, and a full listing streams to a reader that does
not read without growing the node. Wall-clock and RSS bounds: run alone."""

from __future__ import annotations

import socket
import statistics
from collections.abc import Iterator

import pytest

from tests.support.cluster_nodes import Node, Nodes
from tests.support.ls_scale import (
    Seeder,
    caught_up,
    listed_jobs,
    take_jobs,
    take_marker,
    timed_ls,
    unread_full_ls,
)

pytestmark = [pytest.mark.serial, pytest.mark.cluster]

LOCKS = 50_000
MB = 1 << 20


@pytest.fixture
def seeded(nodes: Nodes) -> Iterator[tuple[Node, Node]]:
    """Two nodes; ``jobs/0..9`` held through the first, LOCKS - 10 more locks written
    into etcd, and both mirrors caught up with them."""
    first, second = nodes.start(), nodes.start()
    held: list[socket.socket] = []
    try:
        held.append(take_jobs(first.port))
        Seeder(nodes.etcd.endpoints[0], nodes.prefix, ttl=600).write(0, LOCKS - 10)
        for number, node in enumerate((first, second)):
            held.append(take_marker(node.port, b"marker/%d" % number))
            caught_up(node.port, timeout=60)
        yield first, second
    finally:
        for sock in held:
            sock.close()


def test_ls_of_a_prefix_and_an_unread_full_ls_at_50000_cluster_locks(
    seeded: tuple[Node, Node],
) -> None:
    for node in seeded:
        times, reply = timed_ls(node.port, b"ls jobs/\n", 50)
        assert listed_jobs(reply), reply
        median, most = statistics.median(times) * 1000, max(times) * 1000
        print(f"\nls jobs/ among {LOCKS:,} cluster locks, node {node.port}: median "
              f"{median:.2f} ms, max {most:.2f} ms")  # fmt: skip
        assert statistics.median(times) < 0.010, times
    first = seeded[0]
    unread = unread_full_ls(first.process.pid, first.port, watch=2.0)
    growth = unread.peak - unread.before
    ping, read = unread.ping * 1000, unread.read_seconds
    print(f"unread ls of {LOCKS:,} cluster locks: node RSS +{growth / 1024:.0f} KiB; a ping "
          f"meanwhile {ping:.1f} ms; then read in {read:.1f} s")  # fmt: skip
    assert unread.pong == b"200 PONG\r\n"
    assert unread.rows == LOCKS + 2  # and the two markers
    assert unread.names_sorted
    assert growth < 4 * MB, growth
