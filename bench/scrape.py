"""The scrape rows of ``make bench`` (``--only scrape``): what /metrics costs the
event loop that lock clients share.

* Render cost at 1,000,000 locks, in this process, on both backends: an in-memory
  engine holding a million locks, and a cluster node whose queue mirror holds a
  million entries (loaded from synthetic watch data, no etcd needed). Both read
  counts kept on the way, so the cost must not grow with the locks.
* Event-loop time per scrape of a real server holding a million locks: its CPU time
  over a few hundred scrapes on one keep-alive connection, rendered every time
  (``--metrics-cache 0``) and cached (the default, 1 s).
* Lock throughput (the C generator's pair workload) with no scraper, with 8
  scrapers at one scrape a second each, and with 8 scrapers in a tight loop, in
  alternating runs, as ratios to the run without scrapers.
"""

from __future__ import annotations

import contextlib
import http.client
import multiprocessing
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest

from elockd.backend.cluster.etcd.client import KeyValue
from elockd.backend.cluster.layout import EXCLUSIVE, SHARED, entry_value
from elockd.backend.cluster.space import ClusterLockSpace
from elockd.backend.memory import MemoryBackend
from elockd.net.metrics import make_registry
from elockd.protocol.commands import COMMANDS
from elockd.protocol.config import Config
from elockd.protocol.connection import Service

LOCKS = 1_000_000


def render_ms(service: Service, repeat: int = 20) -> float:
    """Median time of one full render of the registry, in ms."""
    registry = make_registry(service)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        generate_latest(registry)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def memory_service(locks: int) -> Service:
    engine = MemoryBackend(max_holds=locks)
    sessions = [engine.open_session(f"s{i}", b"10.0.0.1:%d" % i) for i in range(100)]
    for index in range(locks):
        session = sessions[index % 100]
        if index % 2:
            engine.acquire_shared(session, b"k%d" % index, 0.0)
        else:
            engine.acquire(session, b"k%d" % index, 0.0)
    return Service(Config(), engine, COMMANDS)


def cluster_service(locks: int) -> Service:
    """A node's service whose mirror holds ``locks`` entries (half in queues of two,
    so some wait), as its watch would have loaded them."""
    space = ClusterLockSpace(None, b"/bench/")  # type: ignore[arg-type]
    layout = space.layout
    kvs = []
    for index in range(locks):
        kind = SHARED if index % 2 else EXCLUSIVE
        key = b"k%d" % (index // 2 if index % 4 < 2 else index)
        lease = index + 1
        kvs.append(
            KeyValue(layout.entry(kind, key, lease), entry_value(0, None, b"o"), index + 2, 0, 0)
        )
    space.mirror.load(locks + 2, kvs)
    return Service(Config(), space, COMMANDS)


def render_rows(locks: int = LOCKS) -> dict[str, float]:
    small_memory, small_cluster = memory_service(1000), cluster_service(1000)
    return {
        "memory_small": render_ms(small_memory),
        "memory_big": render_ms(memory_service(locks)),
        "cluster_small": render_ms(small_cluster),
        "cluster_big": render_ms(cluster_service(locks)),
    }


def scrape_cpu_ms(pid: int, metrics_port: int, cpu_seconds: Callable[[int], float]) -> float:
    """Server CPU per scrape over 300 scrapes on one keep-alive connection, in ms."""
    connection = http.client.HTTPConnection("127.0.0.1", metrics_port, timeout=30)
    scrapes = 300
    time.sleep(1.1)  # past any cached rendering
    before = cpu_seconds(pid)
    for _ in range(scrapes):
        connection.request("GET", "/metrics")
        connection.getresponse().read()
    spent = cpu_seconds(pid) - before
    connection.close()
    return spent / scrapes * 1000


def hold_locks(port: int, locks: int) -> list[socket.socket]:
    """``locks`` exclusive locks over 10 connections, kept while the list lives."""
    sockets = []
    per = locks // 10
    for c in range(10):
        sock = socket.create_connection(("127.0.0.1", port))
        payload = b"".join(b"g c%d-%d\n" % (c, i) for i in range(per))
        sock.sendall(payload)
        expected = len(b"1 Got Lock\r\n") * per
        received = 0
        while received < expected:
            received += len(sock.recv(1 << 20))
        sockets.append(sock)
    return sockets


def _scrape_loop(port: int, interval: float, ready: Any, stop: Any) -> None:
    ready.wait()  # every scraper has started (spawning is not part of the row)
    while not stop.is_set():
        started = time.monotonic()
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/metrics")
            connection.getresponse().read()
            connection.close()
        if interval:
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


@contextlib.contextmanager
def scrapers(port: int, count: int, interval: float) -> Iterator[None]:
    """``count`` scraper processes, each scraping every ``interval`` s (0: tight
    loop), pinned to no core (they share the load generator's and the server's)."""
    spawn = multiprocessing.get_context("spawn")
    stop, ready = spawn.Event(), spawn.Barrier(count + 1)
    processes = [
        spawn.Process(target=_scrape_loop, args=(port, interval, ready, stop)) for _ in range(count)
    ]
    for process in processes:
        process.start()
    try:
        ready.wait()
        time.sleep(0.2)
        yield
    finally:
        stop.set()
        for process in processes:
            process.join(15)
            if process.is_alive():
                process.kill()


@dataclass
class Running:
    """A server started by bench/run.py: its pid, lock port and metrics port."""

    pid: int
    port: int
    metrics_port: int


def print_scrape_rows(
    uncached: Running,
    cached: Running,
    run_pair: Callable[[], float],
    cpu_seconds: Callable[[int], float],
) -> None:
    """Print every scrape row. ``uncached`` runs with ``--metrics-cache 0``, ``cached``
    with the defaults; ``run_pair()`` runs the pair workload against ``cached`` and
    returns its req/s."""
    renders = render_rows()
    print()
    print(
        f"Render of /metrics (in process, median of 20): in memory {renders['memory_small']:.2f} "
        f"ms at 1,000 locks, {renders['memory_big']:.2f} ms at {LOCKS:,}; cluster node "
        f"{renders['cluster_small']:.2f} ms at 1,000 queue entries, "
        f"{renders['cluster_big']:.2f} ms at {LOCKS:,}"
    )
    costs = {}
    for name, server in (("uncached", uncached), ("cached", cached)):
        held = hold_locks(server.port, LOCKS)
        costs[name] = scrape_cpu_ms(server.pid, server.metrics_port, cpu_seconds)
        for sock in held:
            sock.close()
    print(
        f"Server CPU per scrape at {LOCKS:,} locks (300 scrapes, keep-alive): "
        f"{costs['uncached']:.2f} ms rendered every time (--metrics-cache 0), "
        f"{costs['cached']:.2f} ms with the default 1 s cache"
    )
    runs: dict[str, list[float]] = {"none": [], "8 at 1/s": [], "8 in a tight loop": []}
    for _ in range(3):
        runs["none"].append(run_pair())
        with scrapers(cached.metrics_port, 8, 1.0):
            runs["8 at 1/s"].append(run_pair())
        with scrapers(cached.metrics_port, 8, 0.0):
            runs["8 in a tight loop"].append(run_pair())
    base = statistics.median(runs["none"])
    print(
        "Lock throughput beside scrapers (pair, 1 in flight, median of 3 alternating runs): "
        + "; ".join(
            f"{name} {statistics.median(values):,.0f} req/s "
            f"({statistics.median(values) / base:.2f}x)"
            for name, values in runs.items()
        )
    )
