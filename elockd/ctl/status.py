"""What elockctl's exit status says, and the one line it prints when it fails.

Three classes, so that ``elockctl i job || run-job`` never runs the job because of a
failure: yes 0, no 1, could not tell 3 (no server, a token wanted or refused, a
reply that is not elockd's, a lost connection); a usage error is 2. ``elockctl
lock`` adds COMMAND's own status and 75 for a lock lost while COMMAND ran.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from elockd.client import AuthError, ElockError, LockLost, ProtocolError, RequestError

EXIT_FALSE = 1  # the answer was no: a probe's leading integer was 0, a lock not granted
EXIT_USAGE = 2  # a mistake in the command line (argparse's own status)
EXIT_ERROR = 3  # could not tell: no server, auth wanted or refused, a foreign reply...
EXIT_LOST = 75  # EX_TEMPFAIL: the lock was lost while COMMAND ran
EXIT_INTERRUPTED = 128 + signal.SIGINT


def say(message: str) -> None:
    """One line on stderr, flushed at once: it may be the last thing elockctl does."""
    print(f"elockctl: {message}", file=sys.stderr, flush=True)


def die_interrupted() -> int:
    """End as a SIGINT ends a process, as flock does when Ctrl-C stops its wait: a
    shell loop around elockctl then stops too (it reads a signal death, not 130).
    Returns 130 only if the signal somehow did not end the process."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    return EXIT_INTERRUPTED


def where(options: dict[str, Any]) -> str:
    """The server as messages name it: ``HOST:PORT``, ``unix:PATH`` or the URL."""
    if options.get("url"):
        return str(options["url"])
    return f"unix:{options['unix']}" if options["unix"] else f"{options['host']}:{options['port']}"


def failure(error: BaseException, server: str) -> tuple[int, str]:
    """The exit status and the one line for whatever ended elockctl.

    trio hands errors out of a nursery in an exception group, even a single one:
    the group is opened and the error that says most is reported (the first from
    the lock service, else the first one).
    """
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaf_errors(error)):
        return EXIT_INTERRUPTED, ""
    error = chosen(error)
    text = str(error)
    line = text if server in text else f"{server}: {text}"
    if isinstance(error, AuthError):
        if error.reply.startswith(b"403 Bad Token"):
            return EXIT_ERROR, f"{line} (the token of --auth-token-file was refused)"
        return EXIT_ERROR, f"{line} (the server wants a token: --auth-token-file FILE)"
    if isinstance(error, ProtocolError):
        return EXIT_ERROR, line  # what port it is instead: ctl_doors.hint
    if isinstance(error, LockLost):
        return EXIT_LOST, line
    if isinstance(error, RequestError) and (
        error.reply.startswith(b"400 ") or error.reply == b"0 Line Too Long"
    ):
        return EXIT_USAGE, line
    if isinstance(error, ElockError):
        return EXIT_ERROR, line
    return EXIT_ERROR, f"{server}: unexpected {type(error).__name__}: {text}"


def chosen(error: BaseException) -> BaseException:
    """The error that says most: the first from the lock service, else the first."""
    leaves = leaf_errors(error)
    return next((leaf for leaf in leaves if isinstance(leaf, ElockError)), leaves[0])


def leaf_errors(error: BaseException) -> Sequence[BaseException]:
    """The errors inside (nested) exception groups, in order; an error on its own."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaf_errors(inner)]
    return [error]
