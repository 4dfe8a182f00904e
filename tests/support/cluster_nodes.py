"""elockd cluster nodes for tests: real ``python -m elockd --etcd ...`` processes.

Each test gets its own key prefix in the module's etcd cluster, so tests that share
one cluster never see each other's locks. Nodes are stopped by pid (SIGKILL), and a
paused node (SIGSTOP) is continued before it is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from dataclasses import dataclass, field

import trio

from tests.support.etcd_cluster import EtcdCluster
from tests.support.line_client import LineClient
from tests.support.server_process import start_server, stop_server

#: Short, so crash tests finish quickly; etcd's floor is 2 s with a 1 s election.
TEST_SESSION_TTL = 2


@dataclass
class Node:
    """One elockd node of a test cluster."""

    process: subprocess.Popen[str]
    port: int
    #: Every line the node logged, printed when the test ends (pytest shows it
    #: for a failed test only), so a failure on a CI machine says what the node saw.
    log: list[str] = field(default_factory=list)

    async def connect(self) -> LineClient:
        return LineClient(await trio.open_tcp_stream("127.0.0.1", self.port))

    def kill(self) -> None:
        """SIGKILL: the node's sessions are freed only when etcd expires them."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
        stop_server(self.process)

    def stop(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)


@dataclass
class Nodes:
    """Starts nodes on one etcd cluster under one fresh prefix."""

    etcd: EtcdCluster
    prefix: str = field(default_factory=lambda: f"/test-{uuid.uuid4().hex[:10]}/")
    started: list[Node] = field(default_factory=list)

    def flags(self, endpoints: list[str] | None = None) -> tuple[str, ...]:
        """What every node of this cluster runs with (a hand-over's successor too)."""
        return (
            "--etcd",
            ",".join(endpoints or self.etcd.endpoints),
            "--etcd-prefix",
            self.prefix,
            "--session-ttl",
            str(TEST_SESSION_TTL),
        )

    def start(
        self, *args: str, endpoints: list[str] | None = None, env: dict[str, str] | None = None
    ) -> Node:
        """A node with this cluster's flags and ``args``; ``env``, when given, is its
        whole environment."""
        log: list[str] = []
        process, port = start_server(*self.flags(endpoints), *args, log=log, env=env)
        node = Node(process, port, log)
        self.started.append(node)
        return node

    def close(self) -> None:
        for number, node in enumerate(self.started):
            node.kill()
            print(f"--- node {number} (port {node.port}) logged:")
            print("".join(node.log[-60:]), end="")
