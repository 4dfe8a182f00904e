"""What one round of a cluster node's stray sweep costs its thread, without etcd.

Every node's copy (:class:`~elockd.backend.cluster.mirror.QueueMirror`) holds every
entry of the cluster; one node's own sessions hold a tenth of them. Timed in the
same process: the look at every session the node has entries of, as shipped (the
sessions on its lease, :meth:`~elockd.backend.cluster.mirror.QueueMirror.tags_on`,
of which a round takes a budget), and a walk of every session of the cluster (as
before).

    .venv/bin/python bench/cluster_sweep.py                  # 100,000 and 1,000,000 entries
    .venv/bin/python bench/cluster_sweep.py --entries 200000
"""

from __future__ import annotations

import argparse
import time

from elockd.backend.cluster.etcd.client import Event, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, Layout, entry_value
from elockd.backend.cluster.mirror import QueueMirror
from elockd.backend.cluster.node import SWEEP_BUDGET

LAYOUT = Layout(b"/bench/")
OURS, THEIRS = 7, 8
PER_SESSION = 100


def filled(entries: int) -> QueueMirror:
    """``entries`` held entries, 100 a session; every tenth session is this node's."""
    mirror = QueueMirror(LAYOUT)
    events: list[Event] = []
    for n in range(entries):
        tag = 1 + n // PER_SESSION
        lease = OURS if tag % 10 == 0 else THEIRS
        key = LAYOUT.entry(EXCLUSIVE, b"k%d" % n, tag)
        events.append(Event("PUT", KeyValue(key, entry_value(1, None, b"o"), n + 1, n + 1, lease)))
        if len(events) == 10_000:
            mirror.apply(events)
            events = []
    mirror.apply(events)
    return mirror


def every_session(mirror: QueueMirror) -> int:
    return sum(len(mirror.entries_on(tag, OURS)) for tag in list(mirror.by_tag))


def a_round(mirror: QueueMirror) -> int:
    looked, budget = 0, SWEEP_BUDGET
    for tag in mirror.tags_on(OURS):
        found = len(mirror.entries_on(tag, OURS))
        looked += found
        budget -= found + 1
        if budget <= 0:
            break
    return looked


def timed(look: object, mirror: QueueMirror) -> tuple[float, int]:
    start = time.perf_counter()
    looked = look(mirror)  # type: ignore[operator]
    return time.perf_counter() - start, looked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, action="append", help="entries in the copy")
    args = parser.parse_args()
    for entries in args.entries or [100_000, 1_000_000]:
        mirror = filled(entries)
        before, _ = timed(every_session, mirror)
        after, looked = timed(a_round, mirror)
        print(
            f"{entries:>9,} entries ({entries // 10:,} this node's): every session "
            f"{before * 1e3:8.1f} ms a round, a round now {after * 1e3:6.1f} ms "
            f"({looked:,} entries looked at)"
        )


if __name__ == "__main__":
    main()
