"""The live lock table as elockctl shows it: ``ls`` lines read into rows, ages in
words a person reads at a glance (``3h12m``), and the rows as a table or JSON.

Pure functions only (no I/O), so ``ls``, ``top`` and the tests share one reading
of the wire format (docs/protocol.md, ``ls``):
``K exclusive=OWNER|- shared=N waiting=N age=S token=T|- ttl=S|-``.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from elockd.client import ProtocolError
from elockd.client.core import printable, quoted

if TYPE_CHECKING:
    from rich.table import Table

#: One ``ls`` row. The owner is matched greedily: a name set with ``iam`` is the
#: only field that could hold a blank, and every field after it has a fixed shape.
ROW = re.compile(
    rb"(?P<key>\S+) exclusive=(?P<owner>.*) shared=(?P<shared>\d+) waiting=(?P<waiting>\d+)"
    rb" age=(?P<age>\S+) token=(?P<token>\S+) ttl=(?P<ttl>\S+)\Z"
)

#: Units of a duration, largest first: ``2d3h``, ``3h12m``, ``12m5s``, ``45s``.
UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
#: A duration on the command line: ``90``, ``45s``, ``10m``, ``1h30m``, ``2d``.
DURATION = re.compile(
    r"(?:(?P<d>\d+(?:\.\d+)?)d)?(?:(?P<h>\d+(?:\.\d+)?)h)?"
    r"(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s?)?\Z"
)


@dataclass(frozen=True)
class Row:
    """One key of the lock table (``None`` where the wire says ``-``)."""

    key: str
    owner: str | None  # the exclusive holder (name or IP:PORT)
    shared: int  # shared holders
    waiting: int  # requests waiting for the key
    age: float | None  # seconds since the oldest hold was granted; None: waiters only
    token: int | None  # the exclusive hold's fencing token
    ttl: float | None  # seconds left of the hold's lease

    @property
    def kind(self) -> str:
        """``exclusive``, ``shared`` or ``waiting`` (a key nobody holds yet)."""
        if self.owner is not None:
            return "exclusive"
        return "shared" if self.shared else "waiting"

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


def parse_row(line: bytes) -> Row:
    """One ``ls`` line; :class:`ProtocolError` when it is not one (a peer that
    answers ``ls`` with anything else is no elockd this elockctl knows)."""
    match = ROW.match(line)
    if match is None:
        raise ProtocolError(f"not an 'ls' line: {quoted(line)}", line)
    owner, age, token, ttl = match["owner"], match["age"], match["token"], match["ttl"]
    try:
        return Row(
            key=printable(match["key"]),
            owner=None if owner == b"-" else printable(owner),
            shared=int(match["shared"]),
            waiting=int(match["waiting"]),
            age=None if age == b"-" else float(age),
            token=None if token == b"-" else int(token),
            ttl=None if ttl == b"-" else float(ttl),
        )
    except ValueError as error:
        raise ProtocolError(f"not an 'ls' line: {quoted(line)}", line) from error


def is_more(line: bytes) -> bool:
    """The last line of a listing that ``limit=`` cut short (``… more``)."""
    return line.endswith(b" more") and ROW.match(line) is None


def parse_listing(lines: list[bytes]) -> tuple[list[Row], bool]:
    """An ``ls`` reply without its ``END``: the rows, and whether the listing was cut."""
    more = bool(lines) and is_more(lines[-1])
    return [parse_row(line) for line in (lines[:-1] if more else lines)], more


def duration(seconds: float | None) -> str:
    """Seconds as a person reads them: the two largest units, whole (``3h12m``,
    ``2d3h``, ``12m5s``, ``45s``; under a second ``0s``); ``-`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    left = max(0, int(seconds))
    parts: list[str] = []
    for unit, size in UNITS:
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
        elif parts:
            parts.append("")  # a zero unit between two others still counts as one of two
        if len(parts) == 2:
            break
    return "".join(parts)


def duration_flag(text: str) -> float:
    """``--older``'s value: seconds, or with units (``90``, ``45s``, ``10m``,
    ``1h30m``, ``2d``)."""
    match = DURATION.match(text.strip())
    if match is None or not text.strip() or not any(match.groupdict().values()):
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a duration: seconds, or with units d, h, m, s (90, 10m, 1h30m, 2d)"
        )
    return sum(float(match[unit] or 0) * size for unit, size in UNITS)


def seconds_text(seconds: float) -> str:
    """Seconds as the server parses them: plain decimals, no exponent."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


def holders_text(row: Row) -> str:
    """What OWNER shows: the exclusive holder, ``N holders`` of a shared key."""
    if row.owner is not None:
        return row.owner
    return f"{row.shared} holder{'s' if row.shared != 1 else ''}" if row.shared else "-"


def lock_table(
    rows: list[Row], title: str | None = None, caption: str | None = None, *, plain: bool = False
) -> Table:
    """The rows as a table, in the order given: key, kind, owner, age, token, ttl,
    waiting (the columns of the status page). ``plain``: bare aligned columns, as
    ``ps`` prints them, for ``ls`` (easy on ``grep`` and ``awk``); else ruled, for
    ``top``'s panes."""
    from rich import box  # here: ``--older``'s parser lives here too, and rich is
    from rich.table import Table  # a fifth of elockctl's start-up

    table = Table(
        title=title,
        caption=caption,
        box=None if plain else box.SIMPLE_HEAD,
        pad_edge=not plain,
        title_justify="left",
        caption_justify="left",
        header_style="bold",
    )
    table.add_column("KEY", overflow="fold")
    table.add_column("KIND")
    table.add_column("OWNER", overflow="fold")
    for name in ("AGE", "TOKEN", "TTL", "WAITING"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(
            row.key,
            row.kind,
            holders_text(row),
            duration(row.age),
            "-" if row.token is None else str(row.token),
            duration(row.ttl),
            str(row.waiting),
        )
    return table
