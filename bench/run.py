"""``make bench``: elockd beside Redis, side by side in one run, pinned to cores.

Every throughput row runs the same C load generator against elockd and, when
``redis-server`` is installed, against Redis (``SET NX PX`` / ``DEL``), with the
server on core 0 and the generator on core 1 (``taskset``), and prints the ratio.
Absolute numbers move with the machine; the ratios are what to compare.

The generator is an external C program (epoll, one loop per thread) built from
source with ``cc``: ``--loadgen-src DIR`` (or ``$LOADGEN_SRC``) names the folder of
its single ``.c`` file; ``--loadgen BINARY`` uses a built one. Its CPU time is
printed next to the server's, to show it is not the bottleneck.

The hold row (10,000 connections x 100 locks, half of them shared) and the
feature-cost row (10,000 waiters and 100,000 leases pending) are driven from this
script with plain sockets, because they measure the server's memory and its
disconnect work, not request rate.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "bench" / ".build"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SERVER_CORE, LOADGEN_CORE = "0", "1"


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """user + system CPU of a process so far, from /proc (utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


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
def running(command: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        ["taskset", "-c", SERVER_CORE, *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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


def elockd_command(port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "elockd",
        "--port",
        str(port),
        "--metrics-port",
        str(free_port()),  # on, as by default: its histogram hooks run per release
        "--max-connections",
        "20000",
        "--max-holds",
        "100000",
        "--log-level",
        "warning",
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
    BUILD.mkdir(parents=True, exist_ok=True)
    binary = BUILD / "loadgen"
    if not binary.exists() or binary.stat().st_mtime < sources[0].stat().st_mtime:
        compiler = os.environ.get("CC", "cc")
        subprocess.run(
            [compiler, "-O2", "-std=gnu11", "-pthread", "-o", str(binary), str(sources[0])],
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

    @property
    def server_us_per_request(self) -> float:
        return self.server_cpu / self.requests * 1e6 if self.requests else float("nan")


def run_loadgen(
    loadgen: Path, mode: str, port: int, server_pid: int, seconds: float, *args: str
) -> Result:
    before_server = cpu_seconds(server_pid)
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
    server_cpu = cpu_seconds(server_pid) - before_server
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
    with socket.create_connection(("127.0.0.1", port), timeout=30) as check:
        check.sendall(b"q\n")
        stats = b""
        while b"END\r\n" not in stats:
            stats += check.recv(65536)
    values = dict(line.split(b": ") for line in stats.split(b"\r\n") if b": " in line)
    if int(values[b"waiting"]) != waiters or int(values[b"leases"]) != per_owner * len(owners):
        raise RuntimeError(f"setup incomplete: {values}")
    try:
        yield
    finally:
        for sock in [holder, *queued, *owners]:
            sock.close()


# ----------------------------------------------------------------- report


THROUGHPUT_ROWS = [
    ("pair, 1 in flight", ["--workload", "pair", "--conns", "50", "--pipeline", "1"]),
    ("contend (16 keys), 1 in flight", ["--workload", "contend", "--keys", "16", "--conns", "50"]),
    ("shared (16 keys), 1 in flight", ["--workload", "shared", "--keys", "16", "--conns", "50"]),
    ("pair, 16 in flight", ["--workload", "pair", "--conns", "50", "--pipeline", "16"]),
]


def print_row(name: str, ours: Result, redis: Result | None) -> None:
    ratio = f"{ours.rps / redis.rps:.2f}x" if redis else "-"
    redis_rps = f"{redis.rps:,.0f}" if redis else "-"
    print(
        f"| {name} | {ours.rps:,.0f} | {ours.p50_us:,.0f} / {ours.p99_us:,.0f} | "
        f"{ours.server_us_per_request:.2f} | {ours.loadgen_cpu:.1f} / {ours.server_cpu:.1f} | "
        f"{ours.rss_kib / 1024:.0f} | {redis_rps} | {ratio} |",
        flush=True,
    )


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
    parser.add_argument("--leases", type=int, default=100_000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "hold", "features"])
    options = parser.parse_args()

    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin server and load generator")
    loadgen = options.loadgen or build_loadgen(options.loadgen_src)
    have_redis = shutil.which("redis-server") is not None
    if not have_redis:
        print("redis-server not installed: no Redis column (apt-get install redis-server)")
    print(
        f"# elockd bench, {options.seconds:g} s per row, server on core {SERVER_CORE}, "
        f"load generator on core {LOADGEN_CORE}; {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print()
    print(
        "| workload (50 connections) | elockd req/s | p50 / p99 µs | server CPU µs/req | "
        "CPU s loadgen / server | RSS MiB | Redis req/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    elockd_port, redis_port = free_port(), free_port()
    plain_pair: Result | None = None
    if "throughput" not in options.skip:
        with (
            running(elockd_command(elockd_port), elockd_port) as ours,
            contextlib.ExitStack() as stack,
        ):
            theirs = (
                stack.enter_context(running(redis_command(redis_port), redis_port))
                if have_redis
                else None
            )
            for name, args in THROUGHPUT_ROWS:
                ours_result = run_loadgen(
                    loadgen, "lockd", elockd_port, ours.pid, options.seconds, *args
                )
                redis_result = (
                    run_loadgen(loadgen, "redis", redis_port, theirs.pid, options.seconds, *args)
                    if theirs
                    else None
                )
                print_row(name, ours_result, redis_result)
                if plain_pair is None:
                    plain_pair = ours_result
    if "features" not in options.skip:
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
    if "hold" not in options.skip:
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


if __name__ == "__main__":
    main()
