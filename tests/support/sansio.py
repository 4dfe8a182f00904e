"""Helpers for tests that drive the sans-IO layer directly: a service on the
in-memory backend, and replies made whole without a server loop."""

from __future__ import annotations

from typing import Any

from elockd.backend.memory import MemoryBackend, Wait
from elockd.net.serving import answered
from elockd.protocol.commands import COMMANDS
from elockd.protocol.config import Config
from elockd.protocol.connection import Delayed, Outcome, Reply, Reports, Service, Streamed


def memory_service(config: Config | None = None, **settings: Any) -> Service:
    """A service on a fresh in-memory backend (fencing tokens from 100)."""
    config = config or Config(**settings)
    backend = MemoryBackend(
        first_token=100,
        max_waiters=config.max_waiters,
        max_holds=config.max_holds,
        max_sessions=config.max_sessions,
    )
    return Service(config, backend, COMMANDS)


def waiting(reply: Reply) -> bool:
    """Is ``reply`` a request that still waits in the engine?"""
    return (
        isinstance(reply, Outcome) and isinstance(reply.later, Wait) and reply.later.waiter.waiting
    )


def whole(reply: Reply) -> bytes:
    """The reply's bytes. An outcome must be ready (its wait granted or timed out by
    the engine): its coroutine then completes without suspending, and is driven
    here without an event loop."""
    if isinstance(reply, Streamed):
        return reply.whole()
    if isinstance(reply, Delayed):
        return reply.reply
    if isinstance(reply, Outcome):
        assert not waiting(reply), "the request still waits"
        coroutine = answered(reply, Reports())
        try:
            coroutine.send(None)
        except StopIteration as done:
            settled = done.value
            return settled.whole() if isinstance(settled, Streamed) else settled
        coroutine.close()
        raise AssertionError("the outcome needed an event loop")
    return reply
