"""The scenarios of the partition runs, and a command line to run them.

A run (:func:`run_scenario`) starts nodes A and B (``--session-ttl``, a fresh key
prefix) in the lab (tests/support/partition_lab.py), then its clients, its etcd watch and
its script of cuts (tests/support/partition_clients.py), and returns what they recorded.

``python -m tests.support.partition_runs SCENARIO [--mode loss|down|delay] [--runs N]`` runs
one kind and prints its figures; ``python -m tests.support.partition_runs pre-vote`` measures
an isolated etcd leader with and without ``--pre-vote`` (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import functools
import json
import random
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from tests.support.netns import run_in
from tests.support.partition_clients import CLIENTS_PER_NODE, Figures, Outcome, Run, figures
from tests.support.partition_lab import Lab, lab, why_no_lab

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
    #: The nodes take ``--admin-token-file`` with :data:`ADMIN_TOKEN` (``kill``).
    admin: bool = False


ADMIN_TOKEN = "partition-admin"


def node_cut(mode: str, ttl: int) -> Scenario:
    """(a) Node A cut from etcd (``loss``, ``down`` or ``delay``) for longer than it
    takes A to lose its lease and etcd to free its locks, while clients contend."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        await trio.sleep(pace(ttl))
        held = await run.a_holds()
        async with trio.open_nursery() as nursery:
            if held is not None:
                # B's client waits for the key A's holds, so that B's grant after the
                # cut is there to measure A's lead against, whatever keys the
                # contenders happen to pick.
                chase = functools.partial(
                    run.wait_then_hold, "b-chaser", "b", held.key, 0.5, through_cuts=False
                )
                nursery.start_soon(chase)
                await trio.sleep(0.15)  # the chaser's ``lock`` is in etcd's queue by now
            await run.cut(f"A cut from etcd ({mode})", lambda: lab.cut_node_from_etcd("a", mode))
            # Past etcd's expiry of A's lease (TTL) and past when A used to tell its
            # clients (up to TTL + 2.2 s at TTL 5).
            await trio.sleep(1.4 * ttl + 2.0)
            await run.cut("healed", lab.heal)
            await trio.sleep(pace(ttl))
            nursery.cancel_scope.cancel()

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
        holder_line = await run.connect("b")
        holder = await run.lock(holder_line, "b-holder", "b", "x0")
        assert holder is not None, "the first lock of x0 was not granted"
        async with trio.open_nursery() as nursery:
            for client, node in (("a-waiter", "a"), ("b-waiter", "b")):
                queued = trio.Event()
                nursery.start_soon(
                    functools.partial(run.wait_then_hold, client, node, "x0", 3.0, queued=queued)
                )
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


def kill_cut(mode: str, ttl: int) -> Scenario:
    """(g) A's client holds x0 and polls ``token x0``; B's client waits for x0; A is
    cut from etcd; 0.15 TTL later an operator kills x0 through B. B's waiter must be
    granted only once A can no longer confirm the hold: after A's last ``200`` to
    ``token x0``, though etcd never hears from A again."""

    async def script(lab: Lab, run: Run, rng: random.Random) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(run.wait_then_hold, "a-holder", "a", "x0", 0.5 * ttl)
            )
            if await run.a_holds() is None:
                run.outcome.problems.append("a-holder never got x0")
                nursery.cancel_scope.cancel()
                return
            queued = trio.Event()
            chase = functools.partial(
                run.wait_then_hold, "b-waiter", "b", "x0", 0.5, through_cuts=False, queued=queued
            )
            nursery.start_soon(chase)
            await queued.wait()
            await trio.sleep(0.3)  # its ``lock`` is in etcd's queue by now
            await run.cut(f"A cut from etcd ({mode})", lambda: lab.cut_node_from_etcd("a", mode))
            await trio.sleep(0.15 * ttl)
            await run.kill("b", "x0", ADMIN_TOKEN)
            # Past etcd's expiry of A's lease, and B's waiter granted after it.
            await trio.sleep(ttl + 2.0)
            await run.cut("healed", lab.heal)
            await trio.sleep(pace(ttl))
            nursery.cancel_scope.cancel()

    return Scenario(
        f"kill through B of a cut node's hold ({mode})",
        script,
        contenders=False,
        via_proxy=mode == "delay",
        admin=True,
    )


def run_scenario(lab: Lab, scenario: Scenario, *, ttl: int = 5, seed: int = 1) -> Outcome:
    """Fresh nodes A and B on a fresh prefix, the scenario, then its outcome."""
    prefix = f"/partition-{uuid.uuid4().hex[:10]}/"
    flags: tuple[str, ...] = ("--etcd-prefix", prefix, "--session-ttl", str(ttl))
    if scenario.admin:
        token_file = lab.base / "admin-token"
        token_file.write_text(ADMIN_TOKEN + "\n")
        flags += ("--admin-token-file", str(token_file))
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
    lines += [f"  close call: {c}" for c in found.close_calls]
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


def raft_term(url: str) -> int:
    """A member's raft term as raft itself has it (``raft.status`` in /debug/vars)."""
    with urllib.request.urlopen(f"{url}/debug/vars", timeout=2) as response:
        return int(json.loads(response.read())["raft.status"]["term"])


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
            return -1 if status is None else int(status["header"]["raft_term"])

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
            # Asked from inside its own namespace, which the cut does not reach; raft's
            # own term (status reports the term of the last leadership change only).
            isolated_term = run_in(made.namespace(leader), lambda: raft_term(own.url))
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


# ------------------------------------------------------------------------ CLI


def scenario_named(name: str, mode: str, ttl: int, seconds: float) -> Scenario:
    return {
        "node-cut": lambda: node_cut(mode, ttl),
        "clients-cut": lambda: clients_cut(ttl),
        "leader": lambda: leader_isolated(ttl),
        "flapping": lambda: flapping(seconds, ttl),
        "long-cut": lambda: long_cut(seconds, ttl),
        "stale-watch": lambda: stale_watch(mode, ttl),
        "kill-cut": lambda: kill_cut(mode, ttl),
    }[name]()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.partition_runs", description=__doc__
    )
    parser.add_argument(
        "scenario",
        choices=[
            "node-cut", "clients-cut", "leader", "flapping", "long-cut", "stale-watch", "kill-cut",
            "pre-vote",
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
