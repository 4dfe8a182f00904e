"""The command line of the operators' commands: ``ls``, ``watch``, ``kill``, ``top``.

Kept apart from :mod:`elockd.ctl.args` (which calls :func:`add_operator_parsers`)
so that each file stays one screenful of concerns; the option types that are
only theirs live here.
"""

from __future__ import annotations

import argparse
from typing import Any

from elockd.ctl.rows import duration_flag

LS_EPILOG = """\
AGE is the time since the oldest hold on the key was granted (3h12m, 45s, 2d3h;
'-' for a key that only has waiters); TTL what is left of a lease. --json prints
one JSON object per key (seconds as numbers, null for '-').

exit status: 0 listed (an empty listing too); 2 usage error; 3 could not tell
(no server, a token wanted or refused, a reply that is not elockd's).
"""

WATCH_EPILOG = """\
Each line is the time the event arrived (ISO-8601 UTC, milliseconds) and the
event as the server sent it: first one '+' line per current hold, then SYNCED,
then '+ KEY exclusive OWNER token=T', '+ KEY shared OWNER holders=N',
'- KEY exclusive OWNER released|expired|orphaned|killed' and
'- KEY shared OWNER holders=N REASON' as they happen.

exit status: 0 stopped with Ctrl-C; 1 the server ended the watch with OVERFLOW
(this reader fell more than the server's --watch-buffer behind); 3 could not
tell: no server, a token wanted or refused, '413 Too Many Watchers', the
connection lost, '409 Backend Unavailable' (a cluster node that can no longer
vouch for its lock table).
"""

KILL_EPILOG = """\
The connection authenticates with the token of --admin-token-file (the server's
own --admin-token-file; it passes wherever --auth-token-file's does). Every hold
on KEY, exclusive and shared, is freed whoever owns it; the next grant of KEY gets
a larger fencing token, so the evicted holder's writes can be refused.

exit status: 0 'killed N' (N holds freed; 0 when KEY was free); 1 refused
('403 Forbidden': not the server's admin token, or the server has no
--admin-token-file); 2 usage error; 3 could not tell (no server, a reply that is
not elockd's, the connection lost).
"""

TOP_EPILOG = """\
Refreshed every --interval seconds until Ctrl-C (exit 0). Rates are the change of
the server's command_* counters between two frames, top's own requests left out.

exit status: 0 stopped with Ctrl-C, or --once drew its frame; 2 usage error; 3
could not tell (no server, a token wanted or refused, the connection lost).
"""


def count(text: str) -> int:
    """A whole number, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number, 1 or more")
    return value


def interval(text: str) -> float:
    """Seconds between two frames: above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds above 0")
    return value


def add_listing_options(parser: argparse.ArgumentParser) -> None:
    """PREFIX and --older, as ``ls`` and ``top`` read them."""
    parser.add_argument(
        "prefix", nargs="?", metavar="PREFIX", help="only keys starting with PREFIX (default: all)"
    )
    parser.add_argument(
        "--older",
        type=duration_flag,
        metavar="AGE",
        help="only keys whose oldest hold is at least AGE old (90, 45s, 10m, 1h30m, 2d)",
    )


def add_operator_parsers(commands: Any) -> None:
    """``ls``, ``watch``, ``kill`` and ``top`` on elockctl's command parsers."""
    raw = argparse.RawDescriptionHelpFormatter
    ls = commands.add_parser(
        "ls",
        help="the lock table: every held or waited-for key, with ages",
        description="List the keys with a hold or a waiter, sorted by key: kind, "
        "owner, age, fencing token, lease left, waiters.",
        epilog=LS_EPILOG,
        formatter_class=raw,
    )
    add_listing_options(ls)
    ls.add_argument("--limit", type=count, metavar="N", help="at most N keys")
    ls.add_argument("--json", action="store_true", help="one JSON object per key instead")

    watch = commands.add_parser(
        "watch",
        help="print every grant and free under PREFIX as it happens",
        description="Print the holds under PREFIX, then every grant and free as it "
        "happens, one stamped line each, until Ctrl-C.",
        epilog=WATCH_EPILOG,
        formatter_class=raw,
    )
    watch.add_argument(
        "prefix", nargs="?", metavar="PREFIX", help="only keys starting with PREFIX (default: all)"
    )

    kill = commands.add_parser(
        "kill",
        help="free every hold on KEY, whoever owns it (an operator's token needed)",
        description="Free every hold on KEY, whoever owns it, and print 'killed N'.",
        epilog=KILL_EPILOG,
        formatter_class=raw,
    )
    kill.add_argument("key", metavar="KEY", help="the key (one word)")
    kill.add_argument(
        "--admin-token-file",
        metavar="FILE",
        required=True,
        help="the file holding the server's admin token (its --admin-token-file)",
    )

    top = commands.add_parser(
        "top",
        help="a live view: oldest holds, longest queues, requests per second",
        description="Show the oldest holds, the longest queues and the requests per "
        "second, refreshed in place.",
        epilog=TOP_EPILOG,
        formatter_class=raw,
    )
    add_listing_options(top)
    top.add_argument(
        "--interval",
        type=interval,
        default=1.0,
        metavar="S",
        help="seconds between frames (default: 1)",
    )
    top.add_argument(
        "--rows", type=count, default=10, metavar="N", help="rows per pane (default: 10)"
    )
    top.add_argument(
        "--scan",
        type=count,
        default=100_000,
        metavar="N",
        help="list at most N keys per frame (default: 100000)",
    )
    top.add_argument("--once", action="store_true", help="draw one frame and exit")
