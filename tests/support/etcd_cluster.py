"""A real 3-member etcd cluster on loopback for tests (Debian's ``etcd-server``).

The members are separate processes in their own sessions, so a Ctrl-C of pytest
does not reach them and a test decides alone who dies (SIGKILL), pauses (SIGSTOP)
or comes back. Every method blocks, but only briefly, so trio tests may call them
directly; the ones that wait for an election (``start_member``, ``heal``) are
better run through ``trio.to_thread.run_sync`` when a watch must keep flowing.
Members are only ever signalled by their own pid, never by name.

Members run with the flags docs/cluster.md recommends (``--pre-vote``). Given
``places`` (an address and a network namespace per member), each member runs inside
its own namespace on that address (tests/support/partition_lab.py); ``reach`` then runs the
status calls where those addresses can be reached.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.support.netns import enter

T = TypeVar("T")

START_TIMEOUT = 20.0


@dataclass
class Member:
    """One etcd process; ``process`` is None while the member is down."""

    name: str
    client_port: int
    peer_port: int
    process: subprocess.Popen[bytes] | None
    stopped: bool = False
    host: str = "127.0.0.1"
    #: The network namespace the member runs in (None: this process's own).
    namespace: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def alive(self) -> bool:
        """Running and not paused: the only members worth asking anything."""
        return self.process is not None and self.process.poll() is None and not self.stopped


def free_ports(count: int) -> list[int]:
    """Ports the kernel just handed out; all are held open together so none repeats."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def member_status(url: str, timeout: float = 0.5) -> dict[str, Any] | None:
    """``/v3/maintenance/status`` of one member, or None when it does not answer."""
    request = urllib.request.Request(
        f"{url}/v3/maintenance/status",
        data=b"{}",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status: dict[str, Any] = json.loads(response.read())
            return status
    except (OSError, ValueError):
        return None


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in /proc)."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            # The state follows the command name, which is in parentheses.
            state = stat.read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state not in ("T", "t"):
            return False
    return True


def here(function: Callable[[], T]) -> T:
    return function()


class EtcdCluster:
    """``size`` members named n1..nN with data and logs under ``base``.

    ``places``: (address, network namespace) of each member, which then listens on
    etcd's usual ports 2379 and 2380 there; ``reach`` runs a status call where the
    members can be reached (by default in this thread)."""

    def __init__(
        self,
        base: Path,
        size: int = 3,
        *,
        places: Sequence[tuple[str, str]] | None = None,
        reach: Callable[[Callable[[], Any]], Any] = here,
    ) -> None:
        self.base = base
        self.reach = reach
        if places is None:
            ports = free_ports(2 * size)
            self.members = {
                f"n{i + 1}": Member(f"n{i + 1}", ports[2 * i], ports[2 * i + 1], None)
                for i in range(size)
            }
        else:
            self.members = {
                f"n{i + 1}": Member(f"n{i + 1}", 2379, 2380, None, host=host, namespace=namespace)
                for i, (host, namespace) in enumerate(places)
            }
        # Unique per cluster, so members of two clusters can never talk to each other.
        self.token = f"elockd-test-{uuid.uuid4().hex[:12]}"
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members.values())
        self._ids: dict[str, str] = {}  # member id (decimal string) -> name
        #: Appended to every member's command line (a test of etcd's own defaults
        #: can turn ``--pre-vote`` off again with ``--pre-vote=false``).
        self.extra_flags: list[str] = []

    @property
    def endpoints(self) -> list[str]:
        return [member.url for member in self.members.values()]

    def start(self) -> None:
        """Start every member, then wait until all answer and one of them leads."""
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd is not installed: install etcd-server (see .ci/run)")
        for name in self.members:
            self.start_member(name, wait=False)
        self._wait(lambda: self._all_answer() and self._current_leader() is not None)

    def start_member(self, name: str, wait: bool = True) -> None:
        """(Re)start one member; an existing data dir makes it rejoin with its old identity.

        With ``wait`` it returns once that member answers status, which etcd only does
        after the member has published itself through the raft log (needs a quorum).
        """
        member = self.members[name]
        if member.process is not None and member.process.poll() is None:
            raise RuntimeError(f"{name} is already running")
        logs = self.base / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        command = [
            "etcd",
            *("--name", name),
            *("--data-dir", str(self.base / "data" / name)),
            *("--listen-client-urls", member.url),
            *("--advertise-client-urls", member.url),
            *("--listen-peer-urls", member.peer_url),
            *("--initial-advertise-peer-urls", member.peer_url),
            *("--initial-cluster", self.initial_cluster),
            *("--initial-cluster-token", self.token),
            *("--initial-cluster-state", "new"),
            *("--heartbeat-interval", "100"),
            *("--election-timeout", "1000"),
            # An isolated member must not raise its term and force an election when
            # it comes back (docs/cluster.md, "etcd flags").
            "--pre-vote",
            *("--logger", "zap"),
            *("--log-outputs", str(logs / f"{name}.log")),
        ]
        namespace = member.namespace
        with open(logs / f"{name}.out", "ab") as out:
            member.process = subprocess.Popen(
                [*command, *self.extra_flags],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if namespace is None else lambda: enter(namespace),
            )
        member.stopped = False
        if wait:
            self._wait(lambda: self.status(name) is not None)

    def kill(self, name: str) -> None:
        """SIGKILL one member and reap it: a crash, with no chance to say goodbye."""
        member = self.members[name]
        process = member.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()
        member.process = None
        member.stopped = False

    def stop(self, name: str) -> None:
        """SIGSTOP one member: it keeps its sockets open but never answers (a hung node)."""
        member = self.members[name]
        assert member.process is not None, f"{name} is not running"
        member.process.send_signal(signal.SIGSTOP)
        member.stopped = True
        # kill() returns before every thread has stopped: a thread busy in the kernel
        # (an fsync) stops only on its way out, and could still ack a raft append.
        pid = member.process.pid
        self._wait(lambda: all_threads_stopped(pid), timeout=5)

    def cont(self, name: str) -> None:
        member = self.members[name]
        assert member.process is not None, f"{name} is not running"
        member.process.send_signal(signal.SIGCONT)
        member.stopped = False

    def leader(self) -> str:
        """Name of the member that a live member reports as leader (and that is itself live)."""
        name = self._current_leader()
        if name is None:
            raise RuntimeError("no live member reports a live leader")
        return name

    def follower(self) -> str:
        """A live member that is not the leader."""
        leader = self.leader()
        for name, member in self.members.items():
            if name != leader and member.alive:
                return name
        raise RuntimeError("no live follower")

    def wait_leader(self, timeout: float = 10) -> str:
        """Wait until a live member reports a live leader (after a kill, an election)."""
        self._wait(lambda: self._current_leader() is not None, timeout)
        return self.leader()

    def heal(self) -> None:
        """Resume paused members, restart dead ones, and wait for all to answer and a leader.

        Destructive tests call this when they finish, so the next test gets a whole
        cluster again whatever happened.
        """
        for name, member in self.members.items():
            if member.stopped:
                self.cont(name)
            if member.process is None or member.process.poll() is not None:
                member.process = None
                self.start_member(name, wait=False)
        self._wait(lambda: self._all_answer() and self._current_leader() is not None)

    def close(self) -> None:
        """Kill every member by pid (a paused one is resumed first so it can die at once)."""
        for member in self.members.values():
            process = member.process
            if process is None:
                continue
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGKILL)
            process.wait()
            member.process = None

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every member's log, for failure messages."""
        parts = []
        for name in self.members:
            for path in (self.base / "logs" / f"{name}.log", self.base / "logs" / f"{name}.out"):
                if path.exists():
                    tail = path.read_text(errors="replace").splitlines()[-lines:]
                    parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def _all_answer(self) -> bool:
        return all(self._status(name) is not None for name in self.members)

    def status(self, name: str) -> dict[str, Any] | None:
        """One member's ``/v3/maintenance/status``, or None when it does not answer."""
        url = self.members[name].url
        status: dict[str, Any] | None = self.reach(lambda: member_status(url))
        return status

    def _status(self, name: str) -> dict[str, Any] | None:
        member = self.members[name]
        if not member.alive:
            return None
        status = self.status(name)
        if status is not None:
            self._ids[str(status["header"]["member_id"])] = name
        return status

    def _current_leader(self) -> str | None:
        for name in self.members:
            status = self._status(name)
            leader = self._ids.get(str(status.get("leader", "0"))) if status else None
            if leader is not None and self.members[leader].alive:
                return leader
        return None

    def _wait(self, ready: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, member in self.members.items():
                if member.process is not None and member.process.poll() is not None:
                    raise RuntimeError(
                        f"etcd {name} exited with {member.process.returncode}\n{self.log_tails()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd cluster not ready after {timeout}s\n{self.log_tails()}")
            time.sleep(0.05)


@contextmanager
def running_cluster(base: Path, size: int = 3) -> Iterator[EtcdCluster]:
    """The one way the suite gets an etcd cluster on loopback: started under ``base``
    (no etcd installed raises: a broken setup fails, never skips), every member
    killed by pid on the way out."""
    cluster = EtcdCluster(base, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
