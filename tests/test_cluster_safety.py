"""The safety checker (tests/support/safety.py) against two cluster nodes at once.

Worker processes open their sessions on either node at random, so the clients of
one lock key sit on different nodes and only etcd can keep them apart; workers are
SIGKILLed at random as in the single-server run. A killed worker's plain holds are
freed as soon as its node sees the TCP close, and its ``ttl=`` leases by the owner
node's timer, so the recorded-interval rules of the checker hold unchanged. At the
end every node must report an empty lock space and grant every key.

The same run again with five hand-overs of one of the two nodes (docs/upgrade.md):
the successor node takes the connections, the node's identity and its sessions'
leases over while the clients go on, on both nodes.

``CLUSTER_STRESS_SECONDS`` sets the length of the runs (default 6 s; 8 s at least
for the run with hand-overs), ``STRESS_SEED`` their seed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.cluster_nodes import Nodes
from tests.support.safety import ServerChain, run

#: Needs a real etcd cluster: `pytest -m "not cluster"` leaves this module out.
pytestmark = pytest.mark.cluster


def test_no_violation_across_two_nodes_under_random_kills(nodes: Nodes, tmp_path: Path) -> None:
    seconds = float(os.environ.get("CLUSTER_STRESS_SECONDS", "6"))
    a, b = nodes.start(), nodes.start()
    report = run([a.port, b.port], seconds, tmp_path, seed=int(os.environ.get("STRESS_SEED", "1")))
    print(report.summary())
    assert report.violations == []
    for node in (a, b):
        assert node.process.poll() is None, f"the node on port {node.port} died during the run"
    # The run must have exercised what it claims to check.
    assert report.kills >= 1
    assert all(report.grants.get(via, 0) > 0 for via in ("g", "lock", "mlock", "lock_shared"))
    assert report.max_shared.get("s3", 0) >= 2


def test_no_violation_and_nothing_noticed_across_five_handovers_of_a_node(
    nodes: Nodes, tmp_path: Path
) -> None:
    seconds = max(8.0, float(os.environ.get("CLUSTER_STRESS_SECONDS", "8")))
    seed = int(os.environ.get("STRESS_SEED", "1"))
    other = nodes.start()
    records = tmp_path / "records"
    records.mkdir()
    with ServerChain(tmp_path, *nodes.flags()) as chain:
        report = run(
            [chain.port, other.port], seconds, records, seed=seed, handovers=5, chain=chain
        )
        print(f"seed {seed}: {report.summary()}")
        assert report.violations == []
        assert report.handovers == 5
        assert [process.returncode for process in chain.processes[:5]] == [0] * 5
        assert chain.current.poll() is None and other.process.poll() is None
    assert report.carried_sessions > 0
    assert report.kills >= 1
    assert all(report.grants.get(via, 0) > 0 for via in ("g", "lock", "mlock", "lock_shared"))
