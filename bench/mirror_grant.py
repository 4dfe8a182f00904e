"""A cluster node's mirror, per grant, to a session that already holds K locks.

Each grant is the ``mirror.apply`` of a release that hands a queue to that session:
what every node does for every grant it sees. ``.venv/bin/python bench/mirror_grant.py``
(docs/performance.md, "A grant to a session that holds many").
"""

from __future__ import annotations

import time

from elockd.backend.cluster.etcd.client import Event, KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, Layout, entry_value
from elockd.backend.cluster.mirror import QueueMirror

L = Layout(b"/t/")


def put(key: bytes, tag: int, rev: int) -> Event:
    value = entry_value(1, None, b"o")
    return Event("PUT", KeyValue(L.entry(EXCLUSIVE, key, tag), value, rev, rev, 77))


def delete(key: bytes, tag: int, rev: int) -> Event:
    return Event("DELETE", KeyValue(L.entry(EXCLUSIVE, key, tag), b"", 0, rev, 0))


def main() -> None:
    for held in (1000, 10000):
        mirror = QueueMirror(L)
        mirror.apply([put(b"h%d" % i, 7, 10 + i) for i in range(held)])
        revision, grants = 100_000, 2000
        for i in range(grants):  # tag 7 queued behind tag 8 on fresh keys
            mirror.apply([put(b"g%d" % i, 8, revision), put(b"g%d" % i, 7, revision + 1)])
            revision += 2
        started = time.perf_counter()
        for i in range(grants):
            mirror.apply([delete(b"g%d" % i, 8, revision)])
            revision += 1
        each = (time.perf_counter() - started) / grants * 1e6
        print(f"a session holding {held}..{held + grants}: {each:.1f} µs a grant")


if __name__ == "__main__":
    main()
