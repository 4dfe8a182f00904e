"""Counters and their renderings for ``q`` and ``stats``.

The server keeps only what the engine cannot tell: per-verb request counts,
invalid commands and live connections, as plain ints on the hot path. Everything
else (keys, holders, orphans, leases, waiters) is read from the engine when asked,
so no number is kept twice and a snapshot is always consistent.
"""

from __future__ import annotations

from elockd.locks import LockEngine

#: Verbs whose ``command_<verb>`` line `q` always prints, even at 0.
ALWAYS_SHOWN_VERBS = (b"d", b"dump", b"g", b"i", b"q", b"r", b"sd", b"sg", b"si", b"sr")


class Counters:
    """What the connection layer counts."""

    __slots__ = ("commands", "connections", "invalid_commands")

    def __init__(self, verbs: list[bytes]) -> None:
        self.commands: dict[bytes, int] = dict.fromkeys(verbs, 0)
        self.invalid_commands = 0
        self.connections = 0


def snapshot(engine: LockEngine, counters: Counters) -> dict[str, int]:
    """Every `q` counter, sorted by name."""
    values = {
        "connections": counters.connections,
        "expired": engine.expired,
        "invalid_commands": counters.invalid_commands,
        "leases": engine.leases,
        "locks": len(engine.exclusive),
        "orphans": engine.orphans,
        "sessions": len(engine.sessions),
        "shared_locks": len(engine.shared),
        "shared_orphans": engine.shared_orphans,
        "timeouts": engine.timeouts,
        "waiting": engine.waiting,
    }
    for verb, count in counters.commands.items():
        if count or verb in ALWAYS_SHOWN_VERBS:
            values["command_" + verb.decode("ascii")] = count
    return dict(sorted(values.items()))


def render_q(values: dict[str, int]) -> bytes:
    """elockd's `q`: ``name: value`` lines, then END."""
    lines = [f"{name}: {value}\r\n" for name, value in values.items()]
    lines.append("END\r\n")
    return "".join(lines).encode("ascii")


def render_stats(values: dict[str, int], clients: int) -> bytes:
    """elock's `stats`: its own three first, then every other counter once, sorted."""
    first = {"clients": clients, "locks": values["locks"], "monitoring": values["sessions"]}
    lines = ["200 STATS\r\n"]
    lines += [f"STAT {name} {value}\r\n" for name, value in first.items()]
    lines += [f"STAT {name} {value}\r\n" for name, value in values.items() if name not in first]
    lines.append("END\r\n")
    return "".join(lines).encode("ascii")
