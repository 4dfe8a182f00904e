"""``ls`` on a cluster node at a million locks (issue 28's "Done when", docs/performance.md,
"``ls`` on a cluster at scale"): a measurement, not a test.

A node answers ``ls`` from its mirror of etcd (elockd/backend/cluster/operators.py),
so what is measured is the mirror at scale, on two nodes of a real 3-member etcd:

* ``ls jobs/`` (10 keys among N) on node A (which holds those 10) and on node B (whose
  mirror only): median and p99 over ``--requests`` requests;
* node A's RSS before and during a full ``ls`` to a reader with a 64 KiB receive
  buffer that does not read (as tests/test_ls_scale.py does in memory), a ``ping`` on
  another connection meanwhile, then the reader reads everything (rows counted);
* how long the locks took, each node's RSS per lock, etcd's db size.

How the locks are made. Through node A, ``--through-node`` locks (the 10 ``jobs/``
keys among them) are taken by ``--connections`` connections, each pipelining ``g``:
the node's own path (group commit), whose rate is reported. The rest are written
straight into etcd as queue entries (tests/support/ls_scale.py: the layout of
elockd/backend/cluster/layout.py, values from its ``entry_value``, a session tag
each), 1,000 puts a txn, bound to one lease of ``--seed-ttl``: at the node's rate
(600-900 grants/s measured here, with other work on the box) a million would take
20 to 30 minutes, and the mirror of either node cannot tell the two apart (it lists
entries, whoever wrote them); only node A's own books (its sessions' holds) are
smaller than if it had granted all of them. Both nodes watch while the entries are
written, so each applies every one of them as watch events.

Measurements are taken at each of ``--locks`` (ascending; the locks of one stage are
kept for the next). etcd runs with ``--quota-backend-bytes`` 8 GiB and
``--max-txn-ops`` 1,024; the nodes with ``--session-ttl 10`` and ``--max-holds``
raised to ``--through-node`` (one connection may take them all). Everything is
stopped by pid at the end (a SIGTERM too) and the temporary directory removed.

    .venv/bin/python bench/cluster_ls_scale.py --locks 200000 500000 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.etcd_cluster import EtcdCluster, member_status
from tests.support.hostile_tools import rss_bytes
from tests.support.ls_scale import (
    MATCHING,
    Seeder,
    caught_up,
    listed_jobs,
    take_marker,
    timed_ls,
    unread_full_ls,
)
from tests.support.server_process import start_server, stop_server

PREFIX = "/bench-ls/"
MB = 1 << 20
SEED_TXN = 1000
ETCD_FLAGS = ["--quota-backend-bytes", str(8 << 30), "--max-txn-ops", "1024"]


def pipeline(port: int, keys: list[bytes], held: list[socket.socket]) -> None:
    """``g`` every key on one new connection, all sent at once, every reply checked."""
    sock = socket.create_connection(("127.0.0.1", port))
    lines = b"".join(b"g %s\n" % key for key in keys)
    sender = threading.Thread(target=sock.sendall, args=(lines,))
    sender.start()
    data = bytearray()
    while data.count(b"\r\n") < len(keys):
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("node closed a taking connection")
        data += chunk
    sender.join()
    replies = data.split(b"\r\n")[: len(keys)]
    bad = [r for r in replies if r != b"1 Got Lock"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(keys)} not granted, e.g. {bad[0]!r}")
    held.append(sock)


def take_through_node(port: int, count: int, connections: int) -> list[socket.socket]:
    """``count`` locks (the ``jobs/`` ones first) over ``connections`` connections."""
    keys = [b"jobs/%d" % n for n in range(MATCHING)]
    keys += [b"bulk/%07d" % n for n in range(count - MATCHING)]
    held: list[socket.socket] = []
    threads = [
        threading.Thread(target=pipeline, args=(port, keys[i::connections], held))
        for i in range(connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(held) != connections:
        raise RuntimeError("a taking connection failed (see above)")
    return held


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def unread_line(pid: int, port: int, expected: int) -> str:
    """Node A's figures for a full ``ls`` to a reader that does not read."""
    unread = unread_full_ls(pid, port)
    ok = unread.rows == expected and unread.names_sorted and unread.pong == b"200 PONG\r\n"
    return (
        f"unread full ls: RSS {unread.before / MB:.1f} -> peak {unread.peak / MB:.1f} MiB "
        f"(+{(unread.peak - unread.before) / 1024:.0f} KiB); ping meanwhile "
        f"{unread.ping * 1000:.1f} ms; then read {unread.rows:,} rows in byte order "
        f"(expected {expected:,}: {'ok' if ok else 'MISMATCH'}) in {unread.read_seconds:.1f} s"
    )


def db_size(cluster: EtcdCluster) -> str:
    sizes = []
    for member in cluster.members.values():
        status = member_status(member.url, timeout=5)
        sizes.append(int(status["dbSize"]) / MB if status else float("nan"))
    return " / ".join(f"{size:.0f}" for size in sizes) + " MiB"


def stage(
    nodes: dict[str, tuple[int, int]], locks: int, listed: int, requests: int, cluster: Any
) -> None:
    """The figures at one stage; ``listed``: the rows a full ``ls`` has (markers too)."""
    print(f"\n== {locks:,} locks (and the markers) ==", flush=True)
    for name, (pid, port) in nodes.items():
        times, reply = timed_ls(port, b"ls jobs/\n", requests)
        good = listed_jobs(reply)
        print(
            f"node {name}: ls jobs/ over {requests} requests: median "
            f"{statistics.median(times) * 1000:.2f} ms, p99 {percentile(times, 0.99) * 1000:.2f}"
            f" ms, max {max(times) * 1000:.2f} ms ({'the 10 rows' if good else 'WRONG ROWS'}); "
            f"RSS {rss_bytes(pid) / MB:.0f} MiB",
            flush=True,
        )
    pid, port = nodes["A"]
    print("node A: " + unread_line(pid, port, listed), flush=True)
    print(f"etcd db size (n1 / n2 / n3): {db_size(cluster)}", flush=True)


def print_warnings(name: str, log: list[str]) -> None:
    """The node's warnings and errors, last ones, when the run ends."""
    if any("Traceback" in line for line in log):
        print(f"node {name} failed; its log ends:")
        print("".join(log[-40:]), end="")
        return
    bad = [line for line in log if "WARNING" in line or "ERROR" in line]
    if bad:
        print(f"node {name} logged {len(bad)} warnings or errors; the last:")
        print("".join(bad[-10:]), end="")


def load() -> str:
    """The box's 1/5/15-minute load average: other work on it shows in every figure."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--locks", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--through-node", type=int, default=20_000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed-ttl", type=int, default=7200)
    args = parser.parse_args()
    # A SIGTERM (a timeout) unwinds like Ctrl-C, so every etcd member and node is
    # stopped by pid and the directory removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stages = sorted(args.locks)
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="elockd-ls-scale-")))
        cluster = EtcdCluster(base, 3)
        cluster.extra_flags = ETCD_FLAGS
        stack.callback(cluster.close)
        cluster.start()
        flags = ["--etcd", ",".join(cluster.endpoints), "--etcd-prefix", PREFIX,
                 "--session-ttl", "10",
                 "--max-holds", str(args.through_node)]  # fmt: skip
        nodes: dict[str, tuple[int, int]] = {}
        logs: dict[str, list[str]] = {}
        for name in ("A", "B"):
            logs[name] = []
            process, port = start_server(*flags, log=logs[name])
            stack.callback(stop_server, process)
            stack.callback(print_warnings, name, logs[name])
            nodes[name] = (process.pid, port)
        empty = {name: rss_bytes(pid) for name, (pid, _) in nodes.items()}
        print(f"etcd 3 members {' '.join(ETCD_FLAGS)}; nodes A, B: {' '.join(flags[4:])}")
        print(f"load average at the start: {load()} ({os.cpu_count()} cores)")
        print(f"empty nodes' RSS: A {empty['A'] / MB:.0f} MiB, B {empty['B'] / MB:.0f} MiB",
              flush=True)  # fmt: skip
        port_a, port_b = nodes["A"][1], nodes["B"][1]
        started = time.monotonic()
        held = take_through_node(port_a, args.through_node, args.connections)
        stack.callback(lambda: [sock.close() for sock in held])
        took = time.monotonic() - started
        print(f"through node A: {args.through_node:,} locks over {args.connections} pipelining "
              f"connections in {took:.1f} s ({args.through_node / took:,.0f} grants/s)",
              flush=True)  # fmt: skip
        seeder = Seeder(cluster.endpoints[0], PREFIX, args.seed_ttl, per_txn=SEED_TXN)
        seeded = 0
        markers: list[socket.socket] = []
        stack.callback(lambda: [sock.close() for sock in markers])
        for number, locks in enumerate(stages):
            target = locks - args.through_node
            started = time.monotonic()
            seeder.write(seeded, target)
            wrote = time.monotonic() - started
            print(f"\nwrote {target - seeded:,} entries straight into etcd in {wrote:.1f} s "
                  f"({(target - seeded) / wrote:,.0f}/s)", flush=True)  # fmt: skip
            seeded = target
            for name, port in (("A", port_a), ("B", port_b)):
                started = time.monotonic()
                markers.append(take_marker(port, b"marker/%d/%s" % (number, name.encode())))
                waited = caught_up(port) + time.monotonic() - started
                print(f"node {name}: mirror caught up {waited:.1f} s after the "
                      f"entries; RSS {(rss_bytes(nodes[name][0]) - empty[name]) / locks:.0f} "
                      f"bytes/lock over empty", flush=True)  # fmt: skip
            stage(nodes, locks, locks + 2 * (number + 1), args.requests, cluster)
            print(f"load average: {load()}", flush=True)


if __name__ == "__main__":
    main()
