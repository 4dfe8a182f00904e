"""``--max-throttles`` and ``--max-waiters`` on ``throttle``, on both backends: the
request that would pass a limit gets its 413 and nothing changes; and a server
flooded with distinct keys stops at the limit, its memory with it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elockd.protocol.config import Config
from tests.support.line_client import RunningServer
from tests.support.polling import eventually, stats_showing


@pytest.fixture
def server_config() -> Config:
    return replace(Config(port=0, metrics_port=0), max_throttles=3, max_waiters=2)


async def test_max_throttles_and_max_waiters_are_413(
    lock_server: RunningServer, clock: object
) -> None:
    client, *waiters = [await lock_server.connect() for _ in range(4)]
    for key in (b"a", b"b", b"c"):
        assert (await client.reply(b"throttle %s 1 60" % key)).startswith(b"200 ")
    assert await client.reply(b"throttle d 1 60") == b"413 Too Many Throttles\r\n"
    assert (await client.reply(b"throttle d 1 60 cost=0")).startswith(b"200 ")  # a peek adds none
    assert (await client.reply(b"throttle a 1 60")).startswith(b"409 ")  # known keys go on
    for count, waiter in enumerate(waiters[:2], start=1):
        await waiter.send(b"throttle a 1 60 wait=1000\n")
        await eventually(lambda n=count: stats_showing(client, waiting=n))  # type: ignore[misc]
    assert await waiters[2].reply(b"throttle a 1 60 wait=1000") == b"413 Too Many Waiters\r\n"
