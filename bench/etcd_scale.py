"""The scale rows of ``make bench``'s etcd group: a node at the in-memory server's scale.

A cluster node should take what one in-memory server takes (docs/cluster.md,
"Scale"), so these rows measure exactly that, on a real 3-member etcd:

* **burst**: N connections (``--etcd-burst``, default 10,000) opened to one node as
  fast as this process can, each sending ``g burst:<i>`` on a key of its own. Every
  reply is sorted by kind (``1 Got Lock``, ``0 Backend Unavailable``, any other
  text, the connection closed before a reply, no reply within ``--etcd-burst-wait``),
  with the time until every connection was up and until the last one was answered.
* **idle**: then, for ``--etcd-idle-seconds`` while those sessions hold and do
  nothing, the CPU of the etcd leader and of the node, and etcd's commits, fsyncs
  and lease renewals per second: what holding costs when nobody asks for anything.
  Meanwhile every burst connection is watched, and afterwards the node's ``q``
  counters and a sample of the granted keys (``i K`` from another connection) show
  whether the sessions are still alive.

Both run after the load rows on an etcd cluster and a node of their own, so the
burst disturbs no other row and the idle row sees no other node's traffic. The
node has default flags but ``--max-connections`` (raised to N + 100 when N + 100
is over the default, so the burst itself is not refused) and ``--session-ttl``
(``--etcd-session-ttl``, as the load rows' nodes). The burst is driven from one
epoll loop in this process rather than threads: 10,000 threads would measure this
script, not the node. Also beside etcd: :func:`print_beside_etcd`, the load rows'
cycles/s next to etcd alone's at the same client count.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import re
import resource
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.run import (
    COMMITS,
    LoopResult,
    Window,
    box_busy_seconds,
    cpu_seconds,
    etcd_node_command,
    etcd_samples,
    free_port,
    memory_kib,
    percentile,
    process_counters,
    q_counters,
    raise_file_limit,
    running,
    started_etcd,
)
from elockd.protocol.config import Config

GRANTED = "1 Got Lock"
CLOSED = "<closed before a reply>"
#: Known reply kinds first, in this order, in the printed row; anything else after.
KINDS = (GRANTED, "0 Backend Unavailable")
#: Granted keys checked with ``i K`` after the idle window (pipelined on one connection).
SAMPLE = 50
#: Seconds between the burst's end and the idle window, so the window measures
#: holding, not the tail of the burst (connections closed meanwhile still count).
SETTLE = 2.0
#: etcd's own rates in the idle row, from the leader's /metrics: raft commits, WAL
#: fsyncs (fewer than commits when etcd batches) and lease keepalives it served.
LEADER_RATES = {
    "commits": COMMITS,
    "fsyncs": "etcd_disk_wal_fsync_duration_seconds_count",
    "renewals": "etcd_debugging_lease_renewed_total",
}


@dataclass
class Caller:
    """One burst connection: when its ``g`` went out, what came back, and whether the
    node closed it later (a lost session closes its connection)."""

    index: int
    sock: socket.socket
    sent_at: float = 0.0
    answered_at: float = 0.0
    buffer: bytes = b""
    reply: str = ""
    open: bool = True
    closed_by_node: bool = False
    later_bytes: int = 0


class Burst:
    """Opens the connections and reads their first replies from one selector; then
    keeps them open (the sessions hold) and watches them for the node closing them."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.selector = selectors.DefaultSelector()
        self.callers: list[Caller] = []
        self.pending = 0
        self.started = self.last_sent = self.last_settled = 0.0

    def run(self, wait: float) -> None:
        """Connect all, sending each ``g`` as soon as its connection is up; stop
        waiting for replies ``wait`` seconds after the first connect."""
        raise_file_limit(self.count + 1000)
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if files < self.count + 200:  # the node inherits the same hard limit
            raise SystemExit(
                f"--etcd-burst {self.count}: needs {self.count + 200} open files, this "
                f"process may have {files} (ulimit -Hn)"
            )
        self.started = time.monotonic()
        for index in range(self.count):
            self._connect(index)
            if index % 256 == 255:  # serve the early ones while the rest connect
                self._pump(0)
        deadline = self.started + wait
        while self.pending and (left := deadline - time.monotonic()) > 0:
            self._pump(min(left, 1.0))
        for caller in self.callers:
            if not caller.reply:
                self._settle(caller, f"<no reply within {wait:g} s>", close=True)

    def watch(self, seconds: float) -> None:
        """For ``seconds``, notice every burst connection the node closes (or writes
        to: nothing should come unasked)."""
        for caller in self.callers:
            if caller.open:
                self.selector.register(caller.sock, selectors.EVENT_READ, caller)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for key, _ in self.selector.select(min(left, 1.0)):
                caller = key.data
                chunk = self._recv(caller)
                if chunk is None:
                    continue
                if chunk:
                    caller.later_bytes += len(chunk)
                    continue
                caller.closed_by_node = True
                caller.open = False
                self.selector.unregister(caller.sock)
                caller.sock.close()
        for caller in self.callers:
            if caller.open:
                self.selector.unregister(caller.sock)

    def close(self) -> None:
        for caller in self.callers:
            if caller.open:
                caller.sock.close()
                caller.open = False
        self.selector.close()

    # ------------------------------------------------------------ its loop

    def _connect(self, index: int) -> None:
        try:
            sock = socket.socket()
        except OSError as error:  # EMFILE: the hard RLIMIT_NOFILE is below the burst
            raise RuntimeError(f"burst: no socket for connection {index}: {error}") from None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        caller = Caller(index, sock)
        self.callers.append(caller)
        code = sock.connect_ex(("127.0.0.1", self.port))
        if code not in (0, errno.EINPROGRESS):
            caller.reply = f"<connect failed: {errno.errorcode.get(code, code)}>"
            caller.open = False
            sock.close()
            return
        self.selector.register(sock, selectors.EVENT_WRITE, caller)
        self.pending += 1

    def _pump(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            caller = key.data
            if caller.sent_at:
                self._read(caller)
            else:
                self._send(caller)

    def _send(self, caller: Caller) -> None:
        code = caller.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self._settle(caller, f"<connect failed: {errno.errorcode.get(code, code)}>", True)
            return
        caller.sent_at = self.last_sent = time.monotonic()
        try:
            caller.sock.send(b"g burst:%d\n" % caller.index)
        except OSError as error:
            self._settle(caller, f"<send failed: {type(error).__name__}>", close=True)
            return
        self.selector.modify(caller.sock, selectors.EVENT_READ, caller)

    def _read(self, caller: Caller) -> None:
        chunk = self._recv(caller)
        if chunk is None:
            return
        if not chunk:
            self._settle(caller, CLOSED, close=True)
            return
        caller.buffer += chunk
        if b"\n" in caller.buffer:
            line, _, rest = caller.buffer.partition(b"\n")
            caller.answered_at = time.monotonic()
            caller.later_bytes += len(rest)
            self._settle(caller, line.rstrip(b"\r").decode("ascii", "replace"), close=False)

    @staticmethod
    def _recv(caller: Caller) -> bytes | None:
        """A chunk, b"" for the end of the connection (a reset too), None for nothing yet."""
        try:
            return caller.sock.recv(4096)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _settle(self, caller: Caller, outcome: str, close: bool) -> None:
        caller.reply = outcome
        self.last_settled = time.monotonic()
        self.selector.unregister(caller.sock)
        self.pending -= 1
        if close:
            caller.open = False
            caller.sock.close()


# ------------------------------------------------------------ what to read


def ask_each(
    port: int, verb: bytes, keys: list[int], timeout: float = 30
) -> collections.Counter[str]:
    """``VERB burst:K`` for each of ``keys``, pipelined on one fresh connection,
    replies counted by text (``i``: ``1 Locked`` while its burst session still
    holds the key; ``g``: ``1 Got Lock`` once it is free)."""
    counts: collections.Counter[str] = collections.Counter()
    lines: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"".join(b"%s burst:%d\n" % (verb, key) for key in keys))
        data = b""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(OSError):
            while data.count(b"\n") < len(keys) and time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        lines = data.split(b"\n")[: len(keys)]
    counts.update(line.rstrip(b"\r").decode("ascii", "replace") for line in lines if line)
    counts["<no answer>"] += len(keys) - sum(counts.values())
    return +counts


def log_events(path: Path) -> dict[str, tuple[int, str]]:
    """The node's log (JSON lines) by event, numbers and ids masked so that lines
    differing only in them count together: event -> (lines, the first such line)."""
    events: dict[str, tuple[int, str]] = {}
    if not path.exists():
        return events
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            text = f"{record.get('level', '?')}: {record.get('event', '?')}"
        except (ValueError, AttributeError):
            text = f"not JSON: {line}"
        event = re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", text)[:120]
        lines, first = events.get(event, (0, line))
        events[event] = (lines + 1, first)
    return events


def print_log_events(path: Path, most: int = 6) -> None:
    """The node's log in a few lines: the most frequent events, each with its count
    and the first line that had it."""
    events = log_events(path)
    print()
    print(f"The burst node's log: {sum(n for n, _ in events.values()):,} lines.")
    for event, (lines, first) in sorted(events.items(), key=lambda item: -item[1][0])[:most]:
        print(f"    {lines:,} x {event}\n        first: {first[:300]}")
    print(flush=True)


def counted(counts: collections.Counter[str], kinds: tuple[str, ...] = ()) -> str:
    """``text xN`` for every kind not in ``kinds``, most frequent first."""
    rest = [(text, n) for text, n in counts.most_common() if text not in kinds]
    return "; ".join(f"`{text}` x{n:,}" for text, n in rest) or "none"


# ----------------------------------------------------------------- the rows


def scale_rows(ttl: int, count: int, wait: float, idle: float) -> None:
    """The burst row and the idle row, on a fresh 3-member etcd and a node of their
    own (module docstring): the load rows' nodes and keys cost it nothing."""
    with contextlib.ExitStack() as stack:
        base, cluster = started_etcd(stack, "scale")
        port = free_port()
        command = etcd_node_command(port, cluster.endpoints, "/bench-burst/", ttl)
        command += ["--log-format", "json"]  # for print_log_events
        if count + 100 > Config().max_connections:
            command += ["--max-connections", str(count + 100)]
        log = base / "burst-node.log"
        node = stack.enter_context(running(command, port, core=None, log=log))
        leader = cluster.leader()
        pids = {name: m.process.pid for name, m in cluster.members.items() if m.process}
        cpu: dict[str, Callable[[], float]] = {
            **process_counters("node", node.pid),
            "leader": lambda: cpu_seconds(pids[leader]),
            "etcd": lambda: sum(cpu_seconds(pid) for pid in pids.values()),
            "script": time.process_time,
            "box": box_busy_seconds,
        }
        # A second node, joined before the burst, on which the killed node's keys
        # must become free (the kill row).
        heir_port = free_port()
        heir_command = etcd_node_command(heir_port, cluster.endpoints, "/bench-burst/", ttl)
        stack.enter_context(running(heir_command, heir_port, core=None))
        burst = Burst(port, count)
        stack.callback(burst.close)
        with Window(cpu) as during:
            burst.run(wait)
        print_burst_row(burst, during, wait)
        burst.watch(SETTLE)
        holding = sum(1 for c in burst.callers if c.open and c.reply == GRANTED)
        leader_url = cluster.members[leader].url
        with Window(cpu) as window:
            before = etcd_samples(leader_url)
            burst.watch(idle)
            after = etcd_samples(leader_url)
        alive = [c.index for c in burst.callers if c.open and c.reply == GRANTED]
        sample = alive[:: max(1, len(alive) // SAMPLE)][:SAMPLE]
        IdleRow(
            burst=burst,
            holding=holding,
            window=window,
            etcd_rates={
                name: (after[metric] - before[metric]) / window.seconds
                for name, metric in LEADER_RATES.items()
                if metric in before and metric in after
            },
            counters=q_counters(port),
            sample=sample,
            locked=ask_each(port, b"i", sample),
            rss_kib=memory_kib(node.pid),
            leaders=(leader, cluster.leader()),
        ).print()
        print_log_events(log)
        print_kill_row(node, heir_port, sample, ttl)


def print_kill_row(
    node: subprocess.Popen[bytes], heir_port: int, sample: list[int], ttl: int
) -> None:
    """SIGKILL the burst node while its sessions hold, and time how long until the
    other node counts none of their locks and grants each sampled key: etcd frees
    them when the dead node's lease runs out (the issue asks for TTL + 2 s)."""
    holding = q_counters(heir_port)["locks"]
    killed = time.monotonic()
    node.send_signal(signal.SIGKILL)
    node.wait()
    freed_at = None
    while time.monotonic() - killed < 3 * ttl + 10:
        if q_counters(heir_port)["locks"] == 0:
            freed_at = time.monotonic() - killed
            break
        time.sleep(0.05)
    granted = ask_each(heir_port, b"g", sample)
    freed = "not within 3 TTL + 10 s" if freed_at is None else f"{freed_at:.2f}"
    print(
        f"\nKill: the burst node SIGKILLed while {holding:,} locks were held (the other "
        f"node's count); all free after {freed} s (--session-ttl {ttl}, so TTL + 2 = "
        f"{ttl + 2} s); then {granted[GRANTED]} of {len(sample)} sampled keys `g` "
        f"{GRANTED!r} on the other node."
    )


def print_burst_row(burst: Burst, during: Window, wait: float) -> None:
    replies = collections.Counter(caller.reply for caller in burst.callers)
    up = f"{burst.last_sent - burst.started:.2f}" if burst.last_sent else "-"  # none got up
    latencies = [c.answered_at - c.sent_at for c in burst.callers if c.answered_at]
    ms = "-"
    if latencies:
        ms = " / ".join(
            f"{value * 1000:,.0f}"
            for value in (
                percentile(latencies, 0.5),
                percentile(latencies, 0.99),
                max(latencies),
            )
        )
    print()
    print(
        f"Burst: {burst.count:,} connections to one node (a node and an etcd cluster of their "
        "own, after every other row), "
        f"each sending `g burst:<i>` on its own key as soon as it is up; replies waited for "
        f"up to {wait:g} s. Times from the first connect; a reply's time from its `g`. CPU "
        "over the burst, in seconds: node / etcd's 3 members / this script."
    )
    print()
    print(
        "| row | connections | all up s | last settled s | `1 Got Lock` | "
        "`0 Backend Unavailable` | reply p50 / p99 / max ms | CPU s node / etcd / script | "
        "everything else |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| burst, 1 node | {burst.count:,} | {up} | "
        f"{burst.last_settled - burst.started:.2f} | {replies[KINDS[0]]:,} | "
        f"{replies[KINDS[1]]:,} | {ms} | {during.grown('node'):.1f} / "
        f"{during.grown('etcd'):.1f} / {during.grown('script'):.1f} | "
        f"{counted(replies, KINDS)} |",
        flush=True,
    )


@dataclass
class IdleRow:
    """What the idle row shows: the window's CPU and etcd rates, which burst
    connections the node closed, and the node's own view of its sessions after it."""

    burst: Burst
    holding: int  # granted burst connections still open when the window began
    window: Window
    etcd_rates: dict[str, float]
    counters: dict[str, int]  # the node's q after the window
    sample: list[int]
    locked: collections.Counter[str]  # replies to i K over the sample
    rss_kib: int
    leaders: tuple[str, str]  # the etcd leader before and after

    def print(self) -> None:
        burst, window, locked = self.burst, self.window, self.locked
        closed = [c for c in burst.callers if c.closed_by_node]
        closed_holders = sum(1 for c in closed if c.reply == GRANTED)
        chatter = sum(1 for c in burst.callers if c.later_bytes)
        before, after = self.leaders
        print()
        print(
            f"Idle: {SETTLE:g} s after the burst, its connections kept open and silent for "
            f"{window.seconds:.1f} s, {self.holding:,} of them holding their lock. CPU in % of "
            "one core (node: + runnable but waiting for a core); etcd rates from the leader's "
            "/metrics. Closed by the node: burst connections it closed from the end of the "
            "burst to the end of the window. Then the node's `q` (its sessions include the "
            f"`q` connection) and `i K` from another connection on {len(self.sample)} of the "
            "granted keys whose connection is still open."
        )
        print()
        print(
            "| row | sessions holding | etcd leader CPU % | etcd 3 members CPU % | node CPU % | "
            "etcd commits / fsyncs / lease renewals per s | closed by the node (holders) | "
            "q sessions / sessions_lost / backend_unavailable | sampled keys `1 Locked` | "
            "node RSS MiB | notes |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        rates = " / ".join(
            f"{self.etcd_rates[name]:,.0f}" if name in self.etcd_rates else "-"
            for name in LEADER_RATES
        )
        notes = [
            f"etcd leader {before}" + ("" if before == after else f", then {after}"),
            f"box {window.rate('box') * 100:.0f} %",
            f"script {window.rate('script') * 100:.0f} %",
        ]
        if chatter:
            notes.append(f"{chatter} connections got unasked bytes")
        if set(locked) - {"1 Locked"}:
            notes.append(f"sample: {counted(locked, ('1 Locked',))}")
        counters = self.counters
        print(
            f"| idle, 1 node | {self.holding:,} | {window.rate('leader') * 100:.0f} | "
            f"{window.rate('etcd') * 100:.0f} | {window.rate('node') * 100:.0f} "
            f"(+{window.rate('node queued') * 100:.0f}) | {rates} | {len(closed):,} "
            f"({closed_holders:,}) | {counters.get('sessions', -1):,} / "
            f"{counters.get('sessions_lost', -1):,} / "
            f"{counters.get('backend_unavailable', -1):,} | "
            f"{locked['1 Locked']} of {len(self.sample)} | {self.rss_kib / 1024:.0f} | "
            f"{'; '.join(notes)} |",
            flush=True,
        )


def print_beside_etcd(results: Mapping[tuple[str, int], LoopResult]) -> None:
    """The own-key rows' cycles/s beside etcd alone at the same client count, all from
    this run: etcd's own write rate on this box is the ceiling a node is held to."""
    print()
    print(
        "Beside etcd's own write rate, this run: a cycle is 2 etcd txns (one raft write "
        "each), so etcd alone's writes/s is about twice its cycles/s; its commits/s are "
        "what etcd's /metrics counted (lease grants and the nodes' heartbeats included). "
        "1 client on elockd: the `lock K`/`unlock K` latency row."
    )
    print()
    print(
        "| clients | 1 node cycles/s | 2 nodes cycles/s | etcd alone cycles/s | "
        "etcd alone commits/s | 1 node / 2 nodes, % of etcd alone |"
    )
    print("|---|---|---|---|---|---|")
    for (name, clients), raw in sorted(results.items(), key=lambda item: item[0][1]):
        if not name.startswith("etcd alone"):
            continue
        one = results.get(("own keys, 1 node", clients))
        if one is None and clients == 1:
            one = results.get(("latency, 1 node, `lock K`/`unlock K`", 1))
        two = results.get(("own keys, 2 nodes", clients))
        rates = [f"{row.rate:,.0f}" if row else "-" for row in (one, two)]
        shares = [
            f"{row.rate / raw.rate * 100:.0f}" if row and raw.rate else "-" for row in (one, two)
        ]
        print(
            f"| {clients} | {rates[0]} | {rates[1]} | {raw.rate:,.0f} | "
            f"{raw.rates.get('commits', float('nan')):,.0f} | {' / '.join(shares)} |",
            flush=True,
        )
