"""Waiting in tests, in one place.

``eventually`` polls a condition until it holds. It is for what a test cannot be
told about directly: a server noticing that a connection closed, a request joining
a queue, a cluster node's copy of etcd catching up. A fixed sleep there would be a
guess, too long on a quiet machine and too short on a busy one. The test's clock
runs it: on a ``MockClock`` the polls cost nothing, on a real one they end as soon
as the condition holds.

``nothing_arrives`` does the opposite on purpose: it waits a fixed time to show
that no reply comes meanwhile. That wait is the assertion, not a synchronisation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from tests.support.line_client import LineClient

T = TypeVar("T")


class NotInTime(AssertionError):
    """``eventually`` gave up: the condition did not hold within its bound."""


async def eventually(
    check: Callable[[], Awaitable[T]] | Callable[[], T],
    *,
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "",
) -> T:
    """Call ``check`` every ``interval`` seconds until it returns something true, and
    return that. After ``timeout`` seconds fail with :class:`NotInTime`, naming
    ``what`` (or the check) and the last value seen.

    ``check`` is a plain or an async function. It may assert on what it sees, so a
    state that must never show up fails at once instead of being waited out. A check
    under way is not cut short at the bound (a client stays in step with its
    replies); one that hangs is stopped at twice the bound.
    """
    deadline = trio.current_time() + timeout
    with trio.fail_at(deadline + timeout):
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result  # type: ignore[return-value]
            if trio.current_time() >= deadline:
                name = what or getattr(check, "__qualname__", repr(check))
                raise NotInTime(f"not within {timeout} s: {name} (last: {result!r})")
            await trio.sleep(interval)


def eventually_blocking(
    check: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> T:
    """:func:`eventually` for a test that runs outside trio (blocking clients,
    subprocesses): the same loop, in a trio run of its own."""
    wait = functools.partial(eventually, check, timeout=timeout, interval=interval, what=what)
    return trio.run(wait)


async def stats_showing(client: LineClient, **counts: int) -> dict[str, int] | None:
    """A check for :func:`eventually`: the ``q`` counters once they show ``counts``
    (a cluster node counts keys from its copy of etcd's queues, a few ms behind)."""
    values = await client.stats()
    return values if all(values[name] == count for name, count in counts.items()) else None


async def counted_stats(client: LineClient, **counts: int) -> tuple[dict[str, int], int]:
    """The ``q`` counters once they show ``counts``, and how many ``q`` requests it
    took to see them (each counts itself in ``command_q``)."""
    reads = 0

    async def read() -> dict[str, int] | None:
        nonlocal reads
        reads += 1
        return await stats_showing(client, **counts)

    return await eventually(read, what=f"q showing {counts}"), reads


async def until_waiting(
    client: LineClient, key: bytes, count: int = 1, *, timeout: float = 10.0
) -> None:
    """Until ``info KEY`` shows ``count`` requests waiting for ``key``: how a test
    knows a request has queued before it sends the next one (a connection's
    requests are answered in order, so a sent request alone tells nothing)."""

    async def waiting() -> bool:
        reply = await client.request(b"info " + key)
        assert reply.startswith(b"200 "), reply
        return b" waiting=%d " % count in reply

    await eventually(waiting, timeout=timeout, what=f"{count} waiting for {key!r}")


async def resumed(client: LineClient, session_id: bytes) -> bool:
    """A check for :func:`eventually`: whether ``conn_id SESSION_ID`` on ``client``
    takes the session over, which it may not until the server has seen the session's
    connection end (any reply but those two fails)."""
    reply = await client.request(b"conn_id " + session_id)
    assert reply in (b"200 conn id set", b"403 cannot set conn id"), reply
    return reply == b"200 conn id set"


async def nothing_arrives(client: LineClient, seconds: float) -> None:
    """Fail if a reply line reaches ``client`` within ``seconds``."""
    with trio.move_on_after(seconds):
        line = await client.line()
        raise AssertionError(f"unexpected reply {line!r}")
