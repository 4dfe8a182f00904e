"""The clients of a partition run (tests/support/partition_lab.py is the lab) and the checks.

All of a run's clients, its etcd watch and its cuts live in one trio run inside
the lab's clients namespace, so every time they record is on one clock: clients
contend for three keys with ``lock K 30``, poll ``token K`` every 0.1 s while they
hold (each ``200 <token>`` is the node confirming the hold at that moment) and
``unlock K``; the watch records when etcd deleted each queue entry.

:func:`figures` runs the project's safety checker (tests/support/safety.py) over the holds:
a hold runs from its grant to the *sending* of its last confirmed ``token`` poll
(the node confirmed it later than that), so two overlapping holds of one key are
two confirmed holders at once. Besides that: confirmations sent after etcd had
deleted the hold's entry, and for every hold that node A ended by telling its client
(a closed connection or a non-``200`` reply), its *lead*: how long before B's next
grant of that key the client was told.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from elockd.backend.cluster.etcd.client import EtcdClient, prefix_end
from tests.support.partition_lab import BROKEN, LabNode
from tests.support.safety import Report, check

KEYS = ["x0", "x1", "x2"]
CLIENTS_PER_NODE = 4
POLL = 0.1  # how often a holder asks ``token K``


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
    #: The holds told less than 0.3 s before B's grant, each in detail.
    close_calls: list[str] = field(default_factory=list)

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
    close_calls: list[str] = []
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
            if leads[-1] < 0.3:
                deleted = outcome.deleted.get(
                    (hold.key, ((hold.token or 0) - outcome.token_floor) // 64)
                )
                since = "-" if deleted is None else f"{hold.told - deleted:+.3f}"
                close_calls.append(
                    f"{hold.hold_id} of {hold.client} on {hold.key}: told ({hold.told_how}) "
                    f"{leads[-1]:.3f} s before B's grant; after etcd deleted its entry: {since} s; "
                    f"last confirmed {hold.end - hold.told:+.3f} s"
                )
    grants: dict[str, int] = defaultdict(int)
    for hold in outcome.holds:
        grants[hold.node] += 1
    return Figures(
        len(overlaps), longest if overlaps else 0.0, len(regressions),
        others + outcome.problems, stale, latest, leads, dict(grants), close_calls,
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

    async def idle(self, seconds: float, hold: Hold) -> None:
        """Wait ``seconds`` between polls, but notice at once a close the node sends
        meanwhile (it sends nothing else unasked): the moment the client is told is
        the point of the lead, and a poll would learn of it up to ``seconds`` late."""
        with trio.move_on_after(seconds):
            await trio.lowlevel.wait_readable(self.stream.socket)
            try:
                chunk = await self.stream.receive_some(65536)
            except BROKEN:
                chunk = b""
            if not chunk:
                hold.told, hold.told_how = time.monotonic(), "closed"
                raise Closed
            self.buffer += chunk
            await trio.sleep_forever()


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
            await line.idle(POLL, hold)
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

    async def a_holds(self, limit: float = 5.0) -> Hold | None:
        """Wait (up to ``limit``) until some client of node A holds a key, so that the
        cut that follows has a hold of A's to take away; that hold."""
        with trio.move_on_after(limit):
            while True:
                for hold in self.outcome.holds:
                    if hold.node == "a" and hold.told is None and hold.unlock_sent is None:
                        return hold
                await trio.sleep(0.05)
        return None

    async def wait_then_hold(
        self,
        client: str,
        node: str,
        key: str,
        seconds: float,
        *,
        through_cuts: bool = True,
        queued: trio.Event | None = None,
    ) -> None:
        """One scripted client: ``lock key`` (waiting in line; ``queued`` is set once
        it is connected), hold it ``seconds`` (polling), then unlock, unless told lost."""
        try:
            line = await self.connect(node)
            if queued is not None:
                queued.set()
            hold = await self.lock(line, client, node, key)
            if hold is not None and await self.hold_for(
                line, hold, seconds, through_cuts=through_cuts
            ):
                await self.unlock(line, hold)
        except GONE:
            self.note("<closed>")

    async def kill(self, node: str, key: str, admin_token: str) -> None:
        """An operator's ``kill key`` through ``node``; its reply and when it came
        go into the run's timeline (``cuts``)."""
        line = await self.connect(node)
        try:
            assert await line.request(f"auth {admin_token}") == "200 OK"
            sent = time.monotonic()
            self.outcome.cuts.append((sent, f"kill {key} through {node.upper()}"))
            reply = await line.request(f"kill {key}")
            self.outcome.cuts.append((time.monotonic(), f"kill answered {reply!r}"))
            self.note(reply)
        finally:
            await line.stream.aclose()

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
