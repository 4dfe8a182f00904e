"""``elockctl``: probes, stats and ``elockctl lock KEY COMMAND`` from the shell.

One-liners (``g r i sg sr si q``, ``stats``, ``info``, ``dump``) use the blocking
client: a connection, one request, done. ``lock`` is :mod:`elockd.ctl.lock`,
``throttle`` :mod:`elockd.ctl.throttle`, the operators' ``ls``/``kill``
:mod:`elockd.ctl.operate`, ``watch`` :mod:`elockd.ctl.watch`, ``top``
:mod:`elockd.ctl.top`, the command line :mod:`elockd.ctl.args`,
the exit statuses :mod:`elockd.ctl.status`.
Whatever goes wrong is said in one line that names the server, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from elockd.client import BlockingClient
from elockd.client.core import printable, quoted, terse_answer
from elockd.ctl.args import PROBE_VERBS, build_parser, client_options, parse
from elockd.ctl.doors import hint
from elockd.ctl.status import (
    EXIT_FALSE,
    EXIT_INTERRUPTED,
    chosen,
    die_interrupted,
    failure,
    say,
    where,
)

#: Commands that run until Ctrl-C: it is how they end, so it is exit 0, quietly.
UNTIL_INTERRUPTED = frozenset({"watch", "top"})

#: Probes that take a hold, which ends as soon as elockctl's connection does.
HOLDING_PROBES = frozenset({"g", "sg"})


def main(argv: Sequence[str] | None = None) -> int:
    # elockctl says what went wrong itself, in one line: the client's own warnings
    # (a lost hold) would say it a second time through logging's last resort.
    logging.getLogger("elockd").addHandler(logging.NullHandler())
    parser = build_parser()
    args = parse(parser, list(sys.argv[1:] if argv is None else argv))
    options = client_options(parser, args)
    try:
        return runner_of(args.command)(args, options)
    except BrokenPipeError:  # `elockctl stats | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FALSE
    except (Exception, KeyboardInterrupt, BaseExceptionGroup) as error:  # see failure()
        status, message = failure(error, where(options))
        if status == EXIT_INTERRUPTED:
            return 0 if args.command in UNTIL_INTERRUPTED else die_interrupted()
        if message:
            say(message + hint(chosen(error), options, bool(args.tls_cert)))
        return status


# ------------------------------------------------------- commands of their own
# Each imports its module when it runs, not before: a one-liner (or ``throttle``)
# then starts without trio, rich and the rest (docs/client.md, "elockctl").

Runner = Callable[[argparse.Namespace, dict[str, Any]], int]

#: A command of its own: the module under elockd.ctl that runs it, and its runner.
RUNNERS = {
    "lock": ("lock", "run_lock"),
    "throttle": ("throttle", "run_throttled"),
    "upgrade": ("upgrade", "run_upgrade"),
    "ls": ("operate", "run_ls"),
    "kill": ("operate", "run_kill"),
    "watch": ("watch", "run_watch"),
    "top": ("top", "run_top"),
}


def runner_of(command: str) -> Runner:
    """The runner of ``command``, its module imported now; the one-liners' runner
    for the rest."""
    if command not in RUNNERS:
        return run_one_liner
    module, name = RUNNERS[command]
    runner: Runner = getattr(importlib.import_module(f"elockd.ctl.{module}"), name)
    return runner


# ---------------------------------------------------------------- one-liners


def run_one_liner(args: argparse.Namespace, options: dict[str, Any]) -> int:
    out = sys.stdout
    with BlockingClient(**options) as client:
        if args.command in PROBE_VERBS:
            return run_probe(client, args.command, " ".join(args.key))
        if args.command == "q":
            for line in client.command(b"q", check=True):
                out.write(printable(line) + "\n")
            return 0
        if args.command == "stats":
            print_stats(client.stats(), args.json)
            return 0
        if args.command == "info":
            details = client.info(args.key)
            values = {
                "key": printable(details.key),
                "exclusive": None if details.owner is None else printable(details.owner),
                "shared": details.shared,
                "waiting": details.waiting,
                "ttl": details.ttl,
                "token": details.token,
            }
            if args.json:
                out.write(json.dumps(values) + "\n")
            else:
                for name, value in values.items():
                    out.write(f"{name}: {'-' if value is None else value}\n")
            return 0
        assert args.command == "dump"
        for line in client.command(b"dump shared" if args.shared else b"dump", check=True):
            out.write(printable(line) + "\n")
        return 0


def run_probe(client: BlockingClient, verb: str, key: str) -> int:
    """One terse request; its reply printed; yes 0, no 1. A reply that is neither
    (``0 Auth Required``, a banner) raised already: see ``command(check=True)``."""
    reply = client.command(f"{verb} {key}", check=True)[0]
    sys.stdout.write(printable(reply) + "\n")
    answer = terse_answer(verb.encode(), reply)
    if answer and verb in HOLDING_PROBES:
        say(
            f"the hold on {quoted(key.encode())} ended with this command's connection; "
            "to hold a lock while something runs: elockctl lock KEY COMMAND"
        )
    return 0 if answer else EXIT_FALSE


def print_stats(values: dict[str, int], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(values, sort_keys=True) + "\n")
        return
    width = max(len(name) for name in values)
    for name, value in values.items():
        sys.stdout.write(f"{name:<{width}}  {value:>12}\n")


if __name__ == "__main__":
    sys.exit(main())
