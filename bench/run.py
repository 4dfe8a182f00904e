"""``make bench``: elockd beside Redis, side by side in one run, pinned to cores.

Every throughput row runs the same C load generator against elockd and, when
``redis-server`` is installed, against Redis (``SET NX PX`` / ``DEL``), with the
server on core 0 and the generator on core 1 (``taskset``), and prints the ratio.
Absolute numbers move with the machine; the ratios are what to compare.

The generator is an external C program (epoll, one loop per thread) built from
source with ``cc``: ``--loadgen-src DIR`` (or ``$LOADGEN_SRC``) names the folder of
its single ``.c`` file; ``--loadgen BINARY`` uses a built one. Its CPU time is
printed next to the server's, to show it is not the bottleneck.

The throttle rows (``--only throttle``) drive elockd's ``throttle`` verb and, beside
it, Redis running bench/gcra.lua (the same GCRA, loaded with ``SCRIPT LOAD``, called
with ``EVALSHA``) with bench/throttlegen.c, a C generator of this repository built
the same way: 50 connections on their own key at a rate that admits everything,
then 50 on 16 hot keys where most requests are refused. elockd's pair row runs
first in the same table, and the throttle rows are printed as a ratio to it.

The hold row (10,000 connections x 100 locks, half of them shared) and the
feature-cost row (10,000 waiters and 100,000 leases pending) are driven from this
script with plain sockets, because they measure the server's memory and its
disconnect work, not request rate.

The etcd rows (``--only etcd`` runs just them, ``--skip etcd`` leaves them out;
``--etcd-clients`` one or more client counts, ``--etcd-session-ttl``; the burst
and idle rows of bench/etcd_scale.py with ``--etcd-burst N``, 0 for none,
``--etcd-burst-wait``, ``--etcd-idle-seconds``) start a real 3-member etcd cluster
(Debian's ``etcd-server``, through ``tests/support/etcd_cluster.py``) and two elockd nodes
in cluster mode on one fresh key prefix, and drive them from threads of this
script over plain sockets, one request per round trip: the operations take
milliseconds, so the C generator is not needed, and the script's own CPU is
printed to show it is not the limit. Reference rows run the same two etcd txns
per cycle straight against etcd's JSON gateway (no elockd), at 1 client and at
each count, and are printed again beside the nodes' rows: etcd's own write rate in
the same run. Two more run the one-client loop against an in-memory elockd.
Nothing is pinned: three etcd members, the nodes and the clients share every core,
so each row also prints how long a node waited for a core
(``/proc/PID/task/*/schedstat``) and the whole machine's CPU.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.client
import json
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elockd.client import BlockingClient

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "bench" / ".build"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SERVER_CORE, LOADGEN_CORE = "0", "1"
#: etcd's raft commits: its own write rate, in the load rows' notes and the idle row.
COMMITS = "etcd_server_proposals_committed_total"


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_split(pid: int) -> tuple[float, float]:
    """user and system CPU seconds of a process so far, from /proc (utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """user + system CPU of a process so far."""
    return sum(cpu_split(pid))


def memory_kib(pid: int, name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{name} not in /proc/{pid}/status")


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


@contextlib.contextmanager
def running(
    command: list[str], port: int, core: str | None = SERVER_CORE, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (pinned to ``core`` unless None) until the block ends; its
    stderr goes to ``log`` when given. Stopped by its own pid."""
    pinned = ["taskset", "-c", core, *command] if core is not None else command
    with contextlib.ExitStack() as files:
        stderr = files.enter_context(open(log, "ab")) if log else subprocess.DEVNULL
        process = subprocess.Popen(pinned, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for_port(port, process)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def elockd_command(port: int, metrics_port: int = 0, *extra: str) -> list[str]:
    """elockd as the bench runs it. ``-P``: the package comes from ``PYTHONPATH`` or
    the install, never from the working directory, so that bench/compare.py's
    ``--before`` checkout is what runs even when started from this repository's root."""
    return [
        sys.executable,
        "-P",
        "-m",
        "elockd",
        "--port",
        str(port),
        "--metrics-port",
        # On, as by default: its histogram hooks run per release.
        str(metrics_port or free_port()),
        "--max-connections",
        "20000",
        "--max-holds",
        "100000",
        "--log-level",
        "warning",
        *extra,
    ]


def redis_command(port: int) -> list[str]:
    return [
        "redis-server",
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--tcp-backlog",
        "4096",
        "--maxclients",
        "20000",
    ]


# ---------------------------------------------------------- the generator


def build_loadgen(source_dir: Path) -> Path:
    sources = sorted(source_dir.glob("*.c"))
    if len(sources) != 1:
        raise SystemExit(f"expected one .c file in {source_dir}, found {len(sources)}")
    return compile_c(sources[0], "loadgen")


def compile_c(source: Path, name: str) -> Path:
    """``source`` built into the build folder as ``name`` (again only when the source
    is newer), with ``$CC`` or ``cc``."""
    BUILD.mkdir(parents=True, exist_ok=True)
    binary = BUILD / name
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        compiler = os.environ.get("CC", "cc")
        subprocess.run(
            [compiler, "-O2", "-std=gnu11", "-pthread", "-o", str(binary), str(source)],
            check=True,
        )
    return binary


@dataclass
class Result:
    rps: float
    p50_us: float
    p99_us: float
    requests: int
    server_cpu: float
    loadgen_cpu: float
    rss_kib: int
    errors: int
    extra: dict[str, str] = field(default_factory=dict)
    #: the user-space part of server_cpu (the rest is the kernel's: syscalls)
    server_user: float = 0.0

    @property
    def server_us_per_request(self) -> float:
        return self.server_cpu / self.requests * 1e6 if self.requests else float("nan")

    @property
    def server_user_us_per_request(self) -> float:
        return self.server_user / self.requests * 1e6 if self.requests else float("nan")


def run_loadgen(
    loadgen: Path, mode: str, port: int, server_pid: int, seconds: float, *args: str
) -> Result:
    before_user, before_system = cpu_split(server_pid)
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    completed = subprocess.run(
        [
            "taskset",
            "-c",
            LOADGEN_CORE,
            str(loadgen),
            "--mode",
            mode,
            "--port",
            str(port),
            "--duration",
            str(seconds),
            *args,
        ],
        capture_output=True,
        text=True,
    )
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    after_user, after_system = cpu_split(server_pid)
    server_user = after_user - before_user
    server_cpu = server_user + after_system - before_system
    loadgen_cpu = (after_children.ru_utime + after_children.ru_stime) - (
        before_children.ru_utime + before_children.ru_stime
    )
    result_line = next(
        (line for line in completed.stdout.splitlines() if line.startswith("RESULT ")), None
    )
    if result_line is None:
        raise RuntimeError(f"load generator failed: {completed.stderr.strip()[-500:]}")
    values = dict(item.split("=", 1) for item in result_line.split()[1:])
    return Result(
        rps=float(values["rps"]),
        p50_us=float(values["p50_us"]),
        p99_us=float(values["p99_us"]),
        requests=int(values["requests"]),
        server_cpu=server_cpu,
        loadgen_cpu=loadgen_cpu,
        rss_kib=memory_kib(server_pid),
        errors=int(values["errors"]),
        extra=values,
        server_user=server_user,
    )


# ---------------------------------------------------------- socket helpers


def raise_file_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def read_lines(sock: socket.socket, count: int, buffer: bytearray) -> list[bytes]:
    """``count`` reply lines (an over-read stays in ``buffer``)."""
    while buffer.count(b"\n") < count:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError("server closed the connection")
        buffer += chunk
    lines = bytes(buffer).split(b"\r\n")
    taken = lines[:count]
    del buffer[: sum(len(line) + 2 for line in taken)]
    return taken


def connect_many(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sockets.append(sock)
    return sockets


def request_all(sockets: list[socket.socket], payloads: list[bytes], per_socket: int) -> None:
    """Send each socket its payload, then read ``per_socket`` replies from each,
    checking that every one is a success (leading integer not 0)."""
    for start in range(0, len(sockets), 500):  # bounded in-flight batches
        batch = sockets[start : start + 500]
        for sock, payload in zip(batch, payloads[start : start + 500], strict=True):
            sock.sendall(payload)
        for sock in batch:
            for line in read_lines(sock, per_socket, bytearray()):
                if line[:1] in (b"0", b"4") and not line.startswith(b"200"):
                    raise RuntimeError(f"refused during setup: {line!r}")


def q_counters(port: int) -> dict[str, int]:
    """The server's ``q`` counters by name, over a connection of their own, read by
    the project's client as ``elockctl q`` reads them."""
    with BlockingClient("127.0.0.1", port, reply_timeout=30) as client:
        lines = client.command(b"q", check=True)
    pairs = (line.decode().partition(": ") for line in lines)
    return {name: int(value) for name, _, value in pairs}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# ----------------------------------------------------------------- rows


def probe_until_free(port: int, sample: list[tuple[int, int]], start: Any, results: Any) -> None:
    """Probe the sample keys one request at a time, from the drop until every one is
    free; report when the last came free and the latency of every reply meanwhile."""
    probe = socket.create_connection(("127.0.0.1", port), timeout=30)
    pending = list(sample)
    buffer = bytearray()
    latencies: list[float] = []
    start.wait()
    started_at = time.monotonic()
    while pending and time.monotonic() - started_at < 30:
        still = []
        for c, j in pending:
            verb = b"i" if j % 2 == 0 else b"si"
            sent = time.monotonic()
            probe.sendall(b"%s h:%d:%d\n" % (verb, c, j))
            (line,) = read_lines(probe, 1, buffer)
            latencies.append(time.monotonic() - sent)
            if not line.startswith(b"0"):
                still.append((c, j))
        pending = still
    probe.close()
    results.put((time.monotonic() - started_at if not pending else float("inf"), latencies))


def hold_row(port: int, pid: int, conns: int, per_conn: int) -> dict[str, float]:
    """conns connections x per_conn locks (half exclusive, half shared); memory per
    held lock over the same connections holding nothing; then every connection
    drops at once while a probe measures reply latency and waits for all to be free."""
    raise_file_limit(conns + 1000)
    idle = connect_many(port, conns)
    ping_all = [b"ping\n"] * conns
    request_all(idle, ping_all, 1)  # every connection is served, so its session exists
    rss_idle = memory_kib(pid)
    started = time.monotonic()
    payloads = []
    for c in range(conns):
        lines = [
            (b"g h:%d:%d\n" if j % 2 == 0 else b"sg h:%d:%d\n") % (c, j) for j in range(per_conn)
        ]
        payloads.append(b"".join(lines))
    request_all(idle, payloads, per_conn)
    establish = time.monotonic() - started
    rss_held = memory_kib(pid)
    locks = conns * per_conn
    sample = [(c, j) for c in range(0, conns, max(1, conns // 1000)) for j in (0, 1)]
    # The probe runs in a process of its own, so that this one closing 10,000
    # sockets does not hold it back (a thread would wait for the GIL).
    spawn = multiprocessing.get_context("spawn")
    start, results = spawn.Event(), spawn.Queue()
    watcher = spawn.Process(target=probe_until_free, args=(port, sample, start, results))
    watcher.start()
    time.sleep(0.5)  # let it connect
    start.set()
    for sock in idle:
        sock.close()
    all_free, latencies = results.get(timeout=60)
    watcher.join()
    return {
        "locks": locks,
        "establish_s": establish,
        "rss_idle_mib": rss_idle / 1024,
        "rss_held_mib": rss_held / 1024,
        "bytes_per_lock": (rss_held - rss_idle) * 1024 / locks,
        "all_free_s": all_free,
        "probe_p99_ms": percentile(latencies, 0.99) * 1000,
        "probe_max_ms": max(latencies) * 1000,
        "probes": len(latencies),
    }


def on_loadgen_core() -> None:
    """Run this process on the load generator's core, so that nothing of the bench
    takes the server's core from it."""
    os.sched_setaffinity(0, {int(LOADGEN_CORE)})


def burst_probe(port: int, interval: float, stop: Any, ready: Any, results: Any) -> None:
    """An established client: ``g``/``r`` on its own key every ``interval`` seconds,
    one request per round trip, until ``stop``; reports (sent at, round trip) of
    every request."""
    on_loadgen_core()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray()
    rounds: list[tuple[float, float]] = []
    ready.set()
    next_at = time.monotonic()
    while not stop.is_set():
        for request, expected in ((b"g burst-probe\n", b"1 "), (b"r burst-probe\n", b"1 ")):
            sent = time.monotonic()
            sock.sendall(request)
            (line,) = read_lines(sock, 1, buffer)
            rounds.append((sent, time.monotonic() - sent))
            if not line.startswith(expected):
                raise RuntimeError(f"probe {request!r} -> {line!r}")
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    sock.close()
    results.put(rounds)


def burst_newcomers(port: int, count: int, done: Any, results: Any, release: Any) -> None:
    """``count`` new connections as fast as this process can open them, each sending
    ``g burst:N`` at once; then every reply read. Reports when it started, when the
    last connection was opened, the slowest connect (a newcomer's own wait) and when
    the last reply came (``time.monotonic``, one clock for every process) and how many
    got their lock; the connections stay open until ``release``, so their closing is
    not part of the row."""
    on_loadgen_core()
    # Below the probe on the shared core: the probe's round trip is to show the
    # server's wait, not the wait for this process to give the core up.
    os.nice(10)
    raise_file_limit(count + 1000)
    started = time.monotonic()
    sockets = []
    address = ("127.0.0.1", port)
    slowest = 0.0
    for index in range(count):
        sock = socket.socket()  # blocking, no name lookup: as fast as one process opens them
        before = time.monotonic()
        sock.connect(address)
        slowest = max(slowest, time.monotonic() - before)
        sock.sendall(b"g burst:%d\n" % index)
        sockets.append(sock)
    opened = time.monotonic()
    got = 0
    for sock in sockets:
        (line,) = read_lines(sock, 1, bytearray())
        got += line.startswith(b"1 ")
    results.put((started, opened, time.monotonic(), got, slowest))
    done.set()
    release.wait(60)
    for sock in sockets:
        sock.close()


def burst_row(port: int, count: int, interval: float = 0.005) -> dict[str, float]:
    """An established client doing ``g``/``r`` every ``interval`` while ``count`` new
    connections arrive and each sends ``g KEY``: the client's worst round trip
    during the burst, beside its worst in the second before. Probe and newcomers
    are processes of their own on the load generator's core."""
    spawn = multiprocessing.get_context("spawn")
    stop, ready, done, release = (spawn.Event() for _ in range(4))
    probe_results, burst_results = spawn.Queue(), spawn.Queue()
    probe = spawn.Process(target=burst_probe, args=(port, interval, stop, ready, probe_results))
    probe.start()
    if not ready.wait(30):
        raise RuntimeError("burst probe did not connect")
    time.sleep(1.0)  # the quiet second
    newcomers = spawn.Process(
        target=burst_newcomers, args=(port, count, done, burst_results, release)
    )
    newcomers.start()
    burst_start, opened, burst_end, got, slowest = burst_results.get(timeout=120)
    time.sleep(0.2)
    stop.set()
    rounds = probe_results.get(timeout=30)
    release.set()
    probe.join()
    newcomers.join()
    before = [rtt for sent, rtt in rounds if burst_start - 1.0 <= sent < burst_start]
    # A request sent before the burst but answered during it counts as during.
    during = [rtt for sent, rtt in rounds if burst_start <= sent + rtt and sent <= burst_end]
    if not before or not during:
        raise RuntimeError("the burst probe measured nothing before or during the burst")
    return {
        "newcomers": count,
        "got": got,
        "opened_s": opened - burst_start,
        "replied_s": burst_end - burst_start,
        "slowest_connect_ms": slowest * 1000,
        "before_max_ms": max(before) * 1000,
        "during_max_ms": max(during) * 1000,
        "during_p99_ms": percentile(during, 0.99) * 1000,
        "probes": len(during),
    }


def print_burst(burst: dict[str, float]) -> None:
    print(
        f"Burst: {burst['newcomers']:,.0f} new connections each sending 'g KEY' "
        f"({burst['got']:,.0f} granted; all opened after {burst['opened_s']:.2f} s, the "
        f"slowest connect {burst['slowest_connect_ms']:.0f} ms, all answered after "
        f"{burst['replied_s']:.2f} s) while an established client does "
        f"g/r every 5 ms: its worst round trip {burst['during_max_ms']:.1f} ms during the "
        f"burst (p99 {burst['during_p99_ms']:.1f} ms over {burst['probes']:,.0f} requests), "
        f"{burst['before_max_ms']:.1f} ms in the second before",
        flush=True,
    )


@contextlib.contextmanager
def waiters_and_leases(port: int, waiters: int, leases: int) -> Iterator[None]:
    """Keep ``waiters`` requests queued (10 keys, their holder never lets go) and
    ``leases`` one-hour leases pending, for as long as the block runs."""
    raise_file_limit(waiters + 1000)
    holder = socket.create_connection(("127.0.0.1", port), timeout=30)
    keys = 10
    holder.sendall(b"".join(b"lock busy:%d\n" % k for k in range(keys)))
    read_lines(holder, keys, bytearray())
    queued = connect_many(port, waiters)
    for index, sock in enumerate(queued):
        sock.sendall(b"lock busy:%d 3600\n" % (index % keys))
    owners = connect_many(port, max(1, leases // 10_000))
    per_owner = leases // len(owners)
    request_all(
        owners,
        [
            b"".join(b"lock lease:%d:%d ttl=3600\n" % (o, j) for j in range(per_owner))
            for o in range(len(owners))
        ],
        per_owner,
    )
    values = q_counters(port)
    if values["waiting"] != waiters or values["leases"] != per_owner * len(owners):
        raise RuntimeError(f"setup incomplete: {values}")
    try:
        yield
    finally:
        for sock in [holder, *queued, *owners]:
            sock.close()


# ------------------------------------------------------------ etcd backend


#: One acquire+release cycle: request, expected reply, request, expected reply.
Cycle = tuple[bytes, bytes, bytes, bytes]
WORD_CYCLE: Cycle = (b"lock %s\n", b"200 Acquired", b"unlock %s\n", b"200 Unlocked")
TERSE_CYCLE: Cycle = (b"g %s\n", b"1 Got Lock", b"r %s\n", b"1 Released Lock")
WAIT_CYCLE: Cycle = (b"lock %s 10\n", b"200 Acquired", b"unlock %s\n", b"200 Unlocked")


@dataclass
class Tally:
    """What one client thread saw: (end time, seconds) per cycle, and its errors
    (all counted, the first few kept)."""

    cycles: list[tuple[float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_count: int = 0

    def error(self, text: str) -> None:
        self.error_count += 1
        if len(self.errors) < 5:
            self.errors.append(text)


@dataclass
class Holders:
    """Counts the clients that believe they hold the key: a client counts itself in
    on its grant and out just before it sends the release. A sanity check, not a
    proof: the window is short, so only a frequent double grant would show."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    now: int = 0
    most: int = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


@dataclass
class Client:
    """What a client thread runs: ``step`` makes one acquire+release cycle (raising
    RuntimeError on a wrong reply), ``close`` ends the connection."""

    step: Callable[[], None]
    close: Callable[[], None]


def client_loop(
    connect: Callable[[], Client],
    ready: threading.Barrier,
    stop: threading.Event,
    tally: Tally,
) -> None:
    """A warm-up cycle (an elockd node opens a connection's session on its first
    lock), then cycles until ``stop``; a cycle under way when ``stop`` is set still
    ends with its release. A wrong reply is counted and the loop goes on."""
    passed = False
    try:
        client = connect()
        try:
            client.step()
            ready.wait()
            passed = True
            while not stop.is_set():
                started = time.monotonic()
                try:
                    client.step()
                except RuntimeError as error:
                    tally.error(str(error))
                    continue
                ended = time.monotonic()
                tally.cycles.append((ended, ended - started))
        finally:
            client.close()
    except (OSError, RuntimeError, ValueError, KeyError, threading.BrokenBarrierError) as error:
        tally.error(repr(error))
        if not passed:
            ready.abort()


def elockd_client(port: int, key: bytes, cycle: Cycle, holders: Holders | None) -> Client:
    """A connection that runs ``cycle`` on ``key``, one request per round trip."""
    lock_request, granted = cycle[0] % key, cycle[1]
    unlock_request, released = cycle[2] % key, cycle[3]
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray()

    def step() -> None:
        sock.sendall(lock_request)
        (line,) = read_lines(sock, 1, buffer)
        if line != granted:
            raise RuntimeError(f"{lock_request!r} -> {line!r}")
        if holders:
            holders.enter()
            holders.leave()
        sock.sendall(unlock_request)
        (line,) = read_lines(sock, 1, buffer)
        if line != released:
            raise RuntimeError(f"{unlock_request!r} -> {line!r}")

    return Client(step, sock.close)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def raw_etcd_client(endpoint: str, prefix: bytes, index: int) -> Client:
    """The two txns a node sends for ``g K``/``r K`` (try-lock: enter the key's queue
    if it is empty, entry on a lease; release: guarded delete, then read the queue),
    sent straight to etcd's JSON gateway over one keep-alive connection: what etcd
    gives on this box without elockd in between."""
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        connection.request("POST", f"/v3/{path}", json.dumps(body), headers)
        reply: dict[str, Any] = json.loads(connection.getresponse().read())
        return reply

    lease = post("lease/grant", {"TTL": 60})["ID"]
    queue = prefix + b"raw/%d/" % index
    entry, queue_end = _b64(queue + b"e"), _b64(queue[:-1] + b"0")
    queue_b64 = _b64(queue)

    def step() -> None:
        taken = post(
            "kv/txn",
            {
                "compare": [
                    {
                        "key": queue_b64,
                        "range_end": queue_end,
                        "target": "CREATE",
                        "result": "EQUAL",
                        "create_revision": "0",
                    }
                ],
                "success": [{"request_put": {"key": entry, "value": _b64(b"1"), "lease": lease}}],
                "failure": [{"request_range": {"key": queue_b64, "range_end": queue_end}}],
            },
        )
        if not taken.get("succeeded"):
            raise RuntimeError(f"raw acquire failed: {taken}")
        freed = post(
            "kv/txn",
            {
                "compare": [
                    {
                        "key": entry,
                        "target": "CREATE",
                        "result": "EQUAL",
                        "create_revision": taken["header"]["revision"],
                    }
                ],
                "success": [
                    {"request_delete_range": {"key": entry}},
                    {
                        "request_range": {
                            "key": queue_b64,
                            "range_end": queue_end,
                            "sort_target": "CREATE",
                            "sort_order": "ASCEND",
                        }
                    },
                ],
            },
        )
        if not freed.get("succeeded"):
            raise RuntimeError(f"raw release failed: {freed}")

    return Client(step, connection.close)


@dataclass
class LoopResult:
    cycles: int
    seconds: float
    latencies: list[float]
    rates: dict[str, float]  # counter name -> its growth per second over the window
    errors: list[str]
    error_count: int
    per_group: list[int]
    most_holders: int

    @property
    def rate(self) -> float:
        return self.cycles / self.seconds

    def ms(self, fraction: float) -> float:
        return percentile(self.latencies, fraction) * 1000 if self.latencies else float("nan")


@dataclass
class Window:
    """Counters sampled at both ends of a ``with`` block: one place that turns
    "how much did each grow while this ran" into totals and rates."""

    counters: dict[str, Callable[[], float]]
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    ended: float = 0.0

    def __enter__(self) -> Window:
        self.before = {name: counter() for name, counter in self.counters.items()}
        self.started = time.monotonic()
        return self

    def __exit__(self, *_: object) -> None:
        self.after = {name: counter() for name, counter in self.counters.items()}
        self.ended = time.monotonic()

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def grown(self, name: str) -> float:
        return self.after[name] - self.before[name]

    def rate(self, name: str) -> float:
        return self.grown(name) / self.seconds


def run_loops(
    connects: list[Callable[[], Client]],
    seconds: float,
    counters: dict[str, Callable[[], float]],
    groups: int = 1,
    holders: Holders | None = None,
) -> LoopResult:
    """One thread per client; counts the cycles that end within ``seconds`` after
    every client is warm, per group (client ``i`` is in group ``i % groups``: the
    node it talks to), and how fast each of ``counters`` grew meanwhile."""
    ready = threading.Barrier(len(connects) + 1, timeout=60)
    stop = threading.Event()
    tallies = [Tally() for _ in connects]
    threads = [
        threading.Thread(target=client_loop, args=(connect, ready, stop, tally), daemon=True)
        for connect, tally in zip(connects, tallies, strict=True)
    ]
    for thread in threads:
        thread.start()

    try:
        ready.wait()
    except threading.BrokenBarrierError:
        stop.set()
        for thread in threads:
            thread.join(30)
        errors = [error for tally in tallies for error in tally.errors]
        raise RuntimeError(f"clients failed to start: {errors[:5]}") from None
    with Window(counters) as window:
        time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    if any(thread.is_alive() for thread in threads):
        raise RuntimeError("a client is still waiting 60 s after the row ended")
    counted = [
        [latency for end, latency in tally.cycles if window.started <= end <= window.ended]
        for tally in tallies
    ]
    per_group = [sum(len(c) for c in counted[group::groups]) for group in range(groups)]
    return LoopResult(
        cycles=sum(per_group),
        seconds=window.seconds,
        latencies=[latency for latencies in counted for latency in latencies],
        rates={name: window.rate(name) for name in counters},
        errors=[error for tally in tallies for error in tally.errors],
        error_count=sum(tally.error_count for tally in tallies),
        per_group=per_group,
        most_holders=holders.most if holders else 0,
    )


def on(port: int, key: bytes, cycle: Cycle, holders: Holders | None = None) -> Callable[[], Client]:
    """A client of the elockd on ``port`` (connects when called, in its thread)."""
    return functools.partial(elockd_client, port, key, cycle, holders)


def started_etcd(stack: contextlib.ExitStack, name: str) -> tuple[Path, Any]:
    """A fresh 3-member etcd cluster (tests/support/etcd_cluster.py) in a temporary
    directory, both gone when ``stack`` closes: the directory and the cluster."""
    from tests.support.etcd_cluster import running_cluster

    base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"elockd-bench-{name}-")))
    return base, stack.enter_context(running_cluster(base))


def etcd_node_command(port: int, endpoints: list[str], prefix: str, ttl: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "elockd",
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--etcd",
        ",".join(endpoints),
        "--etcd-prefix",
        prefix,
        "--session-ttl",
        str(ttl),
        "--log-level",
        "warning",
    ]


def box_busy_seconds() -> float:
    """CPU time every process on the machine used so far (all cores), from /proc/stat."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / CLOCK_TICKS  # less idle and iowait


def queued_seconds(pid: int) -> float:
    """Time the process's threads spent runnable but waiting for a core so far
    (/proc/PID/task/*/schedstat, second field, ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def etcd_samples(url: str) -> dict[str, float]:
    """Every unlabelled sample of an etcd member's /metrics (counters, gauges and the
    ``_count`` of histograms), so one scrape serves every rate of a window."""
    values: dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                with contextlib.suppress(ValueError):
                    values[name] = float(value)
    return values


def etcd_metric(url: str, name: str) -> float:
    """One unlabelled counter from an etcd member's /metrics."""
    value = etcd_samples(url).get(name)
    if value is None:
        raise RuntimeError(f"{name} not in {url}/metrics")
    return value


def process_counters(name: str, pid: int) -> dict[str, Callable[[], float]]:
    return {name: lambda: cpu_seconds(pid), f"{name} queued": lambda: queued_seconds(pid)}


def print_etcd_row(name: str, clients: int, result: LoopResult) -> None:
    rates = result.rates
    nodes = [n for n in sorted(rates) if n.startswith("node") and not n.endswith("queued")]
    node_cpu = sum(rates[n] for n in nodes)
    etcd = rates.get("etcd")
    per_cycle = "-"
    if result.cycles:
        node_cost = f"{node_cpu / result.rate * 1000:.2f}" if nodes else "-"
        etcd_cost = "" if etcd is None else f" / {etcd / result.rate * 1000:.1f}"
        per_cycle = node_cost + etcd_cost
    notes = [f"{result.error_count} errors"]
    if len(result.per_group) > 1:
        notes.append("per node " + " / ".join(f"{count:,}" for count in result.per_group))
    if result.most_holders:
        notes.append(f"most holders at once {result.most_holders}")
    if "commits" in rates:
        notes.append(f"etcd {rates['commits']:,.0f} commits/s")
    node_column = (
        " + ".join(f"{rates[n] * 100:.0f} (+{rates[n + ' queued'] * 100:.0f})" for n in nodes)
        or "-"
    )
    print(
        f"| {name} | {clients} | {result.rate:,.0f} | {result.ms(0.5):.2f} / "
        f"{result.ms(0.99):.2f} / {max(result.latencies, default=float('nan')) * 1000:.2f} | "
        f"{node_column} | {'-' if etcd is None else f'{etcd * 100:.0f}'} | {per_cycle} | "
        f"{rates['client'] * 100:.0f} | {rates['box'] * 100:.0f} | {'; '.join(notes)} |",
        flush=True,
    )
    for error in result.errors[:5]:
        print(f"    error: {error}", flush=True)


#: A load row against the nodes: its name, one connect per client, the counters it
#: samples (``both`` nodes' makes it a 2-node row) and the hand-off row's holders.
NodeRow = tuple[str, list[Callable[[], Client]], dict[str, Callable[[], float]], Holders | None]


def node_rows(
    ports: list[int],
    counts: list[int],
    one: dict[str, Callable[[], float]],
    both: dict[str, Callable[[], float]],
) -> list[NodeRow]:
    """The load rows against the two nodes, in the order they run: one client's
    latency, own keys on one node and on both at each client count (on both only with
    more than one client, so each node has one), then the hand-off row at the first
    count."""
    hot = Holders()
    rows: list[NodeRow] = [
        (
            "latency, 1 node, `lock K`/`unlock K`",
            [on(ports[0], b"lat:w", WORD_CYCLE)],
            one,
            None,
        ),
        ("latency, 1 node, `g K`/`r K`", [on(ports[0], b"lat:t", TERSE_CYCLE)], one, None),
    ]
    for clients in counts:
        own = [b"own:%d" % i for i in range(clients)]
        rows.append(("own keys, 1 node", [on(ports[0], k, WORD_CYCLE) for k in own], one, None))
        if clients > 1:
            two = [on(ports[i % 2], k, WORD_CYCLE) for i, k in enumerate(own)]
            rows.append(("own keys, 2 nodes", two, both, None))
    rows.append(
        (
            "one key, `lock K 10`, 2 nodes (handoffs)",
            [on(ports[i % 2], b"hot", WAIT_CYCLE, hot) for i in range(counts[0])],
            both,
            hot,
        )
    )
    return rows


def memory_rows(seconds: float, results: dict[tuple[str, int], LoopResult]) -> None:
    """The one-client latency loops against a plain in-memory elockd, as the
    reference (added to ``results``), then each family's p50 on a node over it: what
    going through etcd costs one client."""
    port = free_port()
    with running(elockd_command(port), port, core=None) as plain:
        memory: dict[str, Callable[[], float]] = {
            "client": time.process_time,
            "box": box_busy_seconds,
            **process_counters("node", plain.pid),
        }
        for name, key, cycle in (
            ("latency, in memory, `lock K`/`unlock K`", b"lat:w", WORD_CYCLE),
            ("latency, in memory, `g K`/`r K`", b"lat:t", TERSE_CYCLE),
        ):
            results[name, 1] = run_loops([on(port, key, cycle)], seconds, memory)
            print_etcd_row(name, 1, results[name, 1])
    ratios = []
    for family in ("`lock K`/`unlock K`", "`g K`/`r K`"):
        etcd_p50 = results[f"latency, 1 node, {family}", 1].ms(0.5)
        memory_p50 = results[f"latency, in memory, {family}", 1].ms(0.5)
        ratios.append(
            f"{family} {etcd_p50:.2f} / {memory_p50:.3f} ms = {etcd_p50 / memory_p50:,.0f}x"
        )
    print()
    print("One client's cycle p50, etcd / in memory: " + ", ".join(ratios), flush=True)


def etcd_rows(
    seconds: float,
    counts: list[int],
    ttl: int,
    burst: int,
    burst_wait: float,
    idle_seconds: float,
) -> None:
    """The etcd backend rows; see the module docstring and docs/performance.md. The
    load rows run once per client count in ``counts``; the scale rows
    (bench/etcd_scale.py) come last, so their burst disturbs none of the others."""
    sys.path.insert(0, str(ROOT))
    print()
    print(
        f"etcd backend: 3 etcd members, 2 elockd nodes and the clients (threads of this "
        f"script) share {os.cpu_count()} cores, unpinned; {seconds:g} s per row. A cycle "
        "is one acquire+release, each request on its own round trip. CPU in % of one core; "
        "node: on a core (+ runnable but waiting for one); box: every process on the "
        "machine, ours included. CPU ms per cycle: the nodes together / all 3 etcd members."
    )
    prefix = f"/bench-{uuid.uuid4().hex[:10]}/"
    results: dict[tuple[str, int], LoopResult] = {}
    with contextlib.ExitStack() as stack:
        base, cluster = started_etcd(stack, "etcd")
        members = [m.process.pid for m in cluster.members.values() if m.process]
        ports = [free_port(), free_port()]
        nodes = [
            stack.enter_context(
                running(
                    etcd_node_command(port, cluster.endpoints, prefix, ttl),
                    port,
                    core=None,
                    log=base / f"node{index + 1}.log",
                )
            )
            for index, port in enumerate(ports)
        ]
        common: dict[str, Callable[[], float]] = {
            "client": time.process_time,
            "box": box_busy_seconds,
            "etcd": lambda: sum(cpu_seconds(pid) for pid in members),
            "commits": lambda: etcd_metric(cluster.endpoints[0], COMMITS),
        }
        one = {**common, **process_counters("node1", nodes[0].pid)}
        both = {**one, **process_counters("node2", nodes[1].pid)}
        with Window(both) as idle:
            time.sleep(2)
        print(
            f"Idle for 2 s before the rows: etcd {idle.rate('etcd') * 100:.0f} %, nodes "
            f"{idle.rate('node1') * 100:.0f} + {idle.rate('node2') * 100:.0f} %, etcd "
            f"{idle.rate('commits'):.1f} commits/s, box {idle.rate('box') * 100:.0f} %."
        )
        print()
        print(
            "| row | clients | acquire+release/s | cycle p50 / p99 / max ms | node CPU % | "
            "etcd CPU % | CPU ms per cycle node / etcd | client CPU % | box CPU % | notes |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")

        for name, connects, counters, holders in node_rows(ports, counts, one, both):
            groups = 2 if counters is both else 1
            result = run_loops(connects, seconds, counters, groups, holders)
            results[name, len(connects)] = result
            print_etcd_row(name, len(connects), result)
        # etcd alone: the same two txns per cycle from threads straight to one member,
        # outside the nodes' prefix (their watches do not see these keys).
        raw_prefix = f"/bench-raw-{uuid.uuid4().hex[:10]}/".encode()
        raw: list[Callable[[], Client]] = [
            functools.partial(raw_etcd_client, cluster.endpoints[0], raw_prefix, i)
            for i in range(max(counts))
        ]
        for clients in sorted({1, *counts}):
            name = "etcd alone, 1 client (no elockd)" if clients == 1 else "etcd alone (no elockd)"
            result = run_loops(raw[:clients], seconds, common)
            results[name, clients] = result
            print_etcd_row(name, clients, result)
        if any(result.error_count for result in results.values()):
            for index in range(len(nodes)):
                log = (base / f"node{index + 1}.log").read_text(errors="replace").splitlines()
                print(f"--- node{index + 1}.log (last lines)\n" + "\n".join(log[-20:]))
            print(cluster.log_tails(5))
    memory_rows(seconds, results)
    from bench.etcd_scale import print_beside_etcd, scale_rows

    print_beside_etcd(results)
    if burst:
        scale_rows(ttl, burst, burst_wait, idle_seconds)


# ----------------------------------------------------------------- report


THROUGHPUT_ROWS = [
    ("pair, 1 in flight", ["--workload", "pair", "--conns", "50", "--pipeline", "1"]),
    ("contend (16 keys), 1 in flight", ["--workload", "contend", "--keys", "16", "--conns", "50"]),
    ("shared (16 keys), 1 in flight", ["--workload", "shared", "--keys", "16", "--conns", "50"]),
    ("pair, 16 in flight", ["--workload", "pair", "--conns", "50", "--pipeline", "16"]),
]


def print_row(
    name: str,
    ours: Result,
    glockd: Result | None,
    redis: Result | None,
    glockd_column: Path | None = None,
) -> None:
    """One table row; the glockd columns only when ``glockd_column`` (its binary) is
    set, with a dash where glockd has no figure (a pipelined row)."""

    def beside(peer: Result | None) -> str:
        if peer is None:
            return "- | - |"
        return f"{peer.rps:,.0f} | {ours.rps / peer.rps:.2f}x |"

    peers = (" " + beside(glockd) if glockd_column else "") + " " + beside(redis)
    print(
        f"| {name} | {ours.rps:,.0f} | {ours.p50_us:,.0f} / {ours.p99_us:,.0f} | "
        f"{ours.server_us_per_request:.2f} | {ours.loadgen_cpu:.1f} / {ours.server_cpu:.1f} | "
        f"{ours.rss_kib / 1024:.0f} |{peers}",
        flush=True,
    )


def glockd_command(binary: Path, port: int) -> list[str]:
    """glockd (the Go server, a peer to measure against) on loopback only: its
    r286 source binds every interface, so the binary given must have been built
    with the two listen addresses changed to 127.0.0.1 (see docs/performance.md).
    No WebSocket listener; the pid file goes to the build folder."""
    BUILD.mkdir(parents=True, exist_ok=True)
    pidfile = BUILD / f"glockd-{port}.pid"
    return [str(binary), "-port", str(port), "-ws", "0", "-pidfile", str(pidfile)]


def pipelined(args: list[str]) -> bool:
    """Whether a row keeps more than one request in flight per connection (glockd
    answers one request at a time per connection, so it has no such row)."""
    return "--pipeline" in args and args[args.index("--pipeline") + 1] != "1"


def median_result(results: list[Result]) -> Result:
    """The run with the median request rate (the lower middle one of an even count),
    so that its latency and CPU columns belong to the same run."""
    return sorted(results, key=lambda result: result.rps)[(len(results) - 1) // 2]


def floor_command(port: int) -> list[str]:
    """bench/floor.py: elockd's I/O path on trio with nothing behind it."""
    return [sys.executable, "-P", str(ROOT / "bench" / "floor.py"), "--port", str(port)]


def throughput_rows(
    loadgen: Path,
    seconds: float,
    rounds: int,
    glockd: Path | None,
    have_redis: bool,
    floor: bool = False,
) -> None:
    """Each row against elockd, then glockd (when given, and not pipelined), then
    Redis, ``rounds`` times in turn; the medians and their ratios. All three servers
    run for the whole table, each pinned to the server core, and only one of them is
    driven at a time."""
    if glockd is not None and not os.access(glockd, os.X_OK):
        raise SystemExit(f"--glockd {glockd}: not an executable file")
    print()
    print(
        f"# {rounds} round(s) of {seconds:g} s per server and row, in turn; medians"
        if rounds > 1
        else f"# {seconds:g} s per server and row"
    )
    peers = " glockd req/s | to glockd |" if glockd else ""
    print(
        "| workload (50 connections) | elockd req/s | p50 / p99 µs | server CPU µs/req | "
        f"CPU s loadgen / server | RSS MiB |{peers} Redis req/s | to Redis |"
    )
    print("|---|---|---|---|---|---|" + ("---|---|" if glockd else "") + "---|---|")
    ports = {name: free_port() for name in ("elockd", "glockd", "redis", "floor")}
    with contextlib.ExitStack() as stack:
        servers = {
            "elockd": stack.enter_context(running(elockd_command(ports["elockd"]), ports["elockd"]))
        }
        if glockd is not None:
            servers["glockd"] = stack.enter_context(
                running(glockd_command(glockd, ports["glockd"]), ports["glockd"])
            )
        if have_redis:
            servers["redis"] = stack.enter_context(
                running(redis_command(ports["redis"]), ports["redis"])
            )
        if floor:
            servers["floor"] = stack.enter_context(
                running(floor_command(ports["floor"]), ports["floor"])
            )
        modes = {"elockd": "lockd", "glockd": "lockd", "redis": "redis", "floor": "lockd"}
        for name, args in THROUGHPUT_ROWS:
            results: dict[str, list[Result]] = {server: [] for server in servers}
            for _ in range(rounds):
                for server, process in servers.items():
                    if server == "glockd" and pipelined(args):
                        continue
                    results[server].append(
                        run_loadgen(
                            loadgen, modes[server], ports[server], process.pid, seconds, *args
                        )
                    )
            medians = {server: median_result(runs) for server, runs in results.items() if runs}
            print_row(name, medians["elockd"], medians.get("glockd"), medians.get("redis"), glockd)
            if rounds > 1:
                runs = "; ".join(
                    f"{server} " + ", ".join(f"{result.rps:,.0f}" for result in values)
                    for server, values in results.items()
                    if values
                )
                print(f"<!-- runs: {runs} -->", flush=True)
            cpu = ", ".join(
                f"{server} {result.rps:,.0f} req/s, {result.server_us_per_request:.2f} µs "
                f"(user {result.server_user_us_per_request:.2f})"
                for server, result in medians.items()
            )
            print(f"<!-- median runs, server CPU per request: {cpu} -->", flush=True)
    if glockd is not None:
        with contextlib.suppress(FileNotFoundError):
            (BUILD / f"glockd-{ports['glockd']}.pid").unlink()


#: bench/gcra.lua: the GCRA of ``throttle`` as a Redis script, for the Redis column.
GCRA_SCRIPT = ROOT / "bench" / "gcra.lua"
#: bench/throttlegen.c: the throttle rows' load generator (``throttle`` or EVALSHA).
THROTTLE_GENERATOR = ROOT / "bench" / "throttlegen.c"
#: The throttle rows: (name, throttlegen arguments). The first admits everything
#: (1,000,000 per second on each connection's own key); the second has 50
#: connections on 16 hot keys at 100 per second each, so that most requests get 409.
THROTTLE_ROWS = [
    (
        "throttle (own key each), 1 in flight",
        ["--conns", "50", "--pipeline", "1", "--keys", "0", "--count", "1000000", "--period", "1"],
    ),
    (
        "throttle hot (16 keys, mostly 409), 1 in flight",
        ["--conns", "50", "--pipeline", "1", "--keys", "16", "--count", "100", "--period", "1"],
    ),
]


def throttle_rows(
    loadgen: Path, throttlegen: Path, seconds: float, rounds: int, have_redis: bool
) -> None:
    """The throttle rows beside Redis running bench/gcra.lua (EVALSHA), with elockd's
    pair row in the same table (the aim: throttle no slower than pair by more than
    10 %). Both servers are pinned to the server core for the whole table and driven
    one at a time; each round runs every row on each server in turn, so that a pair
    run and the throttle runs it is compared with are minutes apart at most, and the
    ratio to pair is also given per round (its median), which a neighbour's load
    moves less than the medians of separate rows."""
    print()
    print(
        f"# throttle: {rounds} round(s) of {seconds:g} s per server and row, rows in turn "
        "within each round; medians"
        if rounds > 1
        else f"# throttle: {seconds:g} s per server and row"
    )
    print(
        "| workload (50 connections) | elockd req/s | p50 / p99 µs | server CPU µs/req | "
        "CPU s loadgen / server | RSS MiB | Redis+GCRA req/s | to Redis |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ports = {name: free_port() for name in ("elockd", "redis")}
    pair_name, pair_args = THROUGHPUT_ROWS[0]
    # (name, generator, arguments per server): the pair row is lockbench's, as above.
    rows = [(f"{pair_name} (reference)", loadgen, {"elockd": pair_args, "redis": pair_args})]
    for name, args in THROTTLE_ROWS:
        rows.append(
            (name, throttlegen, {"elockd": args, "redis": [*args, "--script", str(GCRA_SCRIPT)]})
        )
    results: dict[str, dict[str, list[Result]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {
            "elockd": stack.enter_context(running(elockd_command(ports["elockd"]), ports["elockd"]))
        }
        if have_redis:
            servers["redis"] = stack.enter_context(
                running(redis_command(ports["redis"]), ports["redis"])
            )
        modes = {"elockd": "lockd", "redis": "redis"}
        for name, _, _ in rows:
            results[name] = {server: [] for server in servers}
        for _ in range(rounds):
            for name, generator, per_server in rows:
                for server, process in servers.items():
                    mode, port, arguments = modes[server], ports[server], per_server[server]
                    results[name][server].append(
                        run_loadgen(generator, mode, port, process.pid, seconds, *arguments)
                    )
    for name, _, _ in rows:
        print_throttle_row(name, results[name], rounds)
    pair = results[rows[0][0]]["elockd"]
    for name, _ in THROTTLE_ROWS:
        runs = results[name]["elockd"]
        per_round = sorted(run.rps / base.rps for run, base in zip(runs, pair, strict=True))
        cpu, pair_cpu = (median_result(r).server_us_per_request for r in (runs, pair))
        print(
            f"elockd {name.split(' (')[0]} to pair, this run (aim: at least 0.90x): "
            f"{median_result(runs).rps / median_result(pair).rps:.2f}x of the medians, "
            f"{per_round[(len(per_round) - 1) // 2]:.2f}x the median of the rounds' ratios "
            f"({', '.join(f'{ratio:.2f}' for ratio in per_round)}); server CPU per request "
            f"{cpu:.2f} µs, pair's {pair_cpu:.2f} µs",
            flush=True,
        )


def print_throttle_row(name: str, results: dict[str, list[Result]], rounds: int) -> None:
    """A row of the throttle table, its runs and what each server answered."""
    row = {server: median_result(runs) for server, runs in results.items()}
    print_row(name, row["elockd"], None, row.get("redis"))
    if rounds > 1:
        runs = "; ".join(
            f"{server} " + ", ".join(f"{result.rps:,.0f}" for result in values)
            for server, values in results.items()
        )
        print(f"<!-- runs: {runs} -->", flush=True)
    notes = ", ".join(
        f"{server} {result.server_us_per_request:.2f} µs CPU/req"
        + (
            f", admitted {int(result.extra['admitted']):,} / "
            f"limited {int(result.extra['limited']):,}"
            if "admitted" in result.extra
            else ""
        )
        for server, result in row.items()
    )
    print(f"<!-- median runs: {notes} -->", flush=True)


def at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}")
        return value

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each row")
    parser.add_argument("--loadgen", type=Path, help="a built load generator binary")
    parser.add_argument(
        "--loadgen-src",
        type=Path,
        default=Path(os.environ.get("LOADGEN_SRC", ROOT.parent / "shared" / "tools" / "lockbench")),
        help="folder holding the load generator's one C source file ($LOADGEN_SRC)",
    )
    parser.add_argument("--hold-conns", type=int, default=10_000)
    parser.add_argument("--hold-locks", type=int, default=100, help="locks per connection")
    parser.add_argument("--waiters", type=int, default=10_000)
    parser.add_argument(
        "--watchers",
        type=at_least(1),
        default=100,
        help="watchers row: 'watch' streams on prefixes the pair row never touches",
    )
    parser.add_argument("--leases", type=int, default=100_000)
    parser.add_argument(
        "--rounds",
        type=at_least(1),
        default=1,
        help="throughput and throttle rows: runs per server, in turn; the tables show medians",
    )
    parser.add_argument(
        "--glockd",
        type=Path,
        metavar="BINARY",
        help="throughput rows: also run this glockd binary (built to bind 127.0.0.1) "
        "and print elockd's ratio to it",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="throughput rows: also run bench/floor.py (elockd's I/O on trio, nothing "
        "behind it); its figures are in the notes under each row",
    )
    parser.add_argument(
        "--burst-conns",
        type=at_least(1),
        default=10_000,
        help="new connections in the burst row",
    )
    groups = [
        "throughput",
        "throttle",
        "burst",
        "hold",
        "features",
        "watchers",
        "scrape",
        "websocket",
        "etcd",
    ]
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=groups, help="row groups to leave out"
    )
    parser.add_argument("--only", nargs="*", choices=groups, help="run only these row groups")
    parser.add_argument(
        "--etcd-clients",
        type=at_least(1),
        nargs="+",
        default=[16, 64],
        metavar="C",
        help="concurrent clients in the etcd load rows, one row per count (half on each "
        "node in the 2-node rows); the hand-off row uses the first",
    )
    parser.add_argument(
        "--etcd-burst",
        type=at_least(0),
        default=10_000,
        metavar="N",
        help="connections in the etcd burst row, each taking one lock "
        "(0: no burst, idle or kill rows)",
    )
    parser.add_argument(
        "--etcd-burst-wait",
        type=at_least(1),
        default=60,
        metavar="SECONDS",
        help="how long the burst row waits for its replies before counting the rest as none",
    )
    parser.add_argument(
        "--etcd-idle-seconds",
        type=at_least(1),
        default=10,
        metavar="SECONDS",
        help="length of the etcd idle row's window while the burst's sessions hold",
    )
    parser.add_argument(
        "--etcd-session-ttl",
        type=at_least(2),
        default=5,
        help="--session-ttl of the etcd-backed nodes",
    )
    options = parser.parse_args()
    run = {group for group in options.only or groups if group not in options.skip}
    if "etcd" in run and shutil.which("etcd") is None:
        if options.only:
            raise SystemExit("etcd is not installed (apt-get install etcd-server)")
        print("etcd not installed: no etcd rows (apt-get install etcd-server)")
        run.discard("etcd")

    print(f"# elockd bench, {options.seconds:g} s per row; {time.strftime('%Y-%m-%d %H:%M')}")
    if run - {"etcd"}:
        pinned_rows(options, run)
    if "etcd" in run:
        etcd_rows(
            options.seconds,
            options.etcd_clients,
            options.etcd_session_ttl,
            options.etcd_burst,
            options.etcd_burst_wait,
            options.etcd_idle_seconds,
        )


def pinned_rows(options: argparse.Namespace, run: set[str]) -> None:
    """The rows against the in-memory server: pinned, with the C generator."""
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin server and load generator")
    loadgen = options.loadgen or build_loadgen(options.loadgen_src)
    have_redis = shutil.which("redis-server") is not None
    if not have_redis:
        print("redis-server not installed: no Redis column (apt-get install redis-server)")
    print(f"server on core {SERVER_CORE}, load generator on core {LOADGEN_CORE}")
    elockd_port = free_port()
    if "throughput" in run:
        throughput_rows(
            loadgen, options.seconds, options.rounds, options.glockd, have_redis, options.floor
        )
    if "throttle" in run:
        throttlegen = compile_c(THROTTLE_GENERATOR, "throttlegen")
        throttle_rows(loadgen, throttlegen, options.seconds, options.rounds, have_redis)
    if "burst" in run:
        with running(elockd_command(elockd_port), elockd_port) as ours:
            burst = burst_row(elockd_port, options.burst_conns)
        print()
        print_burst(burst)
    if "features" in run:
        # Two servers, one plain and one with the waiters and leases, measured in
        # turn three times each: the median ratio resists a noisy neighbour.
        loaded_port = free_port()
        pair = THROUGHPUT_ROWS[0][1]
        with (
            running(elockd_command(elockd_port), elockd_port) as plain_server,
            running(elockd_command(loaded_port), loaded_port) as loaded_server,
            waiters_and_leases(loaded_port, options.waiters, options.leases),
        ):
            plain_runs, loaded_runs = [], []
            for _ in range(3):
                plain_runs.append(
                    run_loadgen(
                        loadgen, "lockd", elockd_port, plain_server.pid, options.seconds, *pair
                    )
                )
                loaded_runs.append(
                    run_loadgen(
                        loadgen, "lockd", loaded_port, loaded_server.pid, options.seconds, *pair
                    )
                )
        plain = sorted(plain_runs, key=lambda r: r.rps)[1]
        loaded = sorted(loaded_runs, key=lambda r: r.rps)[1]
        print()
        print(
            f"Feature cost (pair, 1 in flight, median of 3 alternating runs): plain "
            f"{plain.rps:,.0f} req/s ({plain.server_us_per_request:.2f} µs CPU/req); with "
            f"{options.waiters:,} waiters queued and {options.leases:,} leases pending "
            f"{loaded.rps:,.0f} req/s ({loaded.server_us_per_request:.2f} µs CPU/req): "
            f"{loaded.rps / plain.rps:.2f}x"
        )
    if "watchers" in run:
        watchers_row(loadgen, options.seconds, options.watchers, max(3, options.rounds))
    if "scrape" in run:
        scrape_rows(loadgen, options.seconds)
    if "websocket" in run:
        websocket_row(options.seconds)
    if "hold" in run:
        with running(elockd_command(elockd_port), elockd_port) as ours:
            hold = hold_row(elockd_port, ours.pid, options.hold_conns, options.hold_locks)
        print()
        print(
            f"Hold: {options.hold_conns:,} connections x {options.hold_locks} locks "
            f"(half shared) = {hold['locks']:,.0f} locks, established in "
            f"{hold['establish_s']:.1f} s; RSS {hold['rss_idle_mib']:.0f} MiB idle -> "
            f"{hold['rss_held_mib']:.0f} MiB held = {hold['bytes_per_lock']:.0f} bytes per lock; "
            "all dropped at once: every sampled lock free after "
            f"{hold['all_free_s'] * 1000:.0f} ms, "
            f"probe p99 {hold['probe_p99_ms']:.1f} ms, max {hold['probe_max_ms']:.1f} ms "
            f"over {hold['probes']:,.0f} probes"
        )


@contextlib.contextmanager
def watching_elsewhere(port: int, count: int) -> Iterator[None]:
    """``count`` connections watching prefixes the pair row never touches (each
    synced before the runs start, and open until they end)."""
    sockets = connect_many(port, count)
    try:
        for n, sock in enumerate(sockets):
            sock.sendall(b"watch elsewhere/%d/\n" % n)
        buffer = bytearray()
        for sock in sockets:
            lines = read_lines(sock, 2, buffer)
            assert lines == [b"200 Watching", b"SYNCED"], lines
            buffer.clear()
        yield
    finally:
        for sock in sockets:
            sock.close()


def watchers_row(loadgen: Path, seconds: float, watchers: int, rounds: int) -> None:
    """The pair row on two servers, one without watchers and one with ``watchers`` on
    other prefixes, run in turn ``rounds`` times (issue 28's aim: at least 0.95x)."""
    plain_port, watched_port = free_port(), free_port()
    pair = THROUGHPUT_ROWS[0][1]
    with (
        running(elockd_command(plain_port), plain_port) as plain_server,
        running(elockd_command(watched_port), watched_port) as watched_server,
        watching_elsewhere(watched_port, watchers),
    ):
        plain_runs, watched_runs = [], []
        for _ in range(rounds):
            plain_runs.append(
                run_loadgen(loadgen, "lockd", plain_port, plain_server.pid, seconds, *pair)
            )
            watched_runs.append(
                run_loadgen(loadgen, "lockd", watched_port, watched_server.pid, seconds, *pair)
            )
    plain, watched = median_result(plain_runs), median_result(watched_runs)
    ratios = sorted(w.rps / p.rps for w, p in zip(watched_runs, plain_runs, strict=True))
    print()
    print(
        f"Watchers (pair, 1 in flight, median of {rounds} alternating runs): none "
        f"{plain.rps:,.0f} req/s ({plain.server_us_per_request:.2f} µs CPU/req); "
        f"{watchers} on other prefixes {watched.rps:,.0f} req/s "
        f"({watched.server_us_per_request:.2f} µs CPU/req): {watched.rps / plain.rps:.2f}x "
        f"(rounds' ratios {', '.join(f'{r:.2f}' for r in ratios)}; aim: at least 0.95x)"
    )


def websocket_row(seconds: float, clients: int = 16) -> None:
    """bench/websocket.py's row: g/r cycles over WebSocket beside TCP, one driver,
    alternating three times (the server on core 0, the driver on core 1)."""
    port, http_port = free_port(), free_port()
    driver = [sys.executable, str(ROOT / "bench" / "websocket.py")]
    rates: dict[str, list[float]] = {"tcp": [], "websocket": []}
    server_us: dict[str, list[float]] = {"tcp": [], "websocket": []}
    with running(elockd_command(port, http_port), port) as server:
        for _ in range(3):
            for kind, target in (("tcp", port), ("websocket", http_port)):
                before = cpu_seconds(server.pid)
                arguments = [kind, str(target), str(clients), str(seconds)]
                done = subprocess.run(
                    ["taskset", "-c", LOADGEN_CORE, *driver, *arguments],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rate = float(done.stdout.strip())
                rates[kind].append(rate)
                server_us[kind].append((cpu_seconds(server.pid) - before) / (rate * seconds) * 1e6)
    tcp, ws = (sorted(rates[kind])[1] for kind in ("tcp", "websocket"))
    tcp_us, ws_us = (sorted(server_us[kind])[1] for kind in ("tcp", "websocket"))
    print()
    print(
        f"WebSocket ({clients} clients, g/r cycles, one request in flight, median of 3, one "
        f"Python driver for both): TCP {tcp:,.0f} cycles/s ({tcp_us:.0f} µs server CPU per "
        f"cycle), WebSocket {ws:,.0f} cycles/s ({ws_us:.0f} µs) = {ws / tcp:.2f}x"
    )


def scrape_rows(loadgen: Path, seconds: float) -> None:
    """bench/scrape.py's rows: two servers holding a million locks each (one
    rendering /metrics on every scrape, one with the default cache)."""
    sys.path.insert(0, str(ROOT))
    from bench.scrape import Running, print_scrape_rows

    ports = [free_port() for _ in range(4)]
    uncached_command = elockd_command(ports[0], ports[1], "--metrics-cache", "0")
    uncached_command[uncached_command.index("--max-holds") + 1] = "1000000"
    cached_command = elockd_command(ports[2], ports[3])
    cached_command[cached_command.index("--max-holds") + 1] = "1000000"
    with (
        running(uncached_command, ports[0]) as uncached,
        running(cached_command, ports[2]) as cached,
    ):

        def pair() -> float:
            args = THROUGHPUT_ROWS[0][1]
            return run_loadgen(loadgen, "lockd", ports[2], cached.pid, seconds, *args).rps

        print_scrape_rows(
            Running(uncached.pid, ports[0], ports[1]),
            Running(cached.pid, ports[2], ports[3]),
            pair,
            cpu_seconds,
        )


if __name__ == "__main__":
    main()
