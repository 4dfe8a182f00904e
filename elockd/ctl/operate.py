"""``elockctl ls`` and ``elockctl kill``: the lock table, and an operator freeing a key.

Both are one connection and one request on the blocking client. ``ls`` prints the
table (or JSON lines) with human ages; ``kill`` authenticates with the token of
``--admin-token-file`` (which passes wherever ``auth`` does) and frees every hold
on the key, exit 0; a server that refuses (``403 Forbidden``: not an admin
connection, or no ``--admin-token-file`` on the server) is a plain "no", exit 1,
said in one line naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console

from elockd.client import AuthError, BlockingClient
from elockd.client.core import encode_key, printable, quoted
from elockd.ctl.rows import Row, lock_table, parse_listing, seconds_text
from elockd.ctl.status import EXIT_ERROR, EXIT_FALSE, say, where


def ls_line(prefix: str | None, older: float | None, limit: int | None) -> bytes:
    """The request: ``ls [PREFIX] [older=S] [limit=N]``."""
    words = [b"ls"]
    if prefix:
        words.append(encode_key(prefix))
    if older is not None:
        words.append(b"older=" + seconds_text(older).encode())
    if limit is not None:
        words.append(b"limit=%d" % limit)
    return b" ".join(words)


def listing(client: BlockingClient, request: bytes) -> tuple[list[Row], bool]:
    """The rows of an ``ls`` reply and whether ``limit=`` cut it; a refusal raises
    (``RequestError``, or ``AuthError``, as any command's)."""
    return parse_listing(client.command(request, check=True))


def run_ls(args: argparse.Namespace, options: dict[str, Any]) -> int:
    with BlockingClient(**options) as client:
        rows, more = listing(client, ls_line(args.prefix, args.older, args.limit))
    if args.json:
        out = sys.stdout
        for row in rows:
            out.write(json.dumps(row.as_json()) + "\n")
        out.flush()
        if more:
            say(f"more keys than --limit {args.limit}: the listing was cut")
        return 0
    caption = f"… more (cut at --limit {args.limit})" if more else None
    console = console_for_stdout()
    if rows or more:
        console.print(lock_table(rows, caption=caption, plain=True))
    else:
        console.print(
            "no key is held or waited for" + (f" under {args.prefix}" if args.prefix else "")
        )
    return 0


def console_for_stdout() -> Console:
    """rich on stdout; into a pipe or a file nothing wraps or is cut short: a long
    key or a 19-digit token stays whole on its row, for grep and awk."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 1 << 16)


def run_kill(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``auth ADMIN_TOKEN`` (the client's auth step), then ``kill KEY``."""
    server = where(options)
    key = encode_key(args.key)
    flag = f"--admin-token-file {args.admin_token_file}"
    try:
        with BlockingClient(**options) as client:
            reply = client.command(b"kill " + key, check=True)[0]
    except AuthError as error:
        if error.reply.startswith(b"403 Bad Token"):
            say(f"{server}: the token of {flag} was refused ({printable(error.reply)})")
            return EXIT_FALSE
        raise
    words = reply.split()
    if reply.startswith(b"200 Killed ") and len(words) == 3 and words[2].isdigit():
        print(f"killed {int(words[2])}", flush=True)
        return 0
    if reply.startswith(b"403"):
        say(
            f"{server}: kill {quoted(key)}: {printable(reply)} (this server takes no kill "
            f"with the token of {flag}: is it its --admin-token-file?)"
        )
        return EXIT_FALSE
    say(f"{server}: kill {quoted(key)}: {printable(reply)}")
    return EXIT_ERROR
