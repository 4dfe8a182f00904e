"""A safety checker for elockd: many clients, real processes, random kills.

Why this exists: unit tests check each rule on its own, but mutual exclusion is a
property of the whole system (engine + server + disconnect handling + leases) under
concurrency and crashes. This module drives a real server with many raw-socket
clients spread over several worker processes, SIGKILLs workers at random, and then
checks from what the clients *recorded* that the server never broke a promise.
Given the ports of several nodes of one cluster (``--etcd``), every client session
connects to one of them at random, so clients of one lock key sit on different
nodes, and the promises are those of the cluster as a whole.

How the records stay honest (no false alarms, no help from the server):

* ``time.monotonic`` is system-wide on Linux, so records of different processes are
  on one time line.
* A grant is recorded *after* its reply arrived and a release *before* the release
  is sent, so every recorded interval lies inside the true one. If two recorded
  intervals overlap, the true ones did too: a real violation.
* A hold whose client closed or was killed without releasing is recorded as ending
  at the close / at the moment the parent decided to kill (the server frees it only
  later, when it notices; a cluster node when it sees the TCP close). Leases
  outlive their connection: they are recorded as ending at ``sent + ttl`` (the
  server's deadline is ``grant + ttl`` with ``grant >= sent``), or at the last
  successful ``renew``'s ``sent + ttl``.

What is checked (:func:`check`): no two exclusive holders of a key overlap; never
more than ``limit`` shared holders of a key; fencing tokens strictly increase per key
in grant order and are unique, also across the keys of one ``mlock`` (every grant
has a token of its own, on a cluster too); a plain hold is never lost (its release
succeeds); a lease is never freed before its ttl; no client saw a malformed reply, an
error it did not ask for, an end of its connection or a stall (each ends that client
with an ``error`` record, which :func:`check` reports). After the run,
:func:`final_state_problems` checks, on every node, that every freed hold was
re-grantable: the server reports nothing held, waiting or leased, and a fresh
client takes every key at once.

With ``handovers=N`` (and a :class:`ServerChain`), N times during the run, spread out,
a successor ``elockd --take-over`` takes the server over (docs/upgrade.md) while the
clients go on; each predecessor must exit 0, and clients must notice nothing. The
final checks then run against the last process, which must count N hand-overs.

Run it with ``python -m tests.support.safety run --seconds 60 [--handovers 5]`` (it starts its
own server), or through ``tests/test_safety.py`` (``make stress`` sets
``STRESS_SECONDS``, and ``HANDOVER_STRESS_SECONDS`` for the hand-over run) and,
against two cluster nodes, ``tests/test_cluster_safety.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.support.server_process import start_server, stop_server

#: Keys taken exclusively (``g``, ``lock``, ``mlock``): few, so clients collide often.
EXCLUSIVE_KEYS = [f"x{i}" for i in range(6)]
#: Keys taken shared, each always with the same ``limit`` (the limit belongs to the
#: request, so a fixed limit per key is what makes "at most limit holders" checkable).
SHARED_LIMITS = {"s1": 1, "s2": 2, "s3": 3}
REPLY_TIMEOUT = 10.0  # a reply slower than this counts as a stall (a violation)
MAX_WAIT = 0.4  # longest WAIT a client asks for, so workers stop promptly
MAX_TTL = 1.0  # longest lease; the final check waits this long for leases to end
#: How long a predecessor may take to exit once its successor says it listens: the
#: successor only says so after it has everything, so the old one has nothing left to do.
HANDOVER_EXIT_TIMEOUT = 10.0

Record = dict[str, Any]


# --------------------------------------------------------------------- clients


class ReplyError(Exception):
    """The server sent something a correct server never sends, or nothing in time."""


class LineSocket:
    """A blocking socket that reads ``\\r\\n``-terminated reply lines."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=REPLY_TIMEOUT)
        self.buffer = b""

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def line(self) -> str:
        while b"\r\n" not in self.buffer:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise ReplyError(f"no reply within {REPLY_TIMEOUT} s") from None
            if not chunk:
                raise ReplyError("server closed the connection")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line.decode()

    def request(self, line: str) -> str:
        self.send(line)
        return self.line()

    def close(self) -> None:
        self.sock.close()


@dataclass
class Hold:
    """What a client remembers about one of its holds."""

    hold_id: str
    key: str
    shared: bool
    lease: bool


class Client:
    """One simulated user: a loop of sessions doing random lock work, recording it.

    Each event is one ``os.write`` of one JSON line to this client's own file, so a
    SIGKILL can lose at most the event being written, never corrupt earlier ones.
    A lost grant record only makes the check weaker, never wrong.
    """

    def __init__(
        self, ports: Sequence[int], name: str, seed: int, deadline: float, out: Path
    ) -> None:
        self.ports = list(ports)
        self.port = self.ports[0]  # the node of the current session
        self.name = name
        self.rng = random.Random(seed)
        self.deadline = deadline
        self.fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.sequence = 0

    def record(self, event: str, **fields: Any) -> None:
        fields["ev"] = event
        fields["client"] = self.name
        os.write(self.fd, (json.dumps(fields) + "\n").encode())

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                self.session()
        except (ReplyError, OSError) as error:
            self.record("error", what=f"{type(error).__name__}: {error}", t=time.monotonic())
        finally:
            os.close(self.fd)

    def session(self) -> None:
        # Each session on a node of its own choosing (the only node, in memory).
        self.port = self.ports[0] if len(self.ports) == 1 else self.rng.choice(self.ports)
        conn = LineSocket(self.port)
        self.session_name = f"{self.name}.{self.sequence}"
        holds: dict[tuple[str, bool], Hold] = {}
        try:
            for _ in range(self.rng.randint(1, 25)):
                if time.monotonic() >= self.deadline:
                    break
                self.step(conn, holds)
            if self.rng.random() < 0.5:  # a tidy client; the others just hang up
                for hold in list(holds.values()):
                    self.release(conn, hold, holds)
        finally:
            self.record("close", session=self.session_name, t=time.monotonic())
            conn.close()

    def new_hold(self, key: str, shared: bool, lease: bool) -> Hold:
        self.sequence += 1
        return Hold(f"{self.name}.{self.sequence}", key, shared, lease)

    def step(self, conn: LineSocket, holds: dict[tuple[str, bool], Hold]) -> None:
        rng = self.rng
        free_x = [k for k in EXCLUSIVE_KEYS if (k, False) not in holds]
        free_s = [k for k in SHARED_LIMITS if (k, True) not in holds]
        action = rng.random()
        if holds and action < 0.35:
            hold = rng.choice(list(holds.values()))
            if hold.lease and rng.random() < 0.3:
                self.renew(conn, hold, holds)
            else:
                self.release(conn, hold, holds)
        elif action < 0.5 and free_x:
            self.try_once(conn, rng.choice(free_x), holds)
        elif action < 0.7 and free_x:
            self.lock_wait(conn, rng.choice(free_x), holds)
        elif action < 0.8 and len(free_x) >= 2:
            self.mlock(conn, rng.sample(free_x, rng.randint(2, min(3, len(free_x)))), holds)
        elif free_s:
            self.lock_shared(conn, rng.choice(free_s), holds)
        # Hold for a while; now and then past a lease's ttl, so leases do expire.
        time.sleep(rng.choice([0.0, 0.001, 0.005, 0.02, 0.05]))

    def ttl(self) -> float | None:
        return round(self.rng.uniform(0.2, MAX_TTL), 3) if self.rng.random() < 0.3 else None

    def fetch_token(self, conn: LineSocket, key: str) -> tuple[int | None, float]:
        reply = conn.request(f"token {key}")
        now = time.monotonic()
        if reply.startswith("200 "):
            return int(reply[4:]), now
        if reply != "403 Not Locked":
            raise ReplyError(f"token {key}: {reply!r}")
        return None, now

    def granted(
        self,
        holds: dict[tuple[str, bool], Hold],
        key: str,
        *,
        shared: bool,
        via: str,
        sent: float,
        at: float,
        ttl: float | None,
        token: int | None = None,
        token_at: float | None = None,
        limit: int | None = None,
    ) -> None:
        hold = self.new_hold(key, shared, ttl is not None)
        holds[(key, shared)] = hold
        self.record(
            "grant",
            hold=hold.hold_id,
            session=self.session_name,
            key=key,
            shared=shared,
            via=via,
            sent=sent,
            t=at,
            ttl=ttl,
            token=token,
            token_at=token_at,
            limit=limit,
            port=self.port,
        )

    def exclusive_granted(
        self,
        conn: LineSocket,
        holds: dict[tuple[str, bool], Hold],
        keys: list[str],
        via: str,
        sent: float,
        at: float,
        ttl: float | None,
    ) -> None:
        for key in keys:
            token, token_at = self.fetch_token(conn, key)
            self.granted(
                holds, key, shared=False, via=via, sent=sent, at=at, ttl=ttl,
                token=token, token_at=token_at,
            )  # fmt: skip

    def try_once(self, conn: LineSocket, key: str, holds: dict[tuple[str, bool], Hold]) -> None:
        sent = time.monotonic()
        reply = conn.request(f"g {key}")
        at = time.monotonic()
        if reply == "1 Got Lock":
            self.exclusive_granted(conn, holds, [key], "g", sent, at, None)
        elif reply != "0 Cannot Get Lock":
            raise ReplyError(f"g {key}: {reply!r}")

    def lock_wait(self, conn: LineSocket, key: str, holds: dict[tuple[str, bool], Hold]) -> None:
        wait = round(self.rng.uniform(0.01, MAX_WAIT), 3)
        ttl = self.ttl()
        option = f" ttl={ttl}" if ttl else ""
        sent = time.monotonic()
        reply = conn.request(f"lock {key} {wait}{option}")
        at = time.monotonic()
        if reply == "200 Acquired":
            self.exclusive_granted(conn, holds, [key], "lock", sent, at, ttl)
        elif reply != "409 Unavailable":
            raise ReplyError(f"lock {key}: {reply!r}")

    def mlock(self, conn: LineSocket, keys: list[str], holds: dict[tuple[str, bool], Hold]) -> None:
        wait = round(self.rng.uniform(0.0, MAX_WAIT), 3)
        ttl = self.ttl()
        option = f" ttl={ttl}" if ttl else ""
        sent = time.monotonic()
        reply = conn.request(f"mlock {' '.join(keys)} wait={wait}{option}")
        at = time.monotonic()
        if reply == "200 Acquired":
            self.exclusive_granted(conn, holds, keys, "mlock", sent, at, ttl)
        elif not reply.startswith("409 Unavailable "):
            raise ReplyError(f"mlock {keys}: {reply!r}")

    def lock_shared(self, conn: LineSocket, key: str, holds: dict[tuple[str, bool], Hold]) -> None:
        limit = SHARED_LIMITS[key]
        wait = round(self.rng.uniform(0.01, MAX_WAIT), 3)
        ttl = self.ttl()
        option = f" ttl={ttl}" if ttl else ""
        sent = time.monotonic()
        reply = conn.request(f"lock_shared {key} {wait} limit={limit}{option}")
        at = time.monotonic()
        code, _, count = reply.partition(" ")
        if not count.isdigit() or code not in ("200", "409"):
            raise ReplyError(f"lock_shared {key}: {reply!r}")
        if code == "200":
            if not 1 <= int(count) <= limit:
                self.record("violation", what=f"lock_shared {key} limit={limit}: {reply!r}")
            self.granted(
                holds, key, shared=True, via="lock_shared", sent=sent, at=at, ttl=ttl, limit=limit
            )

    def release(self, conn: LineSocket, hold: Hold, holds: dict[tuple[str, bool], Hold]) -> None:
        if hold.shared:
            line, ok = f"unlock_shared {hold.key}", ("200 ",)
        elif self.rng.random() < 0.5:
            line, ok = f"r {hold.key}", ("1 Released Lock",)
        else:
            line, ok = f"unlock {hold.key}", ("200 Unlocked",)
        self.record("release", hold=hold.hold_id, t=time.monotonic())
        reply = conn.request(line)
        del holds[(hold.key, hold.shared)]
        released = reply.startswith(ok)
        if not released and reply not in ("403 Not Locked", "0 Cannot Release Lock"):
            raise ReplyError(f"{line}: {reply!r}")
        self.record("released", hold=hold.hold_id, ok=released, t=time.monotonic())

    def renew(self, conn: LineSocket, hold: Hold, holds: dict[tuple[str, bool], Hold]) -> None:
        ttl = round(self.rng.uniform(0.2, MAX_TTL), 3)
        sent = time.monotonic()
        reply = conn.request(f"renew {hold.key} ttl={ttl}")
        at = time.monotonic()
        if reply == "200 Renewed":
            self.record("renewed", hold=hold.hold_id, sent=sent, ttl=ttl, t=at)
        elif reply == "403 Not Locked":
            del holds[(hold.key, hold.shared)]  # its lease ran out
            self.record("renew_refused", hold=hold.hold_id, t=at)
        else:
            raise ReplyError(f"renew {hold.key}: {reply!r}")


def worker_main(
    ports: Sequence[int], seed: int, clients: int, deadline: float, out_dir: Path
) -> None:
    """One worker process: ``clients`` threads, each a :class:`Client`."""
    threads = []
    for index in range(clients):
        name = f"{os.getpid()}.{index}"
        client = Client(ports, name, seed * 1000 + index, deadline, out_dir / f"{name}.jsonl")
        threads.append(threading.Thread(target=client.run))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# -------------------------------------------------------------------- the run


@dataclass
class Report:
    """What a run did and what the checker found."""

    seconds: float
    workers_started: int = 0
    kills: int = 0
    grants: dict[str, int] = field(default_factory=dict)
    releases: int = 0
    expired_leases_seen: int = 0
    max_shared: dict[str, int] = field(default_factory=dict)
    #: Hand-overs done: predecessors that exited 0 once their successor listened.
    handovers: int = 0
    #: When each of them began (its successor started) and was done (its predecessor
    #: exited), in seconds from the start of the run.
    handovers_at: list[tuple[float, float]] = field(default_factory=list)
    #: The pause of each, from its successor's log: when the old process stopped
    #: answering and the new one began, in seconds from the start of the run. The
    #: hand-over itself is mostly the successor starting up (seconds on a loaded
    #: machine), during which the old process serves on.
    pauses_at: list[tuple[float, float]] = field(default_factory=list)
    #: Client sessions answered both before a pause and after it: their connection
    #: moved to the successor, open, and went on.
    carried_sessions: int = 0
    #: What each successor logged when it took over (what moved, how long the pause).
    handover_notes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def summary(self) -> str:
        grants = ", ".join(f"{via} {n}" for via, n in sorted(self.grants.items()))
        handovers = ""
        if self.handovers_at:
            at = ", ".join(f"{began:.1f}-{done:.1f}" for began, done in self.handovers_at)
            handovers = (
                f"; {self.handovers} hand-overs, at {at} s, {self.carried_sessions} client "
                f"sessions answered across one"
            )
        return (
            f"safety: {self.seconds:.0f} s, {self.workers_started} worker processes, "
            f"{self.kills} SIGKILLed; grants: {grants} ({sum(self.grants.values())} in all); "
            f"releases {self.releases}; leases seen expiring {self.expired_leases_seen}; "
            f"max shared holders {self.max_shared} (limits {SHARED_LIMITS}){handovers}; "
            f"violations {len(self.violations)}"
        ) + "".join(f"\n  hand-over {n}: {note}" for n, note in enumerate(self.handover_notes, 1))


# ------------------------------------------------------------------ hand-overs


class ServerChain:
    """One elockd and the successors that take it over in turn, on one control socket.

    Why a class: across hand-overs the port stays the same but the process changes,
    and the checker must know which process is the live one (to stop it at the end,
    and to see that each predecessor really went away, with status 0). Successors get
    the same flags as the first process (its limits), so a hand-over changes nothing
    but the process. Use it as a context manager: every process it started is
    stopped, by pid, on the way out.
    """

    def __init__(self, directory: Path, *args: str) -> None:
        self.control = directory / "control.sock"
        self.args = args
        self.processes: list[subprocess.Popen[str]] = []
        self.logs: list[list[str]] = []  # what each process logged, in start order
        self.handovers = 0  # predecessors that exited 0 after their successor listened
        self.problems: list[str] = []
        self.notes: list[str] = []  # each successor's own word on what it took over
        self.pauses: list[tuple[float, float] | None] = []  # monotonic, from those words
        self.current, self.port = self._start("--control-socket", str(self.control))

    def _start(self, *args: str) -> tuple[subprocess.Popen[str], int]:
        log: list[str] = []
        self.logs.append(log)
        process, port = start_server(*args, *self.args, log=log)
        self.processes.append(process)
        return process, port

    def hand_over(self, *extra: str) -> bool:
        """Start a successor (``extra``: flags for it alone), wait until the current
        process exits, and say whether the hand-over was done: the successor listens on
        the same port and its predecessor exited 0. Anything else goes to
        :attr:`problems`; a successor that fails to start leaves the old one serving."""
        number = self.handovers + 1
        try:
            successor, port = self._start("--take-over", str(self.control), *extra)
        except RuntimeError as error:
            self.problems.append(
                f"hand-over {number}: the successor failed to start ({error}): "
                f"{last_lines(self.logs[-1])}"
            )
            return False
        previous, self.current = self.current, successor
        try:
            code = previous.wait(timeout=HANDOVER_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.problems.append(
                f"hand-over {number}: pid {previous.pid} still runs "
                f"{HANDOVER_EXIT_TIMEOUT:.0f} s after its successor took over"
            )
            return False
        if code != 0:
            log = self.logs[self.processes.index(previous)]
            self.problems.append(
                f"hand-over {number}: pid {previous.pid} exited with {code}: {last_lines(log)}"
            )
            return False
        if port != self.port:
            self.problems.append(f"hand-over {number}: the successor listens on {port}")
            return False
        self.handovers += 1
        took = [line for line in self.logs[-1] if "took over from pid" in line]
        self.notes.append(took[0].split("] ", 1)[-1].strip() if took else "(not logged)")
        self.pauses.append(pause_window(took[0]) if took else None)
        return True

    def __enter__(self) -> ServerChain:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for process in self.processes:
            stop_server(process)


def pause_window(took_over: str) -> tuple[float, float] | None:
    """When a successor's pause began and ended, on this process's monotonic clock,
    from its "took over ... pause N ms" log line: the line's time stamp is the end."""
    match = re.match(r"(\S+) .*pause (\d+) ms", took_over)
    if match is None:
        return None
    try:
        ended_wall = datetime.fromisoformat(match[1]).timestamp()
    except ValueError:
        return None
    ended = ended_wall - (time.time() - time.monotonic())
    return ended - int(match[2]) / 1000, ended


def last_lines(log: list[str], count: int = 5) -> str:
    """The end of a process's log, on one line, for a problem report."""
    return " | ".join(line.strip() for line in log[-count:]) or "(nothing logged)"


def hand_over_on_schedule(
    chain: ServerChain, when: Sequence[float], report: Report, start: float
) -> None:
    """Hand ``chain`` over at each time in ``when`` (monotonic, sorted); a late one
    follows its predecessor at once. Stops at the first hand-over that was not done:
    after a failure, which process serves is the thing in question."""
    for moment in when:
        time.sleep(max(0.0, moment - time.monotonic()))
        began = time.monotonic() - start
        if not chain.hand_over():
            return
        done = time.monotonic() - start
        report.handovers_at.append((began, done))
        pause = chain.pauses[-1]
        report.pauses_at.append(
            (began, done) if pause is None else (pause[0] - start, pause[1] - start)
        )


def spawn_worker(
    ports: Sequence[int], seed: int, clients: int, deadline: float, out_dir: Path
) -> Any:
    return subprocess.Popen(
        [
            sys.executable, "-m", "tests.support.safety", "worker",
            *itertools.chain.from_iterable(("--port", str(port)) for port in ports),
            "--seed", str(seed), "--clients", str(clients), "--deadline", repr(deadline),
            "--out", str(out_dir),
        ],
        cwd=Path(__file__).resolve().parents[2],  # the repository root
    )  # fmt: skip


def run(
    ports: int | Sequence[int],
    seconds: float,
    out_dir: Path,
    *,
    processes: int = 4,
    clients: int = 6,
    seed: int = 1,
    kill_every: tuple[float, float] = (0.3, 1.5),
    handovers: int = 0,
    chain: ServerChain | None = None,
) -> Report:
    """Drive the server at ``ports`` (one port, or the nodes of one cluster) for
    ``seconds``, then check everything.

    ``handovers``: how many times ``chain`` (the server at one of ``ports``) is
    handed over to a successor during the run, at evenly spread times with some
    jitter, all in the run's first two thirds. Kills go on meanwhile, so a worker
    may die in the middle of a hand-over."""
    nodes = [ports] if isinstance(ports, int) else list(ports)
    if handovers and (chain is None or chain.port not in nodes):
        raise ValueError("handovers need the ServerChain that serves one of the ports")
    rng = random.Random(seed)
    start = time.monotonic()
    deadline = start + seconds
    report = Report(seconds)
    handing_over: threading.Thread | None = None
    if chain is not None and handovers:
        # A generator of its own, so that the kill schedule of a seed stays the same.
        jitter = random.Random(seed + 1)
        # Spread over the first two thirds: the last third is room for a successor
        # that starts slowly on a loaded machine (CI saw one hand-over take 1.3 s) to
        # finish while the clients still run, which is the point of the exercise.
        spacing = seconds * 2 / 3 / (handovers + 1)
        when = [
            start + spacing * (n + 1) + jitter.uniform(-spacing / 4, spacing / 4)
            for n in range(handovers)
        ]
        handing_over = threading.Thread(
            target=hand_over_on_schedule, args=(chain, when, report, start), daemon=True
        )
        handing_over.start()
    kills: dict[str, float] = {}  # pid -> when the parent decided to kill it
    live: list[Any] = []
    finished: list[Any] = []

    def start_worker() -> None:
        report.workers_started += 1
        live.append(spawn_worker(nodes, rng.randrange(1 << 30), clients, deadline, out_dir))

    for _ in range(processes):
        start_worker()
    next_kill = start + rng.uniform(*kill_every)
    while time.monotonic() < deadline:
        time.sleep(max(0.0, min(next_kill, deadline) - time.monotonic()))
        if time.monotonic() >= deadline:
            break
        victim = rng.choice(live)
        kills[str(victim.pid)] = time.monotonic()  # before the kill: conservative
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        live.remove(victim)
        report.kills += 1
        if deadline - time.monotonic() > 1.0:
            start_worker()
        next_kill = time.monotonic() + rng.uniform(*kill_every)
    for process in live:
        try:
            code = process.wait(timeout=REPLY_TIMEOUT + MAX_WAIT + 5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            report.violations.append(f"worker {process.pid} did not stop by its deadline")
            continue
        if code != 0:
            report.violations.append(f"worker {process.pid} exited with {code}")
        finished.append(process)
    expected_handovers = None
    if chain is not None and handing_over is not None:
        # Each hand-over is bounded by its exit timeout once its successor started.
        handing_over.join(timeout=handovers * (HANDOVER_EXIT_TIMEOUT + 30))
        if handing_over.is_alive():
            report.violations.append("the hand-overs did not finish (a successor hangs?)")
        report.violations.extend(chain.problems)
        report.handovers = chain.handovers
        report.handover_notes = chain.notes
        if report.handovers != handovers:
            report.violations.append(f"{report.handovers} of {handovers} hand-overs done")
        expected_handovers = report.handovers
    records = list(load_records(out_dir))
    check(records, kills, report)
    if chain is not None:
        pauses = [(start + began, start + ended) for began, ended in report.pauses_at]
        count_carried(records, chain.port, pauses, report)
    for port in nodes:
        counted = expected_handovers if chain is not None and port == chain.port else None
        report.violations.extend(final_state_problems(port, handovers=counted))
    return report


def load_records(out_dir: Path) -> Iterator[Record]:
    for path in sorted(out_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line of a killed client, half written


def count_carried(
    records: list[Record], port: int, pauses: Sequence[tuple[float, float]], report: Report
) -> None:
    """Count what lived through a hand-over of the server at ``port`` (``pauses``:
    when each one's pause began and ended, monotonic), so that a clean run shows it
    tested the hand-overs themselves and not the quiet between them (nor sessions
    on another node of the cluster)."""
    session_of: dict[str, str] = {}
    answered: dict[str, list[float]] = defaultdict(list)  # session -> reply times
    for record in records:
        if record["ev"] == "grant" and record["port"] == port:
            session_of[record["hold"]] = record["session"]
            answered[record["session"]].append(record["t"])
    for record in records:
        session = session_of.get(record.get("hold", ""))
        if session is not None and record["ev"] in ("released", "renewed", "renew_refused"):
            answered[session].append(record["t"])
    report.carried_sessions = sum(
        any(min(times) < began and max(times) > ended for began, ended in pauses)
        for times in answered.values()
    )


# ------------------------------------------------------------------ the checks


@dataclass
class Interval:
    """A recorded hold: inside the true hold's interval, by construction."""

    hold: str
    key: str
    shared: bool
    start: float
    end: float
    token: int | None
    limit: int | None


def intervals(records: list[Record], kills: dict[str, float], report: Report) -> list[Interval]:
    """Turn client records into conservative hold intervals; note lost holds."""
    grants: dict[str, Record] = {}
    releases: dict[str, float] = {}
    lease_floor: dict[str, float] = {}  # the lease ends no earlier than this
    closes: dict[str, float] = {}
    for record in records:
        event = record["ev"]
        if event == "grant":
            grants[record["hold"]] = record
            report.grants[record["via"]] = report.grants.get(record["via"], 0) + 1
            if record["ttl"] is not None:
                lease_floor[record["hold"]] = record["sent"] + record["ttl"]
        elif event == "release":
            releases[record["hold"]] = record["t"]
        elif event == "renewed":
            lease_floor[record["hold"]] = record["sent"] + record["ttl"]
        elif event == "close":
            closes[record["session"]] = record["t"]
        elif event in ("error", "violation"):
            report.violations.append(f"client {record['client']}: {record['what']}")
    results: dict[str, Record] = {}
    refusals: dict[str, float] = {}
    for record in records:
        if record["ev"] == "released":
            results[record["hold"]] = record
        elif record["ev"] == "renew_refused":
            refusals[record["hold"]] = record["t"]
    found = []
    for hold_id, grant in grants.items():
        pid = grant["client"].split(".")[0]
        floor = lease_floor.get(hold_id)
        # A refused release or renew: fine for a lease past its ttl, never otherwise.
        refused_at = refusals.get(hold_id)
        result = results.get(hold_id)
        if result is not None:
            report.releases += 1
            if not result["ok"]:
                refused_at = result["t"]
        if refused_at is not None:
            if floor is None:
                report.violations.append(f"hold {hold_id} on {grant['key']} was lost")
            elif refused_at < floor:
                report.violations.append(
                    f"lease {hold_id} on {grant['key']} ended {floor - refused_at:.3f} s early"
                )
            else:
                report.expired_leases_seen += 1
        token_at = grant["token_at"]
        if token_at is not None and grant["token"] is None and (floor is None or token_at < floor):
            report.violations.append(f"no token for live hold {hold_id} on {grant['key']}")
        end = releases.get(hold_id, float("inf"))
        if floor is not None:
            end = min(end, floor)  # a lease: the connection's end does not end it
            if refused_at is not None:
                end = min(end, refused_at)
        else:
            end = min(end, closes.get(grant["session"], float("inf")), kills.get(pid, float("inf")))
        if end == float("inf"):
            report.violations.append(f"hold {hold_id} has no recorded end")
            continue
        found.append(
            Interval(
                hold_id, grant["key"], grant["shared"], grant["t"], end, grant["token"],
                grant["limit"],
            )
        )  # fmt: skip
    return found


def check(records: list[Record], kills: dict[str, float], report: Report) -> None:
    """Every safety property that the records can show; violations go to ``report``."""
    holds = intervals(records, kills, report)
    by_key: dict[tuple[str, bool], list[Interval]] = defaultdict(list)
    for hold in holds:
        by_key[(hold.key, hold.shared)].append(hold)
    seen_tokens: dict[int, str] = {}  # token -> hold
    for (key, shared), key_holds in sorted(by_key.items()):
        key_holds.sort(key=lambda h: h.start)
        if shared:
            check_shared(key, key_holds, report)
            continue
        latest: Interval | None = None  # the previous hold that ends last
        for hold in key_holds:
            if latest is not None and hold.start < latest.end:
                report.violations.append(
                    f"exclusive overlap on {key}: {latest.hold} [{latest.start:.4f}, "
                    f"{latest.end:.4f}) and {hold.hold} from {hold.start:.4f}"
                )
            if latest is None or hold.end > latest.end:
                latest = hold
        # Recorded starts lie inside disjoint true holds, so they are in grant order.
        tokens = [(h.token, h.hold) for h in key_holds if h.token is not None]
        for (before, first), (after, second) in itertools.pairwise(tokens):
            if after <= before:
                report.violations.append(
                    f"token on {key} went from {before} ({first}) to {after} ({second})"
                )
        for token, hold_id in tokens:
            if token in seen_tokens:
                report.violations.append(
                    f"token {token} given to {seen_tokens[token]} and {hold_id}"
                )
            seen_tokens[token] = hold_id


def check_shared(key: str, key_holds: list[Interval], report: Report) -> None:
    """Sweep the holds' ends and starts: the count must never pass the key's limit."""
    events = [(h.start, 1) for h in key_holds if h.start < h.end]
    events += [(h.end, -1) for h in key_holds if h.start < h.end]
    events.sort()  # at equal times ends (-1) come first: intervals are half-open
    count = peak = 0
    for when, step in events:
        count += step
        if count > peak:
            peak = count
            limit = min(h.limit or 0 for h in key_holds)
            if count > limit:
                report.violations.append(f"{count} shared holders of {key} at {when:.4f}")
    report.max_shared[key] = peak


def final_state_problems(
    port: int, settle: float = MAX_TTL + 5.0, *, handovers: int | None = None
) -> list[str]:
    """Every freed hold is grantable again: once the dead clients are noticed and the
    leases have run out, the server holds nothing and a fresh client gets every key.
    A cluster node reports the cluster's locks and waiters (its own leases and
    connections): run it on each node in turn. ``handovers``: how many the server
    must count (``q``), so the process that answers is the last of the chain."""
    try:
        conn = LineSocket(port)
    except OSError as error:
        return [f"the server at port {port} is unreachable after the run: {error}"]
    try:
        deadline = time.monotonic() + settle
        wanted = {"locks": 0, "shared_locks": 0, "waiting": 0, "leases": 0, "connections": 1}
        while True:
            conn.send("q")
            stats: dict[str, int] = {}
            while (line := conn.line()) != "END":
                name, _, value = line.partition(": ")
                stats[name] = int(value)
            left = {name: stats[name] for name in wanted if stats[name] != wanted[name]}
            if not left:
                break
            if time.monotonic() > deadline:
                return [
                    f"{settle:.0f} s after the run the server at port {port} still reports {left}"
                ]
            time.sleep(0.05)
        problems = []
        if handovers is not None and stats.get("handovers") != handovers:
            problems.append(
                f"the server at port {port} counts {stats.get('handovers')} hand-overs, "
                f"not {handovers}"
            )
        reply = conn.request("mlock " + " ".join(EXCLUSIVE_KEYS))
        if reply != "200 Acquired":
            problems.append(f"a fresh client of port {port} could not take every key: {reply!r}")
        for key in SHARED_LIMITS:
            reply = conn.request(f"lock_shared {key} limit=1")
            if reply != "200 1":
                problems.append(f"a fresh client of port {port} could not take {key}: {reply!r}")
        conn.request("unlock_all")
        return problems
    except (OSError, ReplyError) as error:
        return [f"the server at port {port} failed the final check: {error}"]
    finally:
        conn.close()


# ------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.safety", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("worker", help="(internal) one worker process")
    worker.add_argument("--port", type=int, action="append", required=True)
    worker.add_argument("--seed", type=int, required=True)
    worker.add_argument("--clients", type=int, required=True)
    worker.add_argument("--deadline", type=float, required=True)
    worker.add_argument("--out", type=Path, required=True)
    runner = commands.add_parser("run", help="start a server and check it")
    runner.add_argument("--seconds", type=float, default=60.0)
    runner.add_argument("--processes", type=int, default=4)
    runner.add_argument("--clients", type=int, default=6)
    runner.add_argument("--seed", type=int, default=int(time.time()))
    runner.add_argument(
        "--handovers", type=int, default=0, help="hand the server over this many times"
    )
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker_main(args.port, args.seed, args.clients, args.deadline, args.out)
        return 0
    with (
        tempfile.TemporaryDirectory() as out,
        tempfile.TemporaryDirectory() as control,
        ServerChain(Path(control)) as chain,
    ):
        report = run(
            chain.port, args.seconds, Path(out), processes=args.processes,
            clients=args.clients, seed=args.seed, handovers=args.handovers, chain=chain,
        )  # fmt: skip
    print(f"seed {args.seed}: {report.summary()}")
    for violation in report.violations:
        print("VIOLATION:", violation)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
