"""The nemesis's clients: every verb that takes or reports a hold, all recorded.

They run in one trio program in the lab's clients namespace and write every
request and reply into one :class:`History` (tests/support/nemesis_history.py):

* *holders* take a key (``lock K W``, ``g K`` or ``mlock K1 K2 wait=W``), hold it
  for a moment asking ``token``/``info``/``renew K ttl=S``/``lock K`` again, then
  free it; told lost (a 403, a closed connection), they connect anew. While their
  node is cut or paused they hold on (up to 3 TTLs more): a fault must find
  holders that go on asking;
* *sharers* take ``lock_shared TAGs0 2 limit=2`` and ``renew`` it a moment;
* *observers* ask ``info``, ``i``, ``d``, ``ls`` and ``si`` about the keys;
* *watchers* keep a ``watch`` stream open;
* *throttlers* ask ``throttle TAGt0 10 1 wait=1``;
* a *crash* (:meth:`Clients.crash`) makes a holder vanish mid-hold, and sends a
  waiter for its key through each node (so the checker sees when it is freed);
* :meth:`Clients.kill` is the operator: ``auth`` with the admin token, ``kill K``.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Awaitable, Callable

import trio

from tests.support.nemesis_checker import GRANTED, free_bound
from tests.support.nemesis_history import History, Throttle, WatchLine
from tests.support.nemesis_schedule import KEYS
from tests.support.partition_lab import BROKEN, LabNode

HOLDERS, SHARERS, OBSERVERS, WATCHERS, THROTTLERS = 3, 2, 1, 1, 2
#: What a holder's ``renew`` asks: its hold becomes a lease of this many seconds.
LEASE = 3
THROTTLE = Throttle(10, 1.0, 10)
#: Verbs whose answer is lines up to ``END``.
LISTS = ("d", "ls")
#: A status line (``409 Backend Unavailable``), never a row (rows start with a key).
REFUSAL = re.compile(r"\d{3} ")


class Gone(Exception):
    """The connection ended (closed by the node, reset, or crashed)."""


class Conn:
    """One session: a connection that names itself ``name`` and records every
    exchange in the history."""

    def __init__(self, history: History, node: str, name: str, stream: trio.SocketStream) -> None:
        self.history, self.node, self.name, self.stream = history, node, name, stream
        self.buffer = b""

    async def line(self) -> str:
        while b"\r\n" not in self.buffer:
            try:
                chunk = await self.stream.receive_some(65536)
            except BROKEN as error:
                raise Gone from error
            if not chunk:
                raise Gone
            self.buffer += chunk
        reply, _, self.buffer = self.buffer.partition(b"\r\n")
        return reply.decode()

    async def ask(self, request: str) -> str:
        """Send ``request``; its reply ("END" for a list, its lines in ``more``).
        Recorded whatever happens; raises Gone when the connection ended."""
        exchange = self.history.record(self.name, self.node, request, time.monotonic())
        try:
            await self.stream.send_all(request.encode() + b"\n")
        except BROKEN as error:
            raise Gone from error
        reply = await self.line()
        if exchange.verb in LISTS:
            # A listing ends with END, or with a refusal in place of the rest
            # (a node that can no longer vouch for its copy): the rows before stand.
            while reply != "END" and not REFUSAL.match(reply):
                exchange.more.append(reply)
                reply = await self.line()
        exchange.reply, exchange.received = reply, time.monotonic()
        return reply

    async def close(self) -> None:
        with contextlib.suppress(*BROKEN):
            await self.stream.aclose()


class Clients:
    """Every client of one schedule's run, against nodes ``nodes``."""

    def __init__(
        self, history: History, nodes: dict[str, LabNode], admin_token: str, tag: str = ""
    ) -> None:
        self.history = history
        #: Every key name starts with ``tag``: a schedule's keys are its own even on
        #: nodes that served the schedule before.
        self.tag = tag
        self.keys = [tag + key for key in KEYS]
        self.nodes = nodes
        self.admin_token = admin_token
        self.count = 0
        #: Holders by session name, with what each holds now.
        self.holding: dict[str, tuple[set[str], trio.CancelScope]] = {}
        #: Per node, how many cuts and pauses of it are in force: its holders then
        #: keep holding (and asking) until told they lost the hold.
        self.troubled: dict[str, int] = dict.fromkeys(nodes, 0)
        self.nursery: trio.Nursery | None = None
        #: Set when a holder of the node sends ``info`` (a pause waits for one).
        self.info_sent = {node: trio.Event() for node in nodes}
        #: Set when a holder of the node that asks only ``token`` got a key (a cut
        #: waits for one).
        self.token_holder = {node: trio.Event() for node in nodes}
        #: The holders that hold a key now and ask only ``token`` about it.
        self.token_only: set[str] = set()
        history.throttles[tag + "t0"] = THROTTLE
        history.lease_ttl = LEASE

    async def connect(self, node: str, role: str) -> Conn:
        target = self.nodes[node]
        self.count += 1
        name = f"{node}{role}{self.count}"
        with trio.fail_after(5):
            stream = await trio.open_tcp_stream(target.host, target.port)
        conn = Conn(self.history, node, name, stream)
        await conn.ask(f"iam {name}")
        return conn

    async def forever(
        self, node: str, role: str, body: Callable[[Conn, random.Random], Awaitable[None]],
        rng: random.Random,
    ) -> None:  # fmt: skip
        """Run ``body`` on a fresh session, again whenever its connection ends."""
        while True:
            try:
                conn = await self.connect(node, role)
            except (OSError, Gone, trio.TooSlowError):
                await trio.sleep(0.2)
                continue
            try:
                await body(conn, rng)
            except Gone:
                pass
            finally:
                await conn.close()
            await trio.sleep(0.1)

    async def run(self, rng: random.Random) -> None:
        """Every client on both nodes, until cancelled."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for node in self.nodes:
                for role, count, body in (
                    ("h", HOLDERS, self.holder), ("s", SHARERS, self.sharer),
                    ("o", OBSERVERS, self.observer),
                    ("w", WATCHERS, self.watcher), ("t", THROTTLERS, self.throttler),
                ):  # fmt: skip
                    for _ in range(count):
                        nursery.start_soon(
                            self.forever, node, role, body, random.Random(rng.random())
                        )

    # ---------------------------------------------------------------- roles

    async def holder(self, conn: Conn, rng: random.Random) -> None:
        held: set[str] = set()
        with trio.CancelScope() as scope:
            self.holding[conn.name] = (held, scope)
            try:
                while True:
                    await self.hold_once(conn, rng, held)
            finally:
                del self.holding[conn.name]
                self.token_only.discard(conn.name)
        # Cancelled by a crash: the connection is closed without another word.
        self.history.crashes[conn.name] = time.monotonic()

    async def hold_once(self, conn: Conn, rng: random.Random, held: set[str]) -> None:
        choice = rng.random()
        if choice < 0.15:
            keys = rng.sample(self.keys, 2)
            request, release = f"mlock {keys[0]} {keys[1]} wait=2", "unlock"
        elif choice < 0.3:
            keys = [rng.choice(self.keys)]
            request, release = f"g {keys[0]}", "r"
        else:
            keys = [rng.choice(self.keys)]
            request, release = f"lock {keys[0]} 2", "unlock"
        if await conn.ask(request) not in GRANTED:
            await trio.sleep(rng.uniform(0.05, 0.2))
            return
        held.update(keys)
        # Most holds are short; one in four outlasts a node's lease (3 TTLs at most),
        # so that a fault finds holders that go on asking.
        long = rng.random() < 0.25
        until = time.monotonic() + (
            rng.uniform(2, 3 * self.history.ttl) if long else rng.uniform(0.3, 1.2)
        )
        # Half the holds ask only ``token``, which a node answers from its own
        # books: those go on asking through a cut, when a verb that reads etcd
        # waits for it.
        only_token = rng.random() < 0.5
        if only_token:
            self.token_only.add(conn.name)
            self.token_holder[conn.node].set()
        longest = until + 3 * self.history.ttl
        while time.monotonic() < until or (self.troubled[conn.node] and time.monotonic() < longest):
            await trio.sleep(rng.uniform(0.05, 0.15))
            key = rng.choice(keys)
            pick = 0.0 if only_token else rng.random()
            if pick < 0.4:
                ok = (await conn.ask(f"token {key}")).startswith("200 ")
            elif pick < 0.7:
                self.info_sent[conn.node].set()
                ok = f"exclusive={conn.name} " in await conn.ask(f"info {key}")
            elif pick < 0.9:
                ok = (await conn.ask(f"renew {key} ttl={LEASE}")).startswith("200 ")
            else:
                ok = await conn.ask(f"lock {key}") == "200 Acquired" or release == "r"
            if not ok:
                raise Gone  # told lost: a fresh session, as a client would
        self.token_only.discard(conn.name)
        for key in keys:
            await conn.ask(f"{release} {key}")
        held.clear()
        await trio.sleep(rng.uniform(0.0, 0.2))

    async def sharer(self, conn: Conn, rng: random.Random) -> None:
        """``lock_shared TAGs0 2 limit=2``, held a moment with ``renew`` (which
        confirms a shared hold), then ``unlock_shared``."""
        key = f"{self.tag}s0"
        while True:
            if not (await conn.ask(f"lock_shared {key} 2 limit=2")).startswith("200 "):
                await trio.sleep(rng.uniform(0.05, 0.2))
                continue
            until = time.monotonic() + rng.uniform(0.3, 1.0)
            while time.monotonic() < until:
                await trio.sleep(rng.uniform(0.05, 0.15))
                if not (await conn.ask(f"renew {key} ttl={LEASE}")).startswith("200 "):
                    raise Gone  # told lost
            await conn.ask(f"unlock_shared {key}")
            await trio.sleep(rng.uniform(0.0, 0.2))

    async def observer(self, conn: Conn, rng: random.Random) -> None:
        while True:
            key = rng.choice(self.keys)
            asks = (f"info {key}", f"i {key}", f"d {key}", f"ls {self.tag}x", f"si {self.tag}s0")
            await conn.ask(rng.choice(asks))
            await trio.sleep(rng.uniform(0.05, 0.15))

    async def watcher(self, conn: Conn, rng: random.Random) -> None:
        await conn.ask(f"watch {self.tag}x")
        while True:
            line = await conn.line()
            self.history.watch_lines.append(WatchLine(conn.name, conn.node, line, time.monotonic()))

    async def throttler(self, conn: Conn, rng: random.Random) -> None:
        rate = THROTTLE
        while True:
            await conn.ask(f"throttle {self.tag}t0 {rate.count} {rate.period:g} wait=1")
            await trio.sleep(rng.uniform(0.0, 0.05))

    # ---------------------------------------------------------------- faults

    async def crash(self, node: str, rng: random.Random) -> str | None:
        """A holder on ``node`` (else any) that holds a key vanishes; a waiter for
        its keys through each node. The session crashed, or None."""
        holding = [n for n, (held, _) in self.holding.items() if held]
        if not holding:
            return None
        mine = [n for n in holding if n.startswith(node)]
        name = rng.choice(mine or holding)
        held, scope = self.holding[name]
        keys = sorted(held)
        scope.cancel()
        for key in keys:
            for via in self.nodes:
                assert self.nursery is not None, "the clients do not run"
                self.nursery.start_soon(self.chase, via, key)
        return name

    async def chase(self, node: str, key: str, role: str = "c", extra: int = 2) -> None:
        """Wait for ``key`` (long enough to see it freed), then free it again."""
        wait = int(free_bound(self.history)) + extra
        with contextlib.suppress(OSError, Gone, trio.TooSlowError):
            conn = await self.connect(node, role)
            try:
                if await conn.ask(f"lock {key} {wait}") in GRANTED:
                    await conn.ask(f"unlock {key}")
            finally:
                await conn.close()

    async def kill(self, node: str, key: str) -> str:
        """The operator's ``kill`` through ``node``: of a key that a holder of the
        other node holds while that node is cut or paused, if any (the combination
        that matters), else of ``key``. A waiter for it through ``node`` follows,
        so that a grant after the kill is there to compare. The key killed."""
        other = next(n for n in self.nodes if n != node)
        held = [
            k for name, (keys, _) in self.holding.items() if name.startswith(other) for k in keys
        ]
        key = sorted(held)[0] if held and self.troubled[other] else self.tag + key
        assert self.nursery is not None, "the clients do not run"
        self.nursery.start_soon(self.chase, node, key)
        with contextlib.suppress(OSError, Gone, trio.TooSlowError):
            conn = await self.connect(node, "k")
            try:
                await conn.ask(f"auth {self.admin_token}")
                await conn.ask(f"kill {key}")
            finally:
                await conn.close()
        return key

    async def holder_asks_info(self, node: str, limit: float = 1.0) -> None:
        """Return as a holder of ``node`` sends ``info`` (or after ``limit``): a
        pause that comes then stops the node in the middle of answering it."""
        self.info_sent[node] = trio.Event()
        with trio.move_on_after(limit):
            await self.info_sent[node].wait()

    async def token_holder_on(self, node: str, limit: float = 1.0) -> None:
        """Return once a holder of ``node`` that asks only ``token`` holds a key (or
        after ``limit``): a cut that comes then finds it asking on through the cut."""
        if any(name.startswith(node) for name in self.token_only):
            return
        self.token_holder[node] = trio.Event()
        with trio.move_on_after(limit):
            await self.token_holder[node].wait()

    async def probe(self) -> None:
        """After the run, every key can be taken through each node (the checker
        reads the ``p`` sessions' answers)."""
        for node in self.nodes:
            for key in self.keys:
                await self.chase(node, key, "p", 1)
