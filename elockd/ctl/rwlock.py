"""``elockctl lock -s`` and ``-x`` as flock(1) means them: readers and a writer.

On the server a shared hold (``lock_shared``, ``sg``) and an exclusive one
(``lock``, ``g``) live in two tables and never exclude each other. flock's ``-s``
and ``-x`` do: a writer waits for every reader to leave, and no reader enters
while a writer is in. elockctl builds that from the two tables, every wait done
by the server (first come, first served), none by polling:

* a **writer** takes the exclusive hold, then waits, with a second connection,
  for a shared hold with ``limit=1``: the server grants it only once no one else
  holds K shared. That hold is let go at once; the exclusive hold is kept.
* a **reader** takes the exclusive hold with the second connection (so no writer
  is in, and none can enter), takes its shared hold, and lets the exclusive one
  go at once.

No interleaving lets both in: a reader only joins while it holds the exclusive
hold, which a writer has for as long as it runs, and a writer only starts once the
readers that joined before it have left. ``-w`` bounds both steps together.

Only holders that follow this (every ``elockctl lock``) exclude each other so; a
bare ``sg K`` does not take the exclusive hold first (docs/client.md).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from typing import Any

import trio

from elockd.client import Client, ElockError, Hold


async def take(
    client: Client,
    args: argparse.Namespace,
    options: dict[str, Any],
    on_lost: Callable[[Hold], object],
) -> Hold:
    """The hold ``args`` asks for, on ``client``; :class:`Unavailable` if it was not
    granted within ``args.wait`` (0: try once)."""
    # Raised outside the second client's block: leaving it, an error would come
    # wrapped in the exception group of the client's tasks.
    failed: ElockError | None = None
    async with Client(**options) as gate:
        try:
            return await through(client, gate, args, on_lost)
        except ElockError as error:
            failed = error
    raise failed


async def through(
    client: Client, gate: Client, args: argparse.Namespace, on_lost: Callable[[Hold], object]
) -> Hold:
    deadline = trio.current_time() + args.wait

    def left() -> float:
        return max(0.0, deadline - trio.current_time()) if args.wait else 0.0

    if args.shared:
        door = await gate.acquire(args.key, args.wait)
        hold = await client.acquire_shared(args.key, args.limit, left(), args.ttl, on_lost)
        await gate.release(door)
        return hold
    hold = await client.acquire(args.key, args.wait, args.ttl, on_lost)
    try:
        readers_gone = await gate.acquire_shared(args.key, 1, left())
    except BaseException:
        with trio.CancelScope(shield=True), contextlib.suppress(ElockError):
            await client.release(hold)
        raise
    await gate.release(readers_gone)
    return hold
