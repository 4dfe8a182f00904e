"""``elockctl throttle KEY COUNT/PERIOD COMMAND``: run COMMAND if the rate allows it.

One ``throttle`` request (with ``wait=`` under ``-w``), then the connection is
closed and COMMAND runs: a throttle belongs to no session, so nothing has to be
held while it runs. A limited run is one line on stderr and exit 1; a reply that
is no answer about the rate (unreachable, ``413``, ``409 Backend Unavailable``)
is exit 3, so a loop can tell "not now" from "cannot tell". COMMAND is run as
``elockctl lock`` runs it, signals forwarded, but on the blocking client and
without trio: a rate is asked for from loops, and elockctl's start-up is part of
each call's cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from elockd.client import BlockingClient, ElockError, ThrottleResult
from elockd.client.core import quoted
from elockd.ctl.doors import hint
from elockd.ctl.signals import run_forwarding
from elockd.ctl.status import EXIT_FALSE, failure, say, where

#: The fields ``--peek`` prints, in order.
FIELDS = ("admitted", "limit", "remaining", "retry_after", "reset_after")


def run_throttled(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Ask once (or wait up to ``-w``); run COMMAND when admitted; see THROTTLE_EPILOG."""
    count, period = args.rate
    try:
        with BlockingClient(**options) as client:
            result = client.throttle(
                args.key, count, period, args.burst, args.cost, args.wait or None
            )
    except ElockError as error:
        status, message = failure(error, where(options))
        say(message + hint(error, options, bool(args.tls_cert)))
        return status
    if args.peek:
        print_result(result, args.json)
        return 0
    if not result.admitted:
        say(
            f"throttle {quoted(args.key.encode())}: limited, "
            f"retry after {result.retry_after:.3f} s"
        )
        return EXIT_FALSE
    return run_forwarding(args.argv)


def print_result(result: ThrottleResult, as_json: bool) -> None:
    """The five fields, as ``name: value`` lines (seconds to the millisecond) or JSON."""
    values = {name: getattr(result, name) for name in FIELDS}
    if as_json:
        sys.stdout.write(json.dumps(values) + "\n")
        return
    for name, value in values.items():
        if isinstance(value, bool):
            text = "yes" if value else "no"
        elif isinstance(value, float):
            text = f"{value:.3f}"
        else:
            text = str(value)
        sys.stdout.write(f"{name}: {text}\n")
