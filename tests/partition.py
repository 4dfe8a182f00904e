"""Real network partitions for a cluster of elockd nodes: the lab, the cuts, the runs.

Processes that are stopped (SIGSTOP, SIGKILL) cannot answer their clients, so they
can never confirm a hold they have lost. A node cut off from etcd can: it stays up
for its clients while etcd frees its locks. This module builds a small network out
of network namespaces (needs root and iproute2, like tests/netns.py; the cuts need
nftables):

* a switch namespace with one bridge, ``br0``;
* etcd members n1, n2, n3, nodes A and B, and a clients namespace, each joined to
  the bridge by veth pairs: one into the *back* network (etcd, 10.214.N.0/25) for
  every namespace, and one into the *front* network (clients, 10.214.N.128/25) for
  the nodes and the clients. N comes from the pid, and the addresses exist only
  inside these namespaces.

Cuts happen at the switch, so every process keeps its sockets and learns of the cut
only as a real host would: **loss** (nftables drops every frame between two sets of
switch ports, silently), **link down** (the switch's end of a veth), and **delay**
(node A reaches etcd through a proxy in its own namespace, which can hold every byte
for 2 s: netem is not in every kernel).

A run (:func:`run_scenario`) starts nodes A and B (``--session-ttl``, a fresh key
prefix) on the lab's etcd, then runs, in one trio run inside the clients namespace
(so that every time is on one clock): clients that contend for three keys with
``lock K 30``, poll ``token K`` every 0.1 s while they hold (each ``200 <token>`` is
the node confirming the hold at that moment) and ``unlock K``; an etcd watch that
records when etcd deleted each queue entry; and a script of cuts. What the clients
recorded then goes through the project's safety checker (tests/safety.py): a hold
runs from its grant to the sending of its last confirmed ``token`` poll, so two
overlapping holds of one key are two confirmed holders at once. Besides that:
confirmations sent after etcd had deleted the hold's entry, and for every hold that
node A ended by telling its client (a closed connection or a non-``200`` reply),
its *lead*: how long before B's next grant of that key the client was told.

``python -m tests.partition SCENARIO [--mode loss|down|delay] [--runs N]`` runs one
kind and prints its figures; ``python -m tests.partition pre-vote`` measures an
isolated etcd leader with and without ``--pre-vote`` (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from elockd.cluster.etcd_client import EtcdClient, prefix_end
from tests.etcd_cluster import EtcdCluster, member_status
from tests.netns import enter, ip, run_in, why_namespaces_cannot_be_made
from tests.safety import Report, check
from tests.server_process import start_server, stop_server

KEYS = ["x0", "x1", "x2"]
CLIENTS_PER_NODE = 4
POLL = 0.1  # how often a holder asks ``token K``
DELAY = 2.0  # how long the delay proxy holds every byte
#: Last octet in the back network and, for those that serve or are clients, the front.
PLACES: dict[str, tuple[int, int | None]] = {
    "n1": (11, None),
    "n2": (12, None),
    "n3": (13, None),
    "a": (21, 149),
    "b": (22, 150),
    "c": (30, 158),
}
MEMBERS = ("n1", "n2", "n3")


def why_no_lab() -> str | None:
    """None when this process can build the lab, else the reason."""
    why = why_namespaces_cannot_be_made()
    if why is None and subprocess.run(["which", "nft"], capture_output=True).returncode:
        why = "nft (nftables) is not installed"
    return why


# ------------------------------------------------------------------------ lab


@dataclass
class LabNode:
    """One elockd node inside the lab; its clients reach it at ``host:port``."""

    role: str
    process: subprocess.Popen[str]
    host: str
    port: int
    log: list[str] = field(default_factory=list)


class Lab:
    """The namespaces, the switch and the etcd members; removed by :meth:`close`
    whatever happened (processes by pid, then every namespace, which takes its
    veths along)."""

    def __init__(self, base: Path, *, pre_vote: bool = True) -> None:
        self.base = base
        self.tag = f"elp{os.getpid()}"
        self.net = f"10.214.{os.getpid() % 250 + 1}"
        self.switch = f"{self.tag}-sw"
        self.made: list[str] = []
        self.nodes: list[LabNode] = []
        self.proxy: DelayProxy | None = None
        places = [(self.back(name), self.namespace(name)) for name in MEMBERS]
        self.etcd = EtcdCluster(base / "etcd", places=places, reach=self.from_clients)
        if not pre_vote:
            self.etcd.extra_flags = ["--pre-vote=false"]

    def namespace(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def back(self, role: str) -> str:
        return f"{self.net}.{PLACES[role][0]}"

    def front(self, role: str) -> str:
        front = PLACES[role][1]
        assert front is not None, f"{role} is not on the front network"
        return f"{self.net}.{front}"

    def from_clients(self, function: Callable[[], Any]) -> Any:
        """``function()`` on a thread in the clients' namespace (which sees etcd)."""
        return run_in(self.namespace("c"), function)

    def __enter__(self) -> Lab:
        try:
            self.build()
            self.etcd.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def build(self) -> None:
        ip("netns", "add", self.switch)
        self.made.append(self.switch)
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for role, (back, front) in PLACES.items():
            namespace = self.namespace(role)
            ip("netns", "add", namespace)
            self.made.append(namespace)
            ip("-n", namespace, "link", "set", "lo", "up")
            for side, octet in (("back", back), ("front", front)):
                if octet is None:
                    continue
                port = f"{role}-{side[0]}"
                ip("-n", self.switch, "link", "add", port, "type", "veth",
                   "peer", "name", side, "netns", namespace)  # fmt: skip
                ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                ip("-n", namespace, "addr", "add", f"{self.net}.{octet}/25", "dev", side)
                ip("-n", namespace, "link", "set", side, "up")
        chain = "add chain bridge cuts forward { type filter hook forward priority 0; }"
        self.nft(f"add table bridge cuts\n{chain}\n")

    def nft(self, script: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", self.switch, "nft", "-f", "-"],
            input=script, check=True, capture_output=True, text=True,
        )  # fmt: skip

    # ------------------------------------------------------------------ cuts

    def drop(self, ports: list[str], others: list[str]) -> None:
        """Silent loss: every frame between ``ports`` and ``others`` (switch port names
        such as ``a-b``, ``n1-b``), both ways, is dropped at the switch."""
        one, two = ", ".join(f'"{p}"' for p in ports), ", ".join(f'"{p}"' for p in others)
        self.nft(
            f"add rule bridge cuts forward iifname {{ {one} }} oifname {{ {two} }} drop\n"
            f"add rule bridge cuts forward iifname {{ {two} }} oifname {{ {one} }} drop\n"
        )

    def link(self, port: str, up: bool) -> None:
        """The switch's end of one veth down (the cable pulled) or up again."""
        ip("-n", self.switch, "link", "set", port, "up" if up else "down")

    def heal(self) -> None:
        """Every cut undone: no drop rules, every switch port up, no delay."""
        self.nft("flush chain bridge cuts forward\n")
        for role, (_, front) in PLACES.items():
            self.link(f"{role}-b", True)
            if front is not None:
                self.link(f"{role}-f", True)
        if self.proxy is not None:
            self.proxy.delay = 0.0

    def cut_node_from_etcd(self, role: str, mode: str) -> None:
        """``mode``: ``loss``, ``down`` (its back link) or ``delay`` (through the proxy)."""
        if mode == "loss":
            self.drop([f"{role}-b"], [f"{m}-b" for m in MEMBERS])
        elif mode == "down":
            self.link(f"{role}-b", False)
        elif mode == "delay":
            assert self.proxy is not None, "the node was not started through the proxy"
            self.proxy.delay = DELAY
        else:
            raise ValueError(f"unknown cut mode {mode!r}")

    def isolate_member(self, name: str) -> None:
        """Loss between one etcd member and everything else on the back network."""
        self.drop([f"{name}-b"], [f"{role}-b" for role in PLACES if role != name])

    # ----------------------------------------------------------------- nodes

    def start_node(self, role: str, *args: str, via_proxy: bool = False) -> LabNode:
        endpoints = [m.url for m in self.etcd.members.values()]
        if via_proxy:
            if self.proxy is None:
                self.proxy = DelayProxy(
                    self.namespace(role), [(self.back(m), 2379) for m in MEMBERS]
                )
            endpoints = [f"http://127.0.0.1:{port}" for port in self.proxy.ports]
        namespace = self.namespace(role)
        log: list[str] = []
        process, port = start_server(
            "--host", self.front(role), "--etcd", ",".join(endpoints), *args,
            log=log, preexec_fn=lambda: enter(namespace),
        )  # fmt: skip
        node = LabNode(role, process, self.front(role), port, log)
        self.nodes.append(node)
        return node

    def stop_nodes(self) -> None:
        for node in self.nodes:
            stop_server(node.process)
        self.nodes.clear()
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_nodes()
        self.etcd.close()
        for namespace in reversed(self.made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.made.clear()


# ------------------------------------------------------------------ the proxy


#: What a proxied connection ends with when either side goes away.
BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class DelayProxy:
    """TCP forwarders inside one namespace, one per etcd member, on 127.0.0.1.

    Each byte is sent on ``delay`` seconds after it arrived (0: at once), in order;
    setting ``delay`` from another thread takes effect for the bytes that arrive
    from then on, so a backlog drains within the old delay after it is set to 0."""

    def __init__(self, namespace: str, targets: list[tuple[str, int]]) -> None:
        self.delay = 0.0
        self.targets = targets
        self.ports: list[int] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(namespace,), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")

    def _serve(self, namespace: str) -> None:
        enter(namespace)
        trio.run(self._main)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._scope = scope
            async with trio.open_nursery() as nursery:
                for host, port in self.targets:
                    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
                    self.ports.append(listeners[0].socket.getsockname()[1])
                    nursery.start_soon(trio.serve_listeners, self._handler(host, port), listeners)
                self._ready.set()

    def _handler(self, host: str, port: int) -> Callable[[trio.SocketStream], Awaitable[None]]:
        async def handle(downstream: trio.SocketStream) -> None:
            try:
                upstream = await trio.open_tcp_stream(host, port)
            except OSError:
                await downstream.aclose()
                return
            async with downstream, upstream, trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, downstream, upstream, nursery.cancel_scope)
                nursery.start_soon(self._pump, upstream, downstream, nursery.cancel_scope)

        return handle

    async def _pump(
        self, source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope
    ) -> None:
        send, receive = trio.open_memory_channel[tuple[float, bytes]](math.inf)

        async def deliver() -> None:
            with contextlib.suppress(*BROKEN):
                async for due, data in receive:
                    await trio.sleep_until(due)
                    if not data:
                        break
                    await sink.send_all(data)
            scope.cancel()  # both ways: this proxy never half-closes

        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver)
            last, data = 0.0, b"-"
            while data:
                data = b""
                with contextlib.suppress(*BROKEN):
                    data = await source.receive_some(65536)
                last = max(last, trio.current_time() + self.delay)
                send.send_nowait((last, data))

    def close(self) -> None:
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._scope.cancel)
        self._thread.join(timeout=5)


# --------------------------------------------------------------- the records


@dataclass
class Hold:
    """One grant as its client saw it; all times ``time.monotonic()``."""

    hold_id: str
    client: str
    node: str  # "a" or "b"
    key: str
    sent: float
    granted: float  # when ``200 Acquired`` arrived
    token: int | None = None
    #: When each confirming ``token K`` poll was sent (its ``200`` came later).
    confirmed: list[float] = field(default_factory=list)
    unlock_sent: float | None = None
    told: float | None = None  # when the client learnt it lost the hold
    told_how: str = ""

    @property
    def end(self) -> float:
        """The last moment the node is known to have confirmed this hold."""
        return max(self.confirmed, default=self.granted)


@dataclass
class Outcome:
    """What one run recorded."""

    name: str
    holds: list[Hold] = field(default_factory=list)
    #: (time, what) for every cut and heal.
    cuts: list[tuple[float, str]] = field(default_factory=list)
    #: (key, create revision) -> when the watch saw etcd delete that queue entry.
    deleted: dict[tuple[str, int], float] = field(default_factory=dict)
    token_floor: int = 0
    replies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    logs: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass
class Figures:
    """What the checks found in one run."""

    overlaps: int
    longest_overlap: float
    regressions: int
    other_violations: list[str]
    stale_confirmations: int
    latest_stale: float  # seconds past etcd's delete, of the latest stale confirmation
    #: Holds node A ended by telling its client, each with how long before B's next
    #: grant of that key the client was told (negative: told after it).
    leads: list[float]
    grants: dict[str, int]

    @property
    def smallest_lead(self) -> float | None:
        return min(self.leads, default=None)

    def summary(self) -> str:
        lead = "-" if self.smallest_lead is None else f"{self.smallest_lead:+.3f} s"
        return (
            f"grants A {self.grants.get('a', 0)} B {self.grants.get('b', 0)}; "
            f"overlaps {self.overlaps} (longest {self.longest_overlap:.3f} s); "
            f"token regressions {self.regressions}; confirmations after etcd deleted "
            f"the entry {self.stale_confirmations} (latest +{self.latest_stale:.3f} s); "
            f"A holders told {len(self.leads)}, smallest lead {lead}"
        )


def figures(outcome: Outcome) -> Figures:
    """Run the safety checker over the holds, and measure what it does not."""
    records: list[dict[str, Any]] = []
    for hold in outcome.holds:
        session = f"{hold.client}:{hold.hold_id}"
        records.append({
            "ev": "grant", "hold": hold.hold_id, "client": hold.client, "session": session,
            "key": hold.key,
            "shared": False, "via": "lock", "sent": hold.sent, "t": hold.granted,
            "ttl": None, "token": hold.token,
            "token_at": hold.confirmed[0] if hold.confirmed else None, "limit": None,
            "port": 0,
        })  # fmt: skip
        records.append({"ev": "release", "hold": hold.hold_id, "t": hold.end})
    report = Report(seconds=0)
    check(records, {}, report)
    overlaps = [v for v in report.violations if v.startswith("exclusive overlap")]
    regressions = [v for v in report.violations if v.startswith("token on")]
    others = [v for v in report.violations if v not in overlaps and v not in regressions]
    longest = 0.0
    by_key: dict[str, list[Hold]] = defaultdict(list)
    for hold in outcome.holds:
        by_key[hold.key].append(hold)
    for holds in by_key.values():
        for i, one in enumerate(holds):
            for two in holds[i + 1 :]:
                longest = max(longest, min(one.end, two.end) - max(one.granted, two.granted))
    stale, latest = 0, 0.0
    for hold in outcome.holds:
        if hold.token is None:
            continue
        deleted = outcome.deleted.get((hold.key, (hold.token - outcome.token_floor) // 64))
        late = [sent - deleted for sent in hold.confirmed if deleted is not None and sent > deleted]
        stale += len(late)
        latest = max([latest, *late])
    leads = []
    for hold in outcome.holds:
        if hold.node != "a" or hold.told is None or hold.unlock_sent is not None:
            continue
        after = [
            other.granted
            for other in by_key[hold.key]
            if other.node == "b" and other.granted > hold.granted
        ]
        if after:
            leads.append(min(after) - hold.told)
    grants: dict[str, int] = defaultdict(int)
    for hold in outcome.holds:
        grants[hold.node] += 1
    return Figures(
        len(overlaps), longest if overlaps else 0.0, len(regressions),
        others + outcome.problems, stale, latest, leads, dict(grants),
    )  # fmt: skip


# ----------------------------------------------------------------- the clients


class Closed(Exception):
    """The node closed the connection."""


#: How a client learns that its connection is gone (closed, reset, refused).
GONE = (Closed, *BROKEN)


class Line:
    """One client connection in the clients' trio run."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def request(self, line: str) -> str:
        await self.stream.send_all(line.encode() + b"\n")
        while b"\r\n" not in self.buffer:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise Closed
            self.buffer += chunk
        reply, _, self.buffer = self.buffer.partition(b"\r\n")
        return reply.decode()


class Run:
    """The shared state of one run's trio program."""

    def __init__(self, outcome: Outcome, nodes: dict[str, LabNode]) -> None:
        self.outcome = outcome
        self.nodes = nodes
        self.count = 0
        #: While a cut lasts, holders keep holding (and polling) until they are told
        #: they lost the hold: a hold that ends by itself measures nothing.
        self.cut_active = False

    async def connect(self, node: str) -> Line:
        target = self.nodes[node]
        with trio.fail_after(3):
            return Line(await trio.open_tcp_stream(target.host, target.port))

    def note(self, reply: str) -> None:
        self.outcome.replies[reply.split(" ", 1)[0] + " " + reply.split(" ", 1)[-1][:24]] += 1

    async def lock(self, line: Line, client: str, node: str, key: str) -> Hold | None:
        """``lock K 30``; the hold and its first confirmation when granted."""
        sent = time.monotonic()
        reply = await line.request(f"lock {key} 30")
        at = time.monotonic()
        self.note(reply)
        if reply != "200 Acquired":
            return None
        self.count += 1
        hold = Hold(f"h{self.count}", client, node, key, sent, at)
        self.outcome.holds.append(hold)
        await self.confirm(line, hold)
        return hold

    async def confirm(self, line: Line, hold: Hold) -> bool:
        """One ``token K`` poll: True when it confirmed the hold."""
        sent = time.monotonic()
        try:
            reply = await line.request(f"token {hold.key}")
        except GONE:
            hold.told, hold.told_how = time.monotonic(), "closed"
            raise
        if reply.startswith("200 "):
            token = int(reply[4:])
            if hold.token is None:
                hold.token = token
            elif token != hold.token:
                self.outcome.problems.append(f"{hold.hold_id}: token {hold.token} became {token}")
            hold.confirmed.append(sent)
            return True
        hold.told, hold.told_how = time.monotonic(), reply
        return False

    async def hold_for(
        self, line: Line, hold: Hold, seconds: float, *, through_cuts: bool = True
    ) -> bool:
        """Poll ``token K`` every :data:`POLL` for ``seconds`` (and while a cut lasts,
        with ``through_cuts``); False once told lost."""
        until = time.monotonic() + seconds
        while time.monotonic() < until or (through_cuts and self.cut_active):
            await trio.sleep(POLL)
            if hold.told is not None or not await self.confirm(line, hold):
                return False
        return hold.told is None

    async def unlock(self, line: Line, hold: Hold) -> None:
        hold.unlock_sent = time.monotonic()
        self.note(await line.request(f"unlock {hold.key}"))

    async def contend(self, client: str, node: str, rng: random.Random) -> None:
        """Lock, hold, unlock random keys, forever; reconnect when the node closes."""
        while True:
            try:
                line = await self.connect(node)
            except (OSError, trio.TooSlowError):
                await trio.sleep(0.2)
                continue
            try:
                while True:
                    hold = await self.lock(line, client, node, rng.choice(KEYS))
                    if hold is None:
                        await trio.sleep(rng.uniform(0.1, 0.3))
                        continue
                    if hold.told is not None or not await self.hold_for(
                        line, hold, rng.uniform(0.5, 2.0)
                    ):
                        break  # told lost: a fresh connection, as a client would
                    await self.unlock(line, hold)
                    await trio.sleep(rng.uniform(0.0, 0.2))
            except GONE:
                self.note("<closed>")
            with contextlib.suppress(OSError):
                await line.stream.aclose()
            await trio.sleep(0.2)

    async def watch(self, prefix: str, endpoints: list[str], ready: trio.Event) -> None:
        """Record when etcd deleted each queue entry (key and create revision)."""
        client = EtcdClient(endpoints, deadline=10)
        root = prefix.encode()
        revision, kvs, _ = await client.get(root + b"meta/token_floor")
        if kvs:
            self.outcome.token_floor = int(kvs[0].value)
        created: dict[bytes, int] = {}
        queues = root + b"q/x/"
        ready.set()
        async with client.watch(queues, prefix_end(queues), revision + 1) as events:
            async for batch in events:
                now = time.monotonic()
                for event in batch:
                    if event.type == "PUT":
                        created[event.kv.key] = event.kv.create_revision
                    elif event.kv.key in created:
                        name = bytes.fromhex(event.kv.key[len(queues) :].split(b"/")[0].decode())
                        self.outcome.deleted[(name.decode(), created.pop(event.kv.key))] = now

    async def a_holds(self, limit: float = 5.0) -> None:
        """Wait (up to ``limit``) until some client of node A holds a key, so that the
        cut that follows has a hold of A's to take away."""
        with trio.move_on_after(limit):
            while not any(
                h.node == "a" and h.told is None and h.unlock_sent is None
                for h in self.outcome.holds
            ):
                await trio.sleep(0.05)

    async def cut(self, what: str, action: Callable[[], None]) -> None:
        await trio.to_thread.run_sync(action)
        self.outcome.cuts.append((time.monotonic(), what))
        self.cut_active = what != "healed"

    async def free_keys(self) -> None:
        """After the run, every key can be taken through each node: nothing is stuck."""
        for node in self.nodes:
            for key in KEYS:
                try:
                    line = await self.connect(node)
                    with trio.fail_after(30):
                        reply = await line.request(f"lock {key} 25")
                    await line.stream.aclose()
                except (*GONE, trio.TooSlowError) as error:
                    reply = repr(error)
                if reply != "200 Acquired":
                    self.outcome.problems.append(f"{key} through {node} after the run: {reply}")


# ----------------------------------------------------------------- scenarios


def pace(ttl: int) -> float:
    """Seconds of contention before a cut and after its heal: shorter in the quick
    runs of ``make test`` (TTL 2) than in the issue's (TTL 5)."""
    return 2.0 if ttl >= 5 else 1.0


@dataclass
class Scenario:
    """One kind of run. ``script`` does the cuts and returns when the run may end."""

    name: str
    script: Callable[[Lab, Run, random.Random], Awaitable[None]]
    contenders: bool = True
    via_proxy: bool = False


def node_cut(mode: str, ttl: int) -> Scenario:
    """(a) Node A cut from etcd (``loss``, ``down`` or ``delay``) for longer than it
    takes A to lose its lease and etcd to free its locks, while clients contend."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        await trio.sleep(pace(ttl))
        await run.a_holds()
        await run.cut(f"A cut from etcd ({mode})", lambda: lab.cut_node_from_etcd("a", mode))
        # Past etcd's expiry of A's lease (TTL) and past when A used to tell its
        # clients (up to TTL + 2.2 s at TTL 5).
        await trio.sleep(1.4 * ttl + 2.0)
        await run.cut("healed", lab.heal)
        await trio.sleep(pace(ttl))

    return Scenario(f"node A cut from etcd ({mode})", script, via_proxy=mode == "delay")


def clients_cut(ttl: int) -> Scenario:
    """(b) The clients cut from node A (loss between them), A still on etcd."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        await trio.sleep(pace(ttl))
        await run.cut("clients cut from A", lambda: lab.drop(["c-f"], ["a-f"]))
        await trio.sleep(ttl + 1.0)
        await run.cut("healed", lab.heal)
        await trio.sleep(pace(ttl) + 1.0)  # the clients' TCP retransmits catch up

    return Scenario("clients cut from node A", script)


def leader_isolated(ttl: int) -> Scenario:
    """(c) The etcd leader cut from the other members, both nodes and the clients."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        await trio.sleep(pace(ttl))
        leader = await trio.to_thread.run_sync(lab.etcd.leader)
        await run.cut(f"etcd leader {leader} isolated", lambda: lab.isolate_member(leader))
        await trio.sleep(ttl + 2.0)
        await run.cut("healed", lab.heal)
        await trio.sleep(pace(ttl))

    return Scenario("etcd leader isolated", script)


def flapping(seconds: float, ttl: int) -> Scenario:
    """(d) A cut from etcd (loss) and healed every 2-5 s (seeded) for ``seconds``."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        await trio.sleep(pace(ttl))
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            await run.a_holds(1.0)
            await run.cut("A cut from etcd (loss)", lambda: lab.cut_node_from_etcd("a", "loss"))
            await trio.sleep(min(rng.uniform(2, 5), max(0.0, until - time.monotonic())))
            await run.cut("healed", lab.heal)
            await trio.sleep(min(rng.uniform(2, 5), max(0.0, until - time.monotonic())))
        await trio.sleep(pace(ttl))

    return Scenario(f"flapping for {seconds:.0f} s", script)


def long_cut(seconds: float, ttl: int) -> Scenario:
    """(e) A cut from etcd (loss) for ``seconds``, then healed: nothing of A's old
    sessions comes back, and A serves again."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        await trio.sleep(pace(ttl))
        await run.a_holds()
        await run.cut("A cut from etcd (loss)", lambda: lab.cut_node_from_etcd("a", "loss"))
        await trio.sleep(seconds)
        await run.cut("healed", lab.heal)
        await trio.sleep(1.5 * pace(ttl) + 1.0)
        healed = run.outcome.cuts[-1][0]
        if not any(h.node == "a" and h.granted > healed for h in run.outcome.holds):
            run.outcome.problems.append("node A granted nothing after the heal")

    return Scenario(f"a {seconds:.0f} s cut then heal", script)


def stale_watch(mode: str, ttl: int) -> Scenario:
    """(f) B's client holds X; an A client waits for X, a B client behind it; A is
    cut from etcd; B's holder unlocks 0.6 TTL later (3.0 s at TTL 5); the cut heals
    at 1.36 TTL (6.8 s). A must not grant its waiter from a stale view."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        async def waiter(client: str, node: str, queued: trio.Event) -> None:
            line = await run.connect(node)
            queued.set()
            try:
                hold = await run.lock(line, client, node, "x0")
                if hold is not None and await run.hold_for(line, hold, 3.0):
                    await run.unlock(line, hold)
            except GONE:
                run.note("<closed>")

        holder_line = await run.connect("b")
        holder = await run.lock(holder_line, "b-holder", "b", "x0")
        assert holder is not None, "the first lock of x0 was not granted"
        async with trio.open_nursery() as nursery:
            for client, node in (("a-waiter", "a"), ("b-waiter", "b")):
                queued = trio.Event()
                nursery.start_soon(waiter, client, node, queued)
                await queued.wait()
                await trio.sleep(0.5)  # its ``lock`` is in etcd's queue by now
            await run.cut(f"A cut from etcd ({mode})", lambda: lab.cut_node_from_etcd("a", mode))
            await run.hold_for(holder_line, holder, 0.6 * ttl, through_cuts=False)
            await run.unlock(holder_line, holder)
            await trio.sleep(0.76 * ttl)
            await run.cut("healed", lab.heal)
            with trio.move_on_after(ttl + 1.5 * pace(ttl) + 1.0):
                await trio.sleep_forever()
            nursery.cancel_scope.cancel()

    return Scenario(f"stale watch ({mode})", script, contenders=False, via_proxy=mode == "delay")


def run_scenario(lab: Lab, scenario: Scenario, *, ttl: int = 5, seed: int = 1) -> Outcome:
    """Fresh nodes A and B on a fresh prefix, the scenario, then its outcome."""
    prefix = f"/partition-{uuid.uuid4().hex[:10]}/"
    flags = ("--etcd-prefix", prefix, "--session-ttl", str(ttl))
    outcome = Outcome(scenario.name)
    try:
        # Both at once: each start waits for its node to reach etcd.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(lab.start_node, "a", *flags, via_proxy=scenario.via_proxy)
            b = pool.submit(lab.start_node, "b", *flags)
            nodes = {"a": a.result(), "b": b.result()}
        run = Run(outcome, nodes)
        follower = lab.etcd.follower()
        endpoints = [lab.etcd.members[follower].url] + [
            m.url for name, m in lab.etcd.members.items() if name != follower
        ]

        async def main() -> None:
            rng = random.Random(seed)
            async with trio.open_nursery() as nursery:
                ready = trio.Event()
                nursery.start_soon(run.watch, prefix, endpoints, ready)
                with trio.fail_after(10):
                    await ready.wait()
                async with trio.open_nursery() as clients:
                    if scenario.contenders:
                        for node in ("a", "b"):
                            for number in range(CLIENTS_PER_NODE):
                                name = f"{node}{number}"
                                clients.start_soon(
                                    run.contend, name, node, random.Random(rng.random())
                                )
                    await scenario.script(lab, run, rng)
                    clients.cancel_scope.cancel()
                await trio.to_thread.run_sync(lab.heal)
                await run.free_keys()
                await trio.sleep(0.5)  # the watch's last deletes
                nursery.cancel_scope.cancel()

        lab.from_clients(lambda: trio.run(main))
    finally:
        for node in lab.nodes:
            outcome.logs[node.role] = list(node.log)
        lab.heal()
        lab.stop_nodes()
    return outcome


def describe(outcome: Outcome, found: Figures) -> str:
    """One run in a few lines: the figures, the cuts, and what A told its holders."""
    start = min((h.sent for h in outcome.holds), default=0.0)
    cuts = ", ".join(f"{what} at {at - start:.2f}" for at, what in outcome.cuts)
    lines = [f"{outcome.name}: {found.summary()}", f"  cuts: {cuts}"]
    lines += [f"  {v}" for v in found.other_violations[:10]]
    if len(outcome.holds) <= 8:  # a scripted run: every hold
        for hold in outcome.holds:
            told = "-" if hold.told is None else f"{hold.told - start:.2f} ({hold.told_how})"
            lines.append(
                f"  {hold.client} on {hold.node.upper()}: granted {hold.granted - start:.2f}, "
                f"token {hold.token}, last confirmed {hold.end - start:.2f}, told {told}"
            )
    return "\n".join(lines)


def put(url: str, key: str) -> None:
    """One write through etcd's JSON gateway (raises when it fails or times out)."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(), "value": ""})
    request = urllib.request.Request(
        f"{url}/v3/kv/put", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def pre_vote_figures(pre_vote: bool, isolated_for: float = 10.0, after: float = 8.0) -> str:
    """Isolate the etcd leader for ``isolated_for`` seconds while a client writes to a
    member of the majority every 50 ms; then heal. Returns what happened: the terms,
    and the longest write after the heal (how long writes stalled)."""
    with lab(pre_vote) as made:
        leader = made.etcd.leader()
        follower = made.etcd.follower()
        url = made.etcd.members[follower].url
        own = made.etcd.members[leader]

        def term(name: str) -> int:
            status = made.etcd.status(name)
            return -1 if status is None else int(status["raft_term"])

        before = term(leader)
        writes: list[tuple[float, float, bool]] = []
        stop = threading.Event()

        def writer() -> None:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    put(url, "/pre-vote/probe")
                    ok = True
                except OSError:
                    ok = False
                writes.append((began, time.monotonic(), ok))
                time.sleep(0.05)

        thread = threading.Thread(target=lambda: run_in(made.namespace("c"), writer))
        thread.start()
        try:
            time.sleep(1.0)
            made.isolate_member(leader)
            time.sleep(isolated_for)
            # Asked from inside its own namespace, which the cut does not reach.
            isolated = run_in(made.namespace(leader), lambda: member_status(own.url))
            isolated_term = -1 if isolated is None else int(isolated["raft_term"])
            majority_term = term(follower)
            healed = time.monotonic()
            made.heal()
            time.sleep(after)
        finally:
            stop.set()
            thread.join()
        final = term(follower)
        after_heal = [(b, e, ok) for b, e, ok in writes if e > healed]
        longest = max((e - b for b, e, _ in after_heal), default=0.0)
        failed = sum(not ok for _, _, ok in after_heal)
        return (
            f"--pre-vote={'true' if pre_vote else 'false'}: term {before} before; after "
            f"{isolated_for:.0f} s isolated, the old leader {leader} is at term {isolated_term}, "
            f"the majority at {majority_term}; {after:.0f} s after the heal the term is {final}; "
            f"longest write after the heal {longest:.2f} s, {failed} failed writes"
        )


@contextlib.contextmanager
def lab(pre_vote: bool = True) -> Iterator[Lab]:
    with (
        tempfile.TemporaryDirectory(prefix="elockd-partition-") as base,
        Lab(Path(base), pre_vote=pre_vote) as made,
    ):
        yield made


# ------------------------------------------------------------------------ CLI


def scenario_named(name: str, mode: str, ttl: int, seconds: float) -> Scenario:
    return {
        "node-cut": lambda: node_cut(mode, ttl),
        "clients-cut": lambda: clients_cut(ttl),
        "leader": lambda: leader_isolated(ttl),
        "flapping": lambda: flapping(seconds, ttl),
        "long-cut": lambda: long_cut(seconds, ttl),
        "stale-watch": lambda: stale_watch(mode, ttl),
    }[name]()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.partition", description=__doc__)
    parser.add_argument(
        "scenario",
        choices=[
            "node-cut", "clients-cut", "leader", "flapping", "long-cut", "stale-watch", "pre-vote",
        ],
    )  # fmt: skip
    parser.add_argument("--mode", default="loss", help="loss, down, delay, or a,b,c in turn")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--ttl", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=60.0, help="flapping, long cut")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="append each run's figures here")
    args = parser.parse_args(argv)
    if (why := why_no_lab()) is not None:
        print(f"cannot build the lab: {why}", file=sys.stderr)
        return 2
    if args.scenario == "pre-vote":
        for number in range(args.runs):
            for pre_vote in (False, True):
                print(f"run {number + 1}: {pre_vote_figures(pre_vote)}", flush=True)
        return 0
    modes = args.mode.split(",")
    bad = 0
    with lab() as made:
        for number in range(args.runs):
            mode = modes[number % len(modes)]
            scenario = scenario_named(args.scenario, mode, args.ttl, args.seconds)
            outcome = run_scenario(made, scenario, ttl=args.ttl, seed=args.seed + number)
            found = figures(outcome)
            print(f"run {number + 1}: {describe(outcome, found)}", flush=True)
            bad += bool(found.overlaps or found.regressions or found.other_violations)
            if args.json:
                with args.json.open("a") as out:
                    out.write(
                        json.dumps({"run": number + 1, "mode": mode, **found.__dict__}) + "\n"
                    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
