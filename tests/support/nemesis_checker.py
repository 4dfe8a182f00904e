"""The nemesis's one checker: reads a whole :class:`History` and lists violations.

Holds are rebuilt from the replies, per session (one connection): a grant
(``lock``/``g``/``mlock`` answered ``200 Acquired``/``1 Got Lock``) starts one, an
``unlock``/``r``, a 403 to ``token``/``renew``, a closed connection or a crash
ends it. What the checker knows of a hold ``h`` of key K:

* it surely exists *throughout* ``sure(h) = [grant received, last confirmation
  sent]``: it existed at some instant of the grant's exchange and of every
  confirmation's (``token``/``renew``/``info`` of its own session, a repeated
  ``lock``), and a hold is one unbroken interval (the token says it is the same);
* a *report* (``info``/``d``/``ls`` of any session naming OWNER and the token)
  says it existed at some instant of that exchange.

The rules (each violation names the rule, the seed and the key's timeline):

``overlap``
    Two holds of one key by different sessions surely existed at once: their
    sure intervals overlap, or a report of one lies wholly inside the other's
    (for ``d`` and ``ls``, which read the node's copy of etcd, from
    :data:`MIRROR_LAG` after its grant on).
``late``
    A reply that tells a holder it still holds K (its own session's ``token``,
    ``renew``, ``info``) was received more than :data:`RECEIPT_SLACK` after another
    session's later grant of K, while that hold surely existed. The node must check
    its deadline after the last await of a request (docs/cluster.md), and its
    deadline is before any moment another node can grant; the slack covers the
    reply's trip and the clients' own loop.
``token``
    Fencing tokens strictly increase per key in grant order, and one hold keeps
    one token.
``throttle``
    Admissions of a key (``200`` to ``throttle``), in any window from one
    request's send to another's reply, stay within ``B + W·rate + 1`` plus the
    documented skew (docs/cluster.md, "The clock"): ``min(J·rate, B)`` per
    wall-clock jump of size J a node made in the run.
``shared``
    ``lock_shared K W limit=N`` never reports more than N holders, and no more
    than N shared holds surely exist at once.
``watch``
    Each ``watch`` stream, per key: never two exclusive holders at once, a
    ``-`` only for the holder it showed, tokens increasing, and every ``+`` a hold
    its owner asked for (a grant can meet a wait's end and be freed at once).
``handover``
    A hand-over of a node (``--take-over``) did not happen: its successor did not
    start, or the old process did not exit 0.
``freed``
    After a session crashed while holding K, K is granted again (to anyone:
    the runner sends a waiter) within :func:`free_bound`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tests.support.nemesis_history import Exchange, History

#: How much later than the node sent it a client may record a reply: the trip on
#: the clients' own network plus the clients' trio loop on a busy machine.
RECEIPT_SLACK = 0.5

#: How far behind etcd a node's own copy (which ``d`` and ``ls`` read; ``info``
#: reads etcd) may be while the node is within its deadline: its watch's delivery
#: on a busy machine.
MIRROR_LAG = 0.25

GRANTED = ("200 Acquired", "1 Got Lock")
FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass
class Hold:
    """One exclusive hold of ``key`` by ``session``, as rebuilt from the history."""

    key: str
    session: str
    node: str
    grant: Exchange
    token: int | None = None
    #: Its own session's exchanges that said it still held K (replies received).
    confirmations: list[Exchange] = field(default_factory=list)
    #: Other sessions' reports naming it.
    reports: list[Exchange] = field(default_factory=list)
    #: When its client stopped holding it as far as the client knows: unlock
    #: sent, told lost, crashed (None: held to the end).
    ended: float | None = None
    #: Why it ended: "unlock", "told", "crash", "closed", "killed".
    how: str = ""

    @property
    def start(self) -> float:
        assert self.grant.received is not None
        return self.grant.received

    @property
    def sure_end(self) -> float:
        """The last instant the hold surely existed (its last confirmation's send)."""
        return max([self.start, *(c.sent for c in self.confirmations)])

    def __str__(self) -> str:
        return f"{self.session}@{self.node.upper()} token {self.token}"


@dataclass
class Violation:
    rule: str
    key: str
    text: str
    #: When it happened, as near as the rule can say (the timeline is centred
    #: there); 0: not known.
    at: float = 0.0

    def __str__(self) -> str:
        return f"[{self.rule}] {self.key}: {self.text}"


def free_bound(history: History) -> float:
    """Seconds within which a crashed holder's key is granted again: the longest
    hold lease, then two session TTLs (its node's lease may have just been renewed
    when the node was cut or paused, and etcd checks expiry every 0.5 s, an etcd
    election adds its timeout) and 3 s of watch lag and retries."""
    return history.lease_ttl + 2 * history.ttl + 3.0


# ------------------------------------------------------------------ holds


class Holds:
    """Every exclusive hold of the history, rebuilt session by session."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.by_key: dict[str, list[Hold]] = defaultdict(list)
        self.problems: list[Violation] = []
        #: (session, key) of every request for a key (a grant may come as the
        #: request gives up, and be freed again at once).
        self.asked: set[tuple[str, str]] = set()
        current: dict[tuple[str, str], Hold] = {}
        exchanges = sorted(history.exchanges, key=lambda e: e.sent)
        #: When an operator's ``kill`` of each key was sent (answered ``200 Killed``).
        self.kills: dict[str, list[float]] = defaultdict(list)
        for exchange in exchanges:
            if exchange.verb == "kill" and (exchange.reply or "").startswith("200 Killed"):
                self.kills[exchange.words[1]].append(exchange.sent)
        for exchange in exchanges:
            self._session_step(exchange, current)
        for (session, _), hold in current.items():
            crashed = history.crashes.get(session)
            if crashed is not None and hold.ended is None:
                hold.ended, hold.how = crashed, "crash"
        for exchange in exchanges:
            self._reports(exchange)

    def _hold(self, session: str, key: str, current: dict[tuple[str, str], Hold]) -> Hold | None:
        return current.get((session, key))

    def _session_step(self, exchange: Exchange, current: dict[tuple[str, str], Hold]) -> None:
        words, reply, session = exchange.words, exchange.reply, exchange.session
        verb = exchange.verb
        if verb in ("lock", "g", "mlock"):
            keys = [w for w in words[1:] if "=" not in w] if verb == "mlock" else words[1:2]
            for key in keys:
                self.asked.add((session, key))
                if reply not in GRANTED:
                    continue
                held = self._hold(session, key, current)
                if held is not None and any(
                    held.grant.sent < kill < exchange.sent for kill in self.kills[key]
                ):
                    # Killed meanwhile, maybe: the session no longer holds the key,
                    # and this ``200`` may be a new grant (a new token). A new hold.
                    held.ended, held.how = exchange.sent, "killed"
                    del current[(session, key)]
                    held = None
                if held is not None:
                    held.confirmations.append(exchange)
                else:
                    hold = Hold(key, session, exchange.node, exchange)
                    current[(session, key)] = hold
                    self.by_key[key].append(hold)
        elif verb in ("unlock", "r") and len(words) > 1:
            hold = current.pop((session, words[1]), None)
            if hold is not None:
                hold.ended, hold.how = exchange.sent, "unlock"
        elif verb in ("token", "renew") and len(words) > 1:
            key = words[1]
            hold = self._hold(session, key, current)
            if reply is None or not reply.startswith("200"):
                if hold is not None and exchange.received is not None:
                    hold.ended, hold.how = exchange.sent, "told"
                    del current[(session, key)]
                return
            if hold is None and verb == "renew":
                return  # a shared hold's (see shared_limits)
            if hold is None:
                self.problems.append(
                    Violation("overlap", key, f"{session} was confirmed a hold it was never "
                              f"granted: {show(exchange)}")
                )  # fmt: skip
                return
            hold.confirmations.append(exchange)
            if verb == "token":
                self._token(hold, int(reply.split()[1]), exchange)
        elif verb == "info" and reply is not None and reply.startswith("200 "):
            fields = dict(FIELD.findall(reply))
            key = fields.get("key", words[1])
            hold = self._hold(session, key, current)
            if hold is not None and fields.get("exclusive") == session:
                hold.confirmations.append(exchange)
                if fields.get("token", "-") != "-":
                    self._token(hold, int(fields["token"]), exchange)
        if reply is None and exchange.received is None:
            # The connection ended under this request (or the client crashed):
            # whatever the session held, it is no longer told anything about it.
            crashed = self.history.crashes.get(session)
            for (owner, key), hold in list(current.items()):
                if owner == session and hold.ended is None:
                    if crashed is not None:
                        hold.ended, hold.how = crashed, "crash"
                    else:
                        hold.ended, hold.how = exchange.sent, "closed"
                    del current[(owner, key)]

    def _token(self, hold: Hold, token: int, exchange: Exchange) -> None:
        if hold.token is None:
            hold.token = token
        elif hold.token != token:
            self.problems.append(
                Violation("token", hold.key, f"{hold} became token {token}: {show(exchange)}")
            )

    def _reports(self, exchange: Exchange) -> None:
        """``info``/``d``/``ls`` of any session: which hold each line names."""
        if exchange.reply is None or exchange.received is None:
            return
        named: list[tuple[str, str, str]] = []  # key, owner, token or "-"
        if exchange.verb == "info" and exchange.reply.startswith("200 "):
            fields = dict(FIELD.findall(exchange.reply))
            named.append(
                (fields.get("key", ""), fields.get("exclusive", "-"), fields.get("token", "-"))
            )
        elif exchange.verb == "d":
            for line in exchange.more:
                key, _, owner = line.partition(": ")
                named.append((key, owner, "-"))
        elif exchange.verb == "ls":
            for line in exchange.more:
                key, _, rest = line.partition(" ")
                fields = dict(FIELD.findall(rest))
                named.append((key, fields.get("exclusive", "-"), fields.get("token", "-")))
        for key, owner, token in named:
            if owner == "-" or not key:
                continue
            hold = self._named(key, owner, token, exchange)
            if hold is not None and hold.session != exchange.session:
                hold.reports.append(exchange)

    def _named(self, key: str, owner: str, token: str, exchange: Exchange) -> Hold | None:
        """The hold a report names: by its token, else the owner's last hold of the
        key whose grant was sent before the report's reply came (of those whose
        token is not known, when the report gives one: never a hold whose token
        differs)."""
        candidates = [h for h in self.by_key.get(key, []) if h.session == owner]
        if token != "-":
            for hold in candidates:
                if hold.token == int(token):
                    return hold
            candidates = [h for h in candidates if h.token is None]
        assert exchange.received is not None
        before = [h for h in candidates if h.grant.sent <= exchange.received]
        return before[-1] if before else None


# ------------------------------------------------------------------ rules


def check(history: History) -> list[Violation]:
    """Every violation of the history, per the rules in this module's docstring."""
    holds = Holds(history)
    found = list(holds.problems)
    found += [Violation("handover", "-", problem) for problem in history.problems]
    for key, key_holds in holds.by_key.items():
        found += overlaps(key, key_holds)
        found += tokens(key, key_holds)
    found += throttles(history)
    found += shared_limits(history)
    found += watches(history, holds)
    found += freed(history, holds)
    return found


def overlaps(key: str, holds: list[Hold]) -> Iterable[Violation]:
    ordered = sorted(holds, key=lambda h: h.start)
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            if second.session == first.session:
                continue
            if min(first.sure_end, second.sure_end) > second.start:
                yield Violation(
                    "overlap", key,
                    f"{first} and {second} both surely held from {second.start:.3f} to "
                    f"{min(first.sure_end, second.sure_end):.3f}",
                    second.start,
                )  # fmt: skip
                continue
            for one, other in ((first, second), (second, first)):
                for report in one.reports:
                    assert report.received is not None
                    lag = MIRROR_LAG if report.verb in ("d", "ls") else 0.0
                    if other.start + lag < report.sent and report.received < other.sure_end:
                        yield Violation(
                            "overlap", key,
                            f"{report.session} was told {one} held it while {other} surely "
                            f"did: {show(report)}",
                            report.sent,
                        )  # fmt: skip
            for confirmation in first.confirmations:
                assert confirmation.received is not None
                if second.start + RECEIPT_SLACK < confirmation.received <= second.sure_end:
                    late = confirmation.received - second.start
                    yield Violation(
                        "late", key,
                        f"{first} was confirmed {late:.3f} s after {second}'s grant: "
                        f"{show(confirmation)}",
                        second.start,
                    )  # fmt: skip


def tokens(key: str, holds: list[Hold]) -> Iterable[Violation]:
    known = sorted((h for h in holds if h.token is not None), key=lambda h: h.start)
    for i, first in enumerate(known):
        for second in known[i + 1 :]:
            assert first.token is not None and second.token is not None
            if first.token == second.token:
                if first.session != second.session:
                    yield Violation("token", key, f"{first} and {second} share a token")
                # else one hold, taken for two (a kill that evicted someone else)
            elif first.start < second.grant.sent and first.token >= second.token:
                yield Violation(
                    "token", key, f"{second} granted after {first} has a token not above it"
                )


def shared_limits(history: History) -> Iterable[Violation]:
    """``lock_shared K W limit=N``: its ``200 M`` says M ≤ N, and no more than N
    shared holds of K surely exist at once (each from its grant's reply to the
    last ``renew`` its session sent that was answered 200)."""
    spans: dict[str, list[tuple[float, float, int, str]]] = defaultdict(list)
    current: dict[tuple[str, str], list[float]] = {}  # start, last, limit
    for exchange in sorted(history.exchanges, key=lambda e: e.sent):
        words, reply = exchange.words, exchange.reply or ""
        if exchange.verb == "lock_shared" and reply.startswith("200 "):
            limit = int(dict(FIELD.findall(exchange.request)).get("limit", "0")) or 10**9
            if int(reply.split()[1]) > limit:
                text = f"{reply!r} above its limit: {show(exchange)}"
                yield Violation("shared", words[1], text)
            assert exchange.received is not None
            current.setdefault((exchange.session, words[1]), [exchange.received] * 2 + [limit])
            continue
        span = current.get((exchange.session, words[1] if len(words) > 1 else ""))
        if exchange.verb == "renew" and span is not None and reply.startswith("200 "):
            span[1] = exchange.sent
        elif span is not None and (exchange.verb in ("renew", "unlock_shared") or not reply):
            del current[(exchange.session, words[1])]
            spans[words[1]].append((span[0], span[1], int(span[2]), exchange.session))
    for (session, key), span in current.items():
        spans[key].append((span[0], span[1], int(span[2]), session))
    for key, key_spans in spans.items():
        edges = sorted(
            [(start, 1, limit) for start, last, limit, _ in key_spans if last > start]
            + [(last, -1, limit) for start, last, limit, _ in key_spans if last > start]
        )
        held, smallest = 0, min(limit for _, _, limit, _ in key_spans)
        for at, step, _ in edges:
            held += step
            if held > smallest:
                yield Violation(
                    "shared", key, f"{held} shared holders surely at {at:.3f}, limit {smallest}"
                )
                break


def throttles(history: History) -> Iterable[Violation]:
    admitted: dict[str, list[Exchange]] = defaultdict(list)
    for exchange in history.exchanges:
        reply = exchange.reply or ""
        if (
            exchange.verb == "throttle"
            and reply.startswith("200 ")
            and "cost=0" not in exchange.words
        ):
            admitted[exchange.words[1]].append(exchange)
    jumps = [f for f in history.faults if f.kind == "clock"]
    for key, replies in admitted.items():
        rate = history.throttles[key]
        per_second = rate.count / rate.period
        # Each jump and its return moves one node's clock by its size.
        extra = sum(
            min(abs(float(f.detail)) * per_second, rate.burst) * (1 if f.end is None else 2)
            for f in jumps
        )
        by_send = sorted(replies, key=lambda e: e.sent)
        worst: tuple[float, int, float, float] | None = None
        for i, first in enumerate(by_send):
            inside = sorted(e.received for e in by_send[i:] if e.received is not None)
            for count, last in enumerate(inside, 1):
                bound = rate.burst + (last - first.sent) * per_second + 1 + extra
                if count > bound and (worst is None or count - bound > worst[0]):
                    worst = (count - bound, count, first.sent, last)
        if worst is not None:
            over, count, start, end = worst
            yield Violation(
                "throttle", key,
                f"{count} admitted from {start:.3f} to {end:.3f}, {over:.1f} above "
                f"B + W·rate + 1 + skew ({extra:.1f} for the clock jumps)",
            )  # fmt: skip


def watches(history: History, holds: Holds) -> Iterable[Violation]:
    streams: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for line in history.watch_lines:
        streams[line.session].append((line.received, line.line))
    for session, lines in streams.items():
        holder: dict[str, tuple[str, int]] = {}
        last_token: dict[str, int] = {}
        for at, line in sorted(lines):
            words = line.split()
            if len(words) < 4 or words[0] not in "+-" or words[2] != "exclusive":
                continue
            sign, key, owner = words[0], words[1], words[3]
            if sign == "+":
                token = int(dict(FIELD.findall(line)).get("token", "0"))
                if key in holder:
                    yield Violation(
                        "watch", key,
                        f"watch {session} at {at:.3f}: + {owner} token {token} while it showed "
                        f"{holder[key][0]} holding",
                    )  # fmt: skip
                if token <= last_token.get(key, 0):
                    yield Violation(
                        "watch", key, f"watch {session} at {at:.3f}: token {token} not above "
                        f"{last_token[key]}",
                    )  # fmt: skip
                last_token[key] = max(token, last_token.get(key, 0))
                holder[key] = (owner, token)
                seen = [
                    h for h in holds.by_key.get(key, [])
                    if h.session == owner and h.token in (None, token)
                ]  # fmt: skip
                if not seen and (owner, key) not in holds.asked:
                    yield Violation(
                        "watch", key,
                        f"watch {session} at {at:.3f}: + {owner} token {token}, a grant no "
                        f"client saw",
                    )  # fmt: skip
            else:
                shown = holder.pop(key, None)
                if shown is not None and shown[0] != owner:
                    yield Violation(
                        "watch", key,
                        f"watch {session} at {at:.3f}: - {owner} while it showed {shown[0]}",
                    )  # fmt: skip


def freed(history: History, holds: Holds) -> Iterable[Violation]:
    bound = free_bound(history)
    run_end = max((e.received or e.sent for e in history.exchanges), default=0.0)
    for key, key_holds in holds.by_key.items():
        for hold in key_holds:
            crashed = history.crashes.get(hold.session)
            if crashed is None or hold.how != "crash":
                continue
            deadline = crashed + bound
            later = [h.start for h in key_holds if h.session != hold.session and h.start > crashed]
            if later and min(later) <= deadline:
                continue
            # Not granted in time: a fault only if someone asked for it before the
            # deadline and was still waiting after it (the run may have ended first).
            waited = [
                e for e in history.exchanges
                if e.session != hold.session and e.verb in ("lock", "g", "mlock")
                and key in e.words[1:] and crashed <= e.sent <= deadline
                and (e.received or run_end) > deadline
            ]  # fmt: skip
            if waited:
                when = f"at {min(later):.3f}" if later else "never"
                yield Violation(
                    "freed", key,
                    f"{hold}'s client crashed at {crashed:.3f}; granted again {when}, "
                    f"bound {bound:.1f} s: {show(waited[0])}",
                    crashed,
                )  # fmt: skip
    # The runner's probes after the run (sessions named NODE + "p" + number).
    probes = [e for e in history.exchanges if e.session[1:2] == "p" and e.verb == "lock"]
    for probe in probes:
        if probe.reply not in GRANTED:
            text = f"not free {probe.words[2]} s after the run: {show(probe)}"
            yield Violation("freed", probe.words[1], text)


# ------------------------------------------------------------------ report


def show(exchange: Exchange) -> str:
    got = (
        "(no reply)"
        if exchange.received is None
        else f"{exchange.reply!r} at {exchange.received:.3f}"
    )
    who = f"{exchange.session}@{exchange.node.upper()}"
    return f"{who} {exchange.request!r} sent {exchange.sent:.3f} -> {got}"


def timeline(history: History, key: str, around: float = 0.0, limit: int = 80) -> str:
    """Every exchange, watch line and fault that concerns ``key``, in time order:
    the ``limit`` rows nearest ``around`` (from its start when 0)."""
    rows: list[tuple[float, str]] = []
    for exchange in history.exchanges:
        if key in exchange.words[1:] or any(line.startswith(key) for line in exchange.more):
            rows.append((exchange.sent, show(exchange)))
    for line in history.watch_lines:
        if f" {key} " in line.line:
            rows.append((line.received, f"watch {line.session}@{line.node.upper()}: {line.line}"))
    for fault in history.faults:
        rows.append((fault.start, f"FAULT {fault}"))
        if fault.end is not None:
            rows.append((fault.end, f"HEALED {fault.kind} {fault.target}"))
    for session, at in history.crashes.items():
        rows.append((at, f"CRASH {session}"))
    rows.sort()
    if len(rows) > limit:
        # Mostly before the moment: what led to it.
        centre = next((i for i, (at, _) in enumerate(rows) if at >= around), len(rows))
        first = max(0, min(centre - 3 * limit // 4, len(rows) - limit))
        rows = rows[first : first + limit]
    return "\n".join(f"  {at:12.3f} {text}" for at, text in rows)


def report(history: History, violations: list[Violation]) -> str:
    """The seed, every violation, and the timeline of each key concerned."""
    lines = [f"seed {history.seed}: {len(violations)} violation(s)"]
    lines += [f"  {v}" for v in violations]
    for key in sorted({v.key for v in violations}):
        around = min(v.at for v in violations if v.key == key)
        lines.append(f"timeline of {key} (seed {history.seed}), around {around:.3f}:")
        lines.append(timeline(history, key, around))
    return "\n".join(lines)
