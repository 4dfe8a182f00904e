"""A throttle key under a real network partition (tests/support/partition_lab.py
builds the lab): node A cut from etcd for 5 s while clients of both nodes wait in
the key's line (docs/cluster.md, "Throttles on a cluster").

A's line entries stay in etcd until etcd lapses A's lease (``--session-ttl 5``),
and A cannot take their turns; they are passed over ``--throttle-line-grace`` (1 s)
after their turn came, so B keeps admitting at the rate from then on. Checked: the
longest stretch without an admission during the cut is about the grace, B admits
most of what the rate allows after it, and every window keeps the GCRA bound
(``B + W·COUNT/PERIOD``, 3 units of slack for replies that reach the clients late).
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Iterator
from itertools import pairwise

import pytest
import trio

from tests.support.partition_clients import GONE, Line
from tests.support.partition_lab import Lab, LabNode, lab, why_no_lab

# A cut lasts seconds and is judged on one clock: run alone. And etcd is real.
pytestmark = [
    pytest.mark.serial,
    pytest.mark.cluster,
    pytest.mark.skipif((why := why_no_lab()) is not None, reason=f"no partition lab: {why}"),
]

TTL = 5
COUNT = 20  # per second, burst 20
REQUEST = "throttle api 20 1 wait=2"
CLIENTS_PER_NODE = 4
BEFORE, CUT, AFTER = 3.0, 5.0, 2.0
GRACE = 1.0  # --throttle-line-grace, by default


@pytest.fixture(scope="module")
def partition_lab() -> Iterator[Lab]:
    with lab() as made:
        yield made


def run(made: Lab) -> tuple[list[float], float, float]:
    """Both nodes, the clients, the cut: (admission times, cut at, healed at), on the
    clients' monotonic clock."""
    flags = ("--etcd-prefix", f"/throttle-cut-{uuid.uuid4().hex[:10]}/", "--session-ttl", str(TTL))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = [pool.submit(made.start_node, role, *flags) for role in ("a", "b")]
        nodes = dict(zip(("a", "b"), (future.result() for future in started), strict=True))
    admitted: list[float] = []
    times: dict[str, float] = {}

    async def client(node: LabNode, stop: float) -> None:
        line: Line | None = None
        while time.monotonic() < stop:
            try:
                if line is None:
                    with trio.fail_after(3):
                        line = Line(await trio.open_tcp_stream(node.host, node.port))
                reply = await line.request(REQUEST)
            except (*GONE, trio.TooSlowError):
                line = None
                await trio.sleep(0.1)
                continue
            if reply.startswith("200 "):
                admitted.append(time.monotonic())
            elif not reply.startswith("409 "):  # A, its lease lost: Backend Unavailable
                await trio.sleep(0.1)

    async def main() -> None:
        stop = time.monotonic() + BEFORE + CUT + AFTER
        async with trio.open_nursery() as nursery:
            for node in nodes.values():
                for _ in range(CLIENTS_PER_NODE):
                    nursery.start_soon(client, node, stop)
            await trio.sleep(BEFORE)
            await trio.to_thread.run_sync(made.cut_node_from_etcd, "a", "loss")
            times["cut"] = time.monotonic()
            await trio.sleep(CUT)
            await trio.to_thread.run_sync(made.heal)
            times["healed"] = time.monotonic()

    try:
        made.from_clients(lambda: trio.run(main))
    finally:
        made.heal()
        made.stop_nodes()
    return sorted(admitted), times["cut"], times["healed"]


def test_a_node_cut_from_etcd_holds_up_no_throttle_line(partition_lab: Lab) -> None:
    admitted, cut, healed = run(partition_lab)
    during = [at for at in admitted if cut <= at <= healed]
    edges = [cut, *during, healed]
    gaps = [later - earlier for earlier, later in pairwise(edges)]
    settled = [at for at in during if at >= cut + GRACE + 0.5]
    allowed = COUNT * (healed - cut - GRACE - 0.5)
    print(
        f"{len(admitted)} admitted in {admitted[-1] - admitted[0]:.2f} s; during the "
        f"{healed - cut:.2f} s cut {len(during)}, the longest gap {max(gaps):.2f} s; "
        f"{len(settled)} of {allowed:.0f} the rate allowed after the grace"
    )
    assert max(gaps) <= GRACE + 0.6, "the line was held up longer than the grace"
    assert len(settled) >= 0.8 * allowed
    # The rate, in every window of a second or more, and over the whole run.
    for i, first in enumerate(admitted):
        for j in range(len(admitted) - 1, i, -1):
            window = admitted[j] - first
            if window < 1.0:
                break
            assert j - i + 1 <= COUNT + COUNT * window + 3, (i, j, window)
