"""The nemesis: schedules of mixed faults against two cluster nodes, checked.

One lab (tests/support/partition_lab.py: 3 etcd members, nodes A and B, the
clients, a switch) serves every schedule; each schedule gets fresh nodes on a
fresh key prefix. Both nodes run under libfaketime with a clock file
(tests/support/skewed_clock.py's library), so a schedule can jump a node's wall
clock while it runs; node A reaches etcd through the lab's delay proxy. Per
schedule: the clients (tests/support/nemesis_clients.py) run for a second, the
schedule's faults (tests/support/nemesis_schedule.py) come and go, every fault
is lifted, the clients go on for a TTL, every key is probed, and the one
checker (tests/support/nemesis_checker.py) reads the history.

``python -m tests.support.nemesis_run [--schedules N] [--seed S] [--ttl T]
[--planted]`` runs N schedules from seed S on, prints each schedule, the seed
range, the count and every violation with its key's timeline; exit 1 if any.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import trio

from tests.support.nemesis_checker import Violation, check, report
from tests.support.nemesis_clients import Clients
from tests.support.nemesis_history import Fault, History
from tests.support.nemesis_schedule import Schedule, Step, schedule
from tests.support.netns import enter
from tests.support.partition_lab import MEMBERS, Lab, LabNode, lab, why_no_lab
from tests.support.server_process import start_server, stop_server
from tests.support.skewed_clock import libfaketime

ADMIN_TOKEN = "nemesis-admin-token"
#: Seconds of clients before the first fault.
WARM_UP = 0.5


@dataclass
class Outcome:
    schedule: Schedule
    history: History
    violations: list[Violation]
    seconds: float

    def summary(self) -> str:
        exchanges = len(self.history.exchanges)
        return (
            f"{self.schedule} -> {exchanges} exchanges, {len(self.violations)} violation(s) "
            f"in {self.seconds:.1f} s"
        )


class Faults:
    """Sets and lifts the schedule's faults on the lab, recording each in the
    history. Cuts are kept as a set and the switch's rules rebuilt from it, so
    overlapping cuts lift one by one."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.lab, self.nodes, self.clocks = pair.lab, pair.nodes, pair.clocks
        self.cuts: list[tuple[str, str]] = []  # (node, mode) in force

    def apply_cuts(self) -> None:
        lab = self.lab
        lab.nft("flush chain bridge cuts forward\n")
        down = {node for node, mode in self.cuts if mode == "down"}
        for node in self.nodes:
            lab.link(f"{node}-b", node not in down)
        for node, mode in self.cuts:
            if mode == "loss":
                lab.drop([f"{node}-b"], [f"{m}-b" for m in MEMBERS])
            elif mode == "oneway":
                members = ", ".join(f'"{m}-b"' for m in MEMBERS)
                lab.nft(
                    f'add rule bridge cuts forward iifname "{node}-b" '
                    f"oifname {{ {members} }} drop\n"
                )
        if lab.proxy is not None:
            lab.proxy.delay = 2.0 if ("a", "delay") in self.cuts else 0.0

    async def step(
        self, step: Step, history: History, clients: Clients, rng: random.Random
    ) -> None:
        """Set one fault, hold it ``step.seconds``, lift it."""
        fault = Fault(step.kind, step.target, time.monotonic(), detail=step.detail)
        if step.kind == "kill":
            history.faults.append(fault)
            killed = await clients.kill(step.detail, step.target)
            fault.target, fault.detail = f"{killed} via {step.detail.upper()}", ""
            return
        if step.kind == "handover":
            history.faults.append(fault)
            trouble = await trio.to_thread.run_sync(self.pair.hand_over, step.target)
            fault.end = time.monotonic()
            fault.detail = trouble or "done"
            if trouble:
                history.problems.append(f"hand-over of {step.target.upper()}: {trouble}")
            return
        if step.kind == "crash":
            history.faults.append(fault)
            crashed = await clients.crash(step.target, rng)
            fault.target = crashed or "(no holder)"
            return
        if step.kind == "pause":
            await clients.holder_asks_info(step.target)
            # Within an ``info``'s own time (its etcd reads take a few ms): the
            # node stops before, during or after them.
            await trio.sleep(rng.uniform(0.0, 0.015))
        elif step.kind == "cut":
            await clients.token_holder_on(step.target)
        trouble = step.target if step.kind in ("cut", "pause") else None
        if trouble is not None:
            clients.troubled[trouble] += 1
        if step.kind == "pause":
            undo = self.set(step)  # at once: a thread's hand-off would miss the info
        else:
            undo = await trio.to_thread.run_sync(self.set, step)
        fault.start = time.monotonic()
        history.faults.append(fault)
        try:
            if step.kill_after:
                await trio.sleep(step.kill_after)
                other = next(node for node in self.nodes if node != step.target)
                await self.step(Step(0.0, "kill", "x0", detail=other), history, clients, rng)
            await trio.sleep(step.seconds - step.kill_after)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(undo)
                fault.end = time.monotonic()
                if trouble is not None:
                    clients.troubled[trouble] -= 1

    def set(self, step: Step) -> Callable[[], None]:
        """Set ``step``'s fault now; the function that lifts it."""
        if step.kind == "cut":
            cut = (step.target, step.detail)
            self.cuts.append(cut)
            self.apply_cuts()

            def lift_cut() -> None:
                self.cuts.remove(cut)
                self.apply_cuts()

            return lift_cut
        if step.kind == "pause":
            pid = self.nodes[step.target].process.pid
            os.kill(pid, signal.SIGSTOP)
            return lambda: os.kill(pid, signal.SIGCONT)
        if step.kind == "member":
            etcd = self.lab.etcd
            try:
                name = etcd.leader() if step.target == "leader" else etcd.follower()
            except RuntimeError:
                return lambda: None  # another member is paused and no leader is seen
            etcd.stop(name)
            return lambda: etcd.cont(name)
        if step.kind == "clock":
            path = self.clocks[step.target]
            path.write_text(f"{step.detail}\n")
            return lambda: path.write_text("+0\n")
        raise ValueError(f"unknown fault {step.kind!r}")

    def lift_all(self) -> None:
        self.cuts.clear()
        self.apply_cuts()
        for node in self.nodes.values():
            if node.process.poll() is None:
                os.kill(node.process.pid, signal.SIGCONT)
        for name, member in self.lab.etcd.members.items():
            if member.stopped:
                self.lab.etcd.cont(name)
        for path in self.clocks.values():
            path.write_text("+0\n")


def node_env(clock: Path) -> dict[str, str]:
    """A node's environment: its wall clock read from ``clock`` (an offset such as
    ``+0.5``) at every call, its monotonic clock untouched."""
    return {
        **os.environ,
        "LD_PRELOAD": libfaketime(),
        "FAKETIME_TIMESTAMP_FILE": str(clock),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


class Pair:
    """Nodes A and B, started on a fresh prefix and kept across schedules (each
    schedule's keys start with its own tag) until one of them has died: a start
    costs more than a short schedule. Both run under libfaketime with a clock file
    each; A reaches etcd through the lab's delay proxy. ``planted``: A runs with
    its deadline check off (tests/support/nemesis_planted.py)."""

    def __init__(self, lab: Lab, base: Path, ttl: int, *, planted: bool = False) -> None:
        self.lab, self.base, self.ttl, self.planted = lab, base, ttl, planted
        self.admin = base / "admin-token"
        self.admin.write_text(ADMIN_TOKEN + "\n")
        self.clocks = {node: base / f"clock-{node}" for node in ("a", "b")}
        self.nodes: dict[str, LabNode] = {}

    def ready(self) -> dict[str, LabNode]:
        """The two nodes, started afresh if there are none or one has exited."""
        if self.nodes and all(n.process.poll() is None for n in self.nodes.values()):
            return self.nodes
        self.stop()
        for path in self.clocks.values():
            path.write_text("+0\n")
        flags = (
            "--etcd-prefix", f"/nemesis-{uuid.uuid4().hex[:10]}/",
            "--session-ttl", str(self.ttl), "--admin-token-file", str(self.admin),
        )  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(
                self.lab.start_node, "a", *flags, *self.control("a"), via_proxy=True,
                env=node_env(self.clocks["a"]), module=self.module,
            )  # fmt: skip
            b = pool.submit(
                self.lab.start_node, "b", *flags, *self.control("b"),
                env=node_env(self.clocks["b"]),
            )  # fmt: skip
            self.nodes = {"a": a.result(), "b": b.result()}
        return self.nodes

    @property
    def module(self) -> str:
        return "tests.support.nemesis_planted" if self.planted else "elockd"

    def control(self, role: str) -> tuple[str, str]:
        """The node's control socket (docs/upgrade.md): a hand-over goes through it."""
        return "--control-socket", str(self.base / f"control-{role}.sock")

    def hand_over(self, role: str) -> str:
        """``elockd --take-over`` (what ``elockctl upgrade`` starts) with the node's
        own flags, in its namespace: the successor takes the listener, the
        connections and the sessions, the old process exits. What went wrong, or ""."""
        node = self.nodes[role]
        previous = node.process
        # What start_server was given: the command line after its own flags.
        args = [str(arg) for arg in previous.args[7:]]  # type: ignore[index, union-attr]
        namespace = self.lab.namespace(role)
        try:
            successor, _ = start_server(
                "--take-over", self.control(role)[1], *args, log=node.log,
                preexec_fn=lambda: enter(namespace), env=node_env(self.clocks[role]),
                module=self.module if role == "a" else "elockd",
            )  # fmt: skip
        except RuntimeError as error:
            return f"the successor did not start: {error}"
        node.process = successor
        try:
            code = previous.wait(timeout=15)
        except subprocess.TimeoutExpired:
            stop_server(previous)
            return "the old process still ran 15 s after its successor listened"
        stop_server(previous)  # reaped already: closes its pipe
        return "" if code == 0 else f"the old process exited with {code}"

    def stop(self) -> None:
        self.lab.stop_nodes()
        self.nodes = {}


def run_schedule(pair: Pair, plan: Schedule) -> Outcome:
    """The clients and the schedule's faults on ``pair``'s nodes, then the check."""
    began = time.monotonic()
    history = History(plan.seed, plan.ttl)
    nodes = pair.ready()
    marks = {role: len(node.log) for role, node in nodes.items()}
    faults = Faults(pair)
    clients = Clients(history, nodes, ADMIN_TOKEN, tag=f"s{plan.seed}-")

    async def main() -> None:
        rng = random.Random(plan.seed)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(clients.run, random.Random(rng.random()))
            await trio.sleep(WARM_UP)
            async with trio.open_nursery() as script:
                start = trio.current_time()
                for step in plan.steps:
                    await trio.sleep_until(start + step.at)
                    script.start_soon(faults.step, step, history, clients, rng)
            await trio.to_thread.run_sync(faults.lift_all)
            await trio.sleep(plan.ttl)
            nursery.cancel_scope.cancel()
        await clients.probe()

    try:
        pair.lab.from_clients(lambda: trio.run(main))
    finally:
        faults.lift_all()
        pair.lab.heal()
    violations = check(history)
    if violations:
        for role, node in nodes.items():
            log = node.log[marks[role] :]
            print(f"--- node {role} logged (last 30 lines):\n" + "".join(log[-30:]), end="")
    return Outcome(plan, history, violations, time.monotonic() - began)


def run_many(
    seeds: range, *, ttl: int = 2, planted: bool = False, out: TextIO = sys.stdout
) -> list[Outcome]:
    """Every schedule of ``seeds`` in one lab; prints each outcome as it ends."""
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="elockd-nemesis-") as base, lab() as made:
        pair = Pair(made, Path(base), ttl, planted=planted)
        try:
            for seed in seeds:
                outcome = run_schedule(pair, schedule(seed, ttl))
                print(outcome.summary(), file=out, flush=True)
                if outcome.violations:
                    print(report(outcome.history, outcome.violations), file=out, flush=True)
                outcomes.append(outcome)
        finally:
            pair.stop()
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.nemesis_run", description=__doc__
    )
    parser.add_argument("--schedules", type=int, default=200)
    parser.add_argument("--seed", type=int, help="the first seed (default: from the clock)")
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--planted", action="store_true", help="node A's deadline check off")
    args = parser.parse_args(argv)
    if (why := why_no_lab()) is not None:
        print(f"cannot build the lab: {why}", file=sys.stderr)
        return 2
    first = args.seed if args.seed is not None else int(time.time()) % 1_000_000 * 1000
    seeds = range(first, first + args.schedules)
    print(f"nemesis: seeds {seeds.start}..{seeds.stop - 1}, ttl {args.ttl}", flush=True)
    began = time.monotonic()
    outcomes = run_many(seeds, ttl=args.ttl, planted=args.planted)
    bad = [o for o in outcomes if o.violations]
    total = sum(len(o.violations) for o in outcomes)
    print(
        f"nemesis: {len(outcomes)} schedules, seeds {seeds.start}..{seeds.stop - 1}, "
        f"{total} violation(s) in {len(bad)} schedule(s) "
        f"({', '.join(str(o.schedule.seed) for o in bad) or 'none'}), "
        f"{time.monotonic() - began:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
