"""Real network partitions for a cluster of elockd nodes: the lab and its cuts.

Processes that are stopped (SIGSTOP, SIGKILL) cannot answer their clients, so they
can never confirm a hold they have lost. A node cut off from etcd can: it stays up
for its clients while etcd frees its locks. This module builds a small network out
of network namespaces (needs root and iproute2, like tests/support/netns.py; the cuts need
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

The clients and what they record are in tests/support/partition_clients.py, the scenarios
and their command line in tests/support/partition_runs.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from tests.support.etcd_cluster import EtcdCluster
from tests.support.netns import enter, ip, run_in, why_namespaces_cannot_be_made
from tests.support.server_process import start_server, stop_server

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
            self.proxy.one_way = False

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

    def start_node(
        self,
        role: str,
        *args: str,
        via_proxy: bool = False,
        env: dict[str, str] | None = None,
        module: str = "elockd",
    ) -> LabNode:
        """Node ``role`` with ``args``; ``env`` and ``module`` as for start_server."""
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
            log=log, preexec_fn=lambda: enter(namespace), env=env, module=module,
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

    Each byte is sent on ``delay`` seconds after it arrived (0: at once), in order
    (with ``one_way``, only the bytes from etcd to the node);
    setting ``delay`` from another thread takes effect for the bytes that arrive
    from then on, so a backlog drains within the old delay after it is set to 0."""

    def __init__(self, namespace: str, targets: list[tuple[str, int]]) -> None:
        self.delay = 0.0
        #: Hold only the bytes etcd sends to the node (its answers), not its requests.
        self.one_way = False
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
                nursery.start_soon(self._pump, downstream, upstream, nursery.cancel_scope, False)
                nursery.start_soon(self._pump, upstream, downstream, nursery.cancel_scope, True)

        return handle

    async def _pump(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        scope: trio.CancelScope,
        to_node: bool,
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
                delay = self.delay if to_node or not self.one_way else 0.0
                last = max(last, trio.current_time() + delay)
                send.send_nowait((last, data))

    def close(self) -> None:
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._scope.cancel)
        self._thread.join(timeout=5)


@contextlib.contextmanager
def lab(pre_vote: bool = True) -> Iterator[Lab]:
    with (
        tempfile.TemporaryDirectory(prefix="elockd-partition-") as base,
        Lab(Path(base), pre_vote=pre_vote) as made,
    ):
        yield made
