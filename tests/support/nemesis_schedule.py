"""The nemesis's schedules: from one seed, a short random mix of faults.

A schedule is a list of :class:`Step`: at ``at`` seconds into the fault phase,
set fault ``kind`` on ``target`` for ``seconds`` (then lift it). Steps may
overlap, so faults combine (a node paused while the other is cut, an etcd member
paused during a clock jump, a ``kill`` during a cut). The same seed always gives
the same schedule; the runner prints the seed of every schedule it runs, and
``make nemesis NEMESIS_SEED=S`` runs that one again (timing still varies: the
faults come at the same moments, the clients' requests race them anew).

Kinds:

``cut``
    a node cut from etcd: ``loss`` (frames dropped at the switch, both ways),
    ``down`` (its link to etcd down), ``delay`` (every byte between node A and
    etcd held 2 s), ``oneway`` (only the node's frames to etcd dropped; etcd's
    still arrive); the runner waits (up to 1 s) until one of the node's holders
    that ask only ``token`` holds a key. One cut in three has an operator's
    ``kill`` of that node's key inside it, through the other node, 0.1-0.8 s in
    (before the node's own deadline).
``pause``
    a node stopped (SIGSTOP) with its network intact, then continued; the runner
    waits (up to 1 s) for one of its holders to send ``info``, so that the node
    stops while it answers.
``member``
    an etcd member stopped (SIGSTOP), ``leader`` or a follower, then continued.
``clock``
    a node's wall clock jumps (libfaketime) by ``detail`` seconds, and back.
``kill``
    an operator ``kill`` of a key, through either node; while the other node is
    cut or paused, of a key one of its holders holds.
``crash``
    a client that holds a key vanishes (its connection closed without a word).
``handover``
    a node handed over to a successor (``elockd --take-over``, what ``elockctl
    upgrade`` starts; docs/upgrade.md): its clients must not notice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NODES = ("a", "b")
KEYS = ("x0", "x1", "x2")
CUT_MODES = ("loss", "down", "delay", "oneway")
#: The weights of the fault kinds (a kill or a crash is cheap; so is a cut).
KINDS = {"cut": 3, "pause": 2, "member": 1, "clock": 1, "kill": 2, "crash": 2, "handover": 1}


@dataclass(frozen=True)
class Step:
    at: float
    kind: str
    target: str
    seconds: float = 0.0
    detail: str = ""
    #: A cut only: this many seconds into it, an operator kills a key a holder of
    #: the cut node holds, through the other node (0: no kill).
    kill_after: float = 0.0

    def __str__(self) -> str:
        extra = f" {self.detail}" if self.detail else ""
        span = f" for {self.seconds:.1f} s" if self.seconds else ""
        kill = f", kill at +{self.kill_after:.1f} s" if self.kill_after else ""
        return f"+{self.at:.1f} s {self.kind} {self.target}{extra}{span}{kill}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    ttl: int
    #: How long the fault phase lasts (every step starts inside it).
    length: float
    steps: tuple[Step, ...]

    def __str__(self) -> str:
        return f"seed {self.seed} (ttl {self.ttl}): " + "; ".join(map(str, self.steps))

    @property
    def lasts(self) -> float:
        """When the last fault is lifted, seconds into the fault phase."""
        return max([self.length, *(s.at + s.seconds for s in self.steps)])


def schedule(seed: int, ttl: int = 2, length: float = 2.5, faults: int = 4) -> Schedule:
    """The schedule of ``seed``: ``faults`` steps (give or take one) in ``length`` s."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    weights = [KINDS[k] for k in kinds]
    steps: list[Step] = []
    for _ in range(max(1, faults + rng.choice((-1, 0, 1)))):
        kind = rng.choices(kinds, weights)[0]
        at = round(rng.uniform(0.0, length), 1)
        # Long enough to outlast the node's lease (TTL) in some runs, not in others.
        seconds = round(rng.uniform(0.5, 1.5 * ttl + 0.5), 1)
        node = rng.choice(NODES)
        if kind == "cut":
            mode = rng.choice(CUT_MODES)
            # One cut in three has a kill inside it, before the node's deadline.
            kill = round(rng.uniform(0.1, 0.8), 1) if rng.random() < 1 / 3 else 0.0
            target = "a" if mode == "delay" else node
            steps.append(Step(at, kind, target, max(seconds, kill + 0.5), mode, kill))
        elif kind == "pause":
            steps.append(Step(at, kind, node, seconds))
        elif kind == "member":
            steps.append(Step(at, kind, rng.choice(("leader", "follower")), min(seconds, 3.0)))
        elif kind == "clock":
            jump = rng.choice((-1, 1)) * round(rng.uniform(0.2, 1.0), 1)
            steps.append(Step(at, kind, node, seconds, f"{jump:+.1f}"))
        elif kind == "kill":
            steps.append(Step(at, kind, rng.choice(KEYS), detail=node))
        else:  # crash, handover
            steps.append(Step(at, kind, node))
    steps.sort(key=lambda s: s.at)
    return Schedule(seed, ttl, length, tuple(steps))
