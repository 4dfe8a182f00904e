"""``ls`` at scale on a cluster node (tests/test_cluster_ls_scale.py,
bench/cluster_ls_scale.py): locks written straight into etcd, and the socket
helpers that list them.

A node takes a few thousand locks a second through its own path; a million would
take most of an hour on the test box. A node's mirror lists queue entries, whoever
wrote them, so these are written as entries of the layout
(elockd/backend/cluster/layout.py, values from its ``entry_value``) over etcd's JSON
gateway, ``per_txn`` puts a txn, bound to one lease. Each entry has a session tag of
its own, as a million one-lock sessions would: a tag's entries created at one
revision are one ``mlock`` to the mirror.
"""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from elockd.backend.cluster.etcd.client import put_op
from elockd.backend.cluster.layout import EXCLUSIVE, Layout, entry_value
from tests.support.hostile_tools import rss_bytes

MATCHING = 10


class Seeder:
    """Writes exclusive queue entries for ``seed/NNNNNNNN`` under ``prefix``."""

    def __init__(self, endpoint: str, prefix: str, ttl: int, per_txn: int = 128) -> None:
        self.host, _, port = endpoint.removeprefix("http://").partition(":")
        self.port = int(port)
        self.layout = Layout(prefix.encode())
        self.per_txn = per_txn  # etcd's --max-txn-ops (128 by default)
        self.tag = secrets.randbits(62) + 1  # plus the lock's number: a tag each
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        self.lease = int(self.post(connection, "/v3/lease/grant", {"TTL": ttl})["ID"])
        connection.close()
        self.value = entry_value(0, None, b"seeded", peer=b"127.0.0.1:1", at=time.time())

    @staticmethod
    def post(connection: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> Any:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        reply = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"etcd {path}: {response.status} {reply}")
        return reply

    def key(self, number: int) -> bytes:
        return b"seed/%08d" % number

    def write(self, start: int, stop: int, threads: int = 3) -> None:
        """Entries for locks ``start`` .. ``stop - 1``, ``threads`` txns in flight."""
        chunks = [(a, min(a + self.per_txn, stop)) for a in range(start, stop, self.per_txn)]
        taking = threading.Lock()
        failures: list[BaseException] = []

        def work() -> None:
            connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                while not failures:
                    with taking:
                        if not chunks:
                            return
                        first, end = chunks.pop()
                    ops = [
                        put_op(
                            self.layout.entry(EXCLUSIVE, self.key(n), self.tag + n),
                            self.value,
                            self.lease,
                        )
                        for n in range(first, end)
                    ]
                    self.post(connection, "/v3/kv/txn", {"success": ops})
            except BaseException as error:  # re-raised in the caller's thread
                failures.append(error)
            finally:
                connection.close()

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if failures:
            raise failures[0]


def read_until_end(sock: socket.socket) -> bytes:
    """An ``ls`` reply up to its ``END`` line, or a one-line error reply."""
    data = bytearray()
    while not data.endswith(b"END\r\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError(f"closed before END: {bytes(data[-200:])!r}")
        data += chunk
        if data[:1] in b"345" and data.endswith(b"\r\n"):
            break  # an error reply (no key of ours starts with a digit)
    return bytes(data)


def take_jobs(port: int) -> socket.socket:
    """``jobs/0`` .. ``jobs/9`` held on one connection (kept open: the session holds)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"".join(b"g jobs/%d\n" % n for n in range(MATCHING)))
    data = b""
    while data.count(b"\r\n") < MATCHING:
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError("the node closed the connection")
        data += chunk
    if data != b"1 Got Lock\r\n" * MATCHING:
        raise RuntimeError(f"jobs/ not granted: {data!r}")
    return sock


def take_marker(port: int, key: bytes) -> socket.socket:
    """Hold ``key`` on a connection of its own: its txn comes after every entry written
    so far, and an ``ls`` waits until the node's mirror has reached the node's last
    txn, so the next ``ls`` there lists them all. A node whose mirror is far behind
    answers ``0 Backend Unavailable`` after ``--etcd-timeout``: asked again then."""
    sock = socket.create_connection(("127.0.0.1", port))
    while True:
        sock.sendall(b"g %s\n" % key)
        reply = sock.recv(100)
        if reply == b"1 Got Lock\r\n":
            return sock
        if reply != b"0 Backend Unavailable\r\n":
            sock.close()
            raise RuntimeError(f"g {key!r}: {reply!r}")


def caught_up(port: int, timeout: float = 1800) -> float:
    """Seconds until ``ls jobs/`` answers with the 10 rows (after :func:`take_marker`)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"ls jobs/\n")
            reply = read_until_end(sock)
        if reply.endswith(b"END\r\n") and reply.count(b"\r\n") == MATCHING + 1:
            return time.monotonic() - started
        time.sleep(0.5)
    raise RuntimeError(f"node on port {port} did not catch up in {timeout} s")


def timed_ls(port: int, command: bytes, requests: int) -> tuple[list[float], bytes]:
    """Round trips of ``command`` on one connection (after one untimed warm-up), and
    the last reply."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(command)
        reply = read_until_end(sock)
        times = []
        for _ in range(requests):
            started = time.perf_counter()
            sock.sendall(command)
            reply = read_until_end(sock)
            times.append(time.perf_counter() - started)
    return times, reply


def listed_jobs(reply: bytes) -> bool:
    """Whether an ``ls jobs/`` reply lists exactly ``jobs/0`` .. ``jobs/9``."""
    names = [line.split(b" ")[0] for line in reply.split(b"\r\n")[:-2]]
    return names == [b"jobs/%d" % n for n in range(MATCHING)]


@dataclass
class Unread:
    """What a full ``ls`` to a reader that does not read cost the node."""

    before: int  # RSS, bytes
    peak: int
    ping: float  # seconds, on another connection meanwhile
    pong: bytes
    rows: int  # then read
    read_seconds: float
    names_sorted: bool


def unread_full_ls(pid: int, port: int, watch: float = 3.0) -> Unread:
    """The node's RSS, sampled for ``watch`` seconds, while a reader with a 64 KiB
    receive buffer that does not read is sent a full ``ls``; then it reads it all."""
    before = rss_bytes(pid)
    with socket.create_connection(("127.0.0.1", port)) as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        reader.sendall(b"ls\n")
        peak = before
        for _ in range(int(watch * 10)):
            time.sleep(0.1)
            peak = max(peak, rss_bytes(pid))
        with socket.create_connection(("127.0.0.1", port)) as probe:
            started = time.perf_counter()
            probe.sendall(b"ping\n")
            pong = probe.recv(100)
            ping = time.perf_counter() - started
        started = time.perf_counter()
        data = read_until_end(reader)
        elapsed = time.perf_counter() - started
    names = [line.split(b" ", 1)[0] for line in data.split(b"\r\n")[:-2]]
    ordered = names == sorted(names) and len(set(names)) == len(names)
    return Unread(before, peak, ping, pong, len(names), elapsed, ordered)
