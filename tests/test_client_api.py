"""Both clients get their public calls from one definition (elockd/client/calls.py):
the same names, the same parameters, awaited on one and blocking on the other."""

from __future__ import annotations

import inspect

import pytest

from elockd.client import BlockingClient, Client
from elockd.client.base import ClientBase
from elockd.client.methods import Block, Call

CALLS = [name for name, value in vars(ClientBase).items() if isinstance(value, Call)]
BLOCKS = [name for name, value in vars(ClientBase).items() if isinstance(value, Block)]


def test_the_public_calls_are_all_there() -> None:
    public = {name for name in CALLS + BLOCKS if not name.startswith("_")}
    assert public == {
        "acquire",
        "acquire_shared",
        "acquire_many",
        "release",
        "lock",
        "shared",
        "mlock",
        "check",
        "info",
        "stats",
        "ping",
        "session_id",
        "resume",
        "set_grace",
        "command",
        "throttle",
    }


@pytest.mark.parametrize("name", CALLS + BLOCKS)
def test_both_clients_offer_a_call_alike(name: str) -> None:
    trio_call, blocking_call = getattr(Client, name), getattr(BlockingClient, name)
    assert inspect.signature(trio_call) == inspect.signature(blocking_call)
    assert next(iter(inspect.signature(trio_call).parameters)) == "self"
    assert trio_call.__doc__ and trio_call.__doc__ == blocking_call.__doc__
    assert (trio_call.__qualname__, blocking_call.__qualname__) == (
        f"Client.{name}",
        f"BlockingClient.{name}",
    )
    assert inspect.iscoroutinefunction(trio_call) == (name in CALLS)
    assert not inspect.iscoroutinefunction(blocking_call)


async def test_a_block_entered_the_wrong_way_says_how() -> None:
    """Nothing is sent: the check comes before the acquire."""
    with pytest.raises(TypeError, match="'async with'"), Client().lock("k"):
        pass
    blocking = BlockingClient()
    try:
        with pytest.raises(TypeError, match="entered with 'with'"):
            async with blocking.lock("k"):
                pass
    finally:
        blocking._close_wakeup()
