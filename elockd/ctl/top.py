"""``elockctl top``: the lock table at a glance, refreshed in place.

Three panes, from two requests per frame on one connection: the oldest holds and
the longest queues (both from ``ls``), and requests per second (the change of the
``command_*`` counters of ``q`` between two frames, divided by the time between
them, less top's own ``ls`` and ``q``). The terminal is drawn by ``rich.live``;
``--once`` draws a single frame after one ``--interval`` (a rate needs two
samples) and exits, for scripts and tests.

``ls`` lists keys in key order, so a cut listing (``--scan``) is the first keys by
name, not the oldest: the view says so when it happens, and a PREFIX or
``--older`` makes the listing small again.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from elockd.client import BlockingClient, RequestError
from elockd.client.core import printable
from elockd.ctl.operate import console_for_stdout, listing, ls_line
from elockd.ctl.rows import Row, lock_table
from elockd.ctl.status import where

#: What top itself sends between two ``q`` samples; not counted as traffic.
OWN_REQUESTS = {"command_q": 1, "command_ls": 1}


@dataclass
class Sample:
    """The ``command_*`` counters of one ``q``, and when it was taken (monotonic)."""

    at: float
    commands: dict[str, int] = field(default_factory=dict)


def read_counters(client: BlockingClient) -> Sample:
    """``q``'s ``command_*`` counters now."""
    at = time.monotonic()
    commands: dict[str, int] = {}
    for line in client.command(b"q", check=True):
        name, sep, value = line.partition(b": ")
        if not sep or not value.isdigit():
            raise RequestError(f"q: not a counter line: {printable(line)}", line)
        if name.startswith(b"command_"):
            commands[name.decode()] = int(value)
    return Sample(at, commands)


def rates(before: Sample, after: Sample) -> dict[str, float]:
    """Requests per second of each verb between two samples, top's own left out,
    busiest first (a verb that did nothing is left out)."""
    elapsed = after.at - before.at
    if elapsed <= 0:
        return {}
    result: dict[str, float] = {}
    for name, count in after.commands.items():
        delta = count - before.commands.get(name, 0) - OWN_REQUESTS.get(name, 0)
        if delta > 0:
            result[name.removeprefix("command_")] = delta / elapsed
    return dict(sorted(result.items(), key=lambda item: (-item[1], item[0])))


def oldest(rows: list[Row], count: int) -> list[Row]:
    """The ``count`` holds granted longest ago."""
    held = [row for row in rows if row.age is not None]
    return sorted(held, key=lambda row: (-(row.age or 0.0), row.key))[:count]


def longest_queues(rows: list[Row], count: int) -> list[Row]:
    """The ``count`` keys with the most waiters."""
    queued = [row for row in rows if row.waiting]
    return sorted(queued, key=lambda row: (-row.waiting, row.key))[:count]


def rate_table(per_verb: dict[str, float] | None, count: int) -> Table:
    table = Table(
        title="Requests per second", title_justify="left", box=box.SIMPLE_HEAD, min_width=30
    )
    table.add_column("VERB")
    table.add_column("REQ/S", justify="right")
    if per_verb is None:
        table.add_row("…", "measuring")
        return table
    table.add_row("all", f"{sum(per_verb.values()):.1f}")
    for verb, value in list(per_verb.items())[:count]:
        table.add_row(verb, f"{value:.1f}")
    return table


def frame(
    server: str,
    rows: list[Row],
    cut: bool,
    per_verb: dict[str, float] | None,
    count: int,
    now: datetime | None = None,
) -> RenderableType:
    """One screen: a headline, the oldest holds, the longest queues, the rates."""
    now = now or datetime.now(UTC)
    held = sum(1 for row in rows if row.age is not None)
    waiting = sum(row.waiting for row in rows)
    total = "…" if per_verb is None else f"{sum(per_verb.values()):.1f}"
    headline = Text(
        f"elockd {server}   {held} keys held, {waiting} waiting   {total} req/s   "
        f"{now.strftime('%H:%M:%S')} UTC",
        style="bold",
    )
    parts: list[RenderableType] = [headline]
    if cut:
        parts.append(
            Text(
                f"the listing was cut at --scan {len(rows)} keys (in key order, not by age): "
                "give a PREFIX or --older",
                style="yellow",
            )
        )
    parts.append(lock_table(oldest(rows, count), title="Oldest holds"))
    parts.append(lock_table(longest_queues(rows, count), title="Longest queues"))
    parts.append(rate_table(per_verb, count))
    return Group(*parts)


class Top:
    """The state between frames: one connection, the last counter sample."""

    def __init__(self, args: argparse.Namespace, client: BlockingClient, server: str) -> None:
        self.args = args
        self.client = client
        self.server = server
        self.request = ls_line(args.prefix, args.older, args.scan)
        self.last = read_counters(client)

    def next_frame(self, measured: bool = True) -> RenderableType:
        rows, cut = listing(self.client, self.request)
        if not measured:  # the first frame: rates are counted from here on
            self.last = read_counters(self.client)
            return frame(self.server, rows, cut, None, self.args.rows)
        sample = read_counters(self.client)
        per_verb = rates(self.last, sample)
        self.last = sample
        return frame(self.server, rows, cut, per_verb, self.args.rows)


def run_top(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Until Ctrl-C (exit 0), or one frame with ``--once``."""
    console = console_for_stdout()
    with BlockingClient(**options) as client:
        top = Top(args, client, where(options))
        if args.once:
            time.sleep(args.interval)
            console.print(top.next_frame())
            return 0
        try:
            with Live(top.next_frame(measured=False), console=console, screen=False) as live:
                while True:
                    time.sleep(args.interval)
                    live.update(top.next_frame())
        except KeyboardInterrupt:
            return 0
