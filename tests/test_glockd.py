"""``--replies glockd``: glockd r312's dialect of the terse family, on both backends.

r312's behaviours are pinned as a table (each request with its exact bytes, b""
for no reply at all), and a client that reads the way the Node ``lockd`` library
does (a multi-line reply ends after 100 ms of silence; each line is split on
``": "``) must see exactly the holds. The word family is unchanged in this mode.
"""

from __future__ import annotations

import pytest
import trio

from elockd.protocol.config import Config
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import eventually

SILENCE = 0.1  # what the Node library waits before it takes a reply as complete


@pytest.fixture
def server_config() -> Config:
    return Config(replies="glockd")


async def silence_read(client: LineClient, request: bytes) -> bytes:
    """Send ``request``; everything that arrives until 100 ms pass with nothing."""
    await client.send(request + b"\n")
    received = b""
    while True:
        with trio.move_on_after(SILENCE) as quiet:
            chunk = await client.stream.receive_some(65536)
            assert chunk, "the server closed the connection"
            received += chunk
        if quiet.cancelled_caught:
            return received


def node_lockd_parse(reply: bytes) -> dict[str, str]:
    """As the Node library reads a listing: each line split on ': ' into a pair."""
    pairs = {}
    for line in reply.decode().split("\r\n"):
        if line:
            name, _, value = line.partition(": ")
            pairs[name] = value
    return pairs


async def q_showing(client: LineClient, **counts: str) -> dict[str, str] | None:
    """A check for :func:`eventually`: ``q``'s counters once they show ``counts`` (a
    cluster node counts locks from its copy of etcd's queues, a few ms behind)."""
    values = node_lockd_parse(await silence_read(client, b"q"))
    return values if all(values[name] == count for name, count in counts.items()) else None


async def replies_then_pong(client: LineClient, request: bytes) -> bytes:
    """The bytes a request gets, made exact by a ``ping`` sent right after it: a
    request that gets no reply at all is followed directly by ``200 PONG``."""
    await client.send(request + b"\nping\n")
    received = b""
    while not received.endswith(b"200 PONG\r\n"):
        chunk = await client.stream.receive_some(65536)
        assert chunk, "the server closed the connection"
        received += chunk
    return received[: -len(b"200 PONG\r\n")]


async def test_r312_replies_byte_for_byte(lock_server: RunningServer, clock: object) -> None:
    holder, asker = await lock_server.connect(), await lock_server.connect()
    for line in (b"g job", b"g a:b", b"sg pool", b"iam builder"):
        await holder.send(line + b"\n")
        await holder.line()
    await asker.send(b"sg pool\n")
    await asker.line()
    h, a = holder.peer, asker.peer
    table = [
        (b"xx", b""),  # an unknown verb: no reply at all
        (b"", b""),  # nor for an empty line
        (b"G job", b""),  # verbs are case-sensitive: unknown
        (b"g job", b"0 Lock Get Failure: job\r\n"),
        (b"d", b"a:b: builder\r\njob: builder\r\n"),  # no END
        (b"d job", b"job: builder\r\n"),
        (b"d nothing", b""),  # a dump that matches nothing: nothing
        (b"sd pool", b"pool: builder\r\npool: %s\r\n" % a),
        (b"sd nothing", b""),
        (b"who", b"%s: builder\r\n" % h),
        (b"who nobody", b""),
        # dump: Go's print of the map, keys sorted, owners as IP:PORT.
        (b"dump", b"map[a:b:%s job:%s]\r\n" % (h, h)),
        (b"dump shared", b"map[pool:[%s %s]]\r\n" % (h, a)),
        (b"ping", b"200 PONG\r\n"),  # the word family is unchanged
        (b"lock job", b"409 Unavailable\r\n"),
        (b"nope k v", b""),
    ]
    for request, expected in table:
        assert await replies_then_pong(asker, request) == expected, request
    await holder.send(b"r job\nr a:b\nsr pool\n")
    for _ in range(3):
        await holder.line()
    assert await replies_then_pong(asker, b"dump") == b"map[]\r\n"
    assert await replies_then_pong(asker, b"dump shared") == b"map[pool:[%s]]\r\n" % a
    assert await replies_then_pong(asker, b"d") == b""


async def test_q_lists_exactly_glockds_counters_sorted(
    lock_server: RunningServer, clock: object
) -> None:
    client = await lock_server.connect()
    glockd = (
        "command_d command_dump command_g command_i command_q command_r command_sd "
        "command_sg command_si command_sr connections invalid_commands locks orphans "
        "shared_locks shared_orphans"
    ).split()
    first = node_lockd_parse(await silence_read(client, b"q"))
    assert list(first) == glockd  # sorted, no END, none of elockd's extras
    assert first["command_q"] == "1"
    await client.send(b"iam x\nme\nlock k\n")  # iam and me once used appear; lock never
    for _ in range(3):
        await client.line()

    second = await eventually(lambda: q_showing(client, locks="1"), what="q counting the lock")
    assert list(second) == sorted([*glockd, "command_iam", "command_me"])
    assert second["locks"] == "1"


async def test_a_node_lockd_reader_sees_exactly_the_holds(
    lock_server: RunningServer, clock: object
) -> None:
    holders = [await lock_server.connect() for _ in range(3)]
    for index, client in enumerate(holders):
        await client.send(b"iam worker-%d\ng job-%d\nsg pool\n" % (index, index))
        for _ in range(3):
            await client.line()
    reader = await lock_server.connect()
    dump = node_lockd_parse(await silence_read(reader, b"d"))
    assert dump == {f"job-{i}": f"worker-{i}" for i in range(3)}  # no bogus "": "ND"
    names = node_lockd_parse(await silence_read(reader, b"who"))
    assert names == {c.peer.decode(): f"worker-{i}" for i, c in enumerate(holders)}
    # d and who read etcd and this node's connections; q counts from the copy.
    stats = await eventually(
        lambda: q_showing(reader, locks="3", shared_locks="1"), what="q counting the holds"
    )
    assert "" not in stats and stats["locks"] == "3" and stats["shared_locks"] == "1"


@pytest.mark.parametrize("server_config", [Config(), Config(replies="glockd")])
async def test_who_lists_in_naming_order_on_both_styles(
    lock_server: RunningServer, clock: object
) -> None:
    """``who``'s order is the order names were set, whatever the reply style."""
    clients = [await lock_server.connect() for _ in range(4)]
    for name, client in zip((b"d", b"b", b"c", b"a"), clients, strict=True):
        await client.send(b"iam " + name + b"\n")
        await client.line()
    await clients[1].send(b"iam b2\n")  # naming again moves it to the end
    await clients[1].line()
    reply = await silence_read(clients[0], b"who")
    names = [line.split(b": ")[1] for line in reply.split(b"\r\n") if b": " in line]
    assert names == [b"d", b"c", b"a", b"b2"]


async def test_requests_that_get_no_reply_are_still_counted(
    lock_server: RunningServer, clock: object
) -> None:
    """docs/glockd.md: a request glockd answers with nothing still counts, in
    ``invalid_commands`` or its ``command_*``; ``command_who`` appears once used."""
    client = await lock_server.connect()
    for request in (b"xx", b"", b"G job", b"nope k v", b"d nothing", b"sd nothing", b"who x"):
        assert await replies_then_pong(client, request) == b"", request
    counts = node_lockd_parse(await silence_read(client, b"q"))
    assert counts["invalid_commands"] == "4"
    assert (counts["command_d"], counts["command_sd"], counts["command_who"]) == ("1", "1", "1")


async def test_dump_shared_lists_every_key_and_an_empty_table_as_an_empty_map(
    lock_server: RunningServer, clock: object
) -> None:
    holder, other = await lock_server.connect(), await lock_server.connect()
    assert await replies_then_pong(other, b"dump shared") == b"map[]\r\n"
    for client, line in ((holder, b"sg p1"), (holder, b"sg p2"), (other, b"sg p1")):
        await client.send(line + b"\n")
        await client.line()
    h, o = holder.peer, other.peer
    expected = b"map[p1:[%s %s] p2:[%s]]\r\n" % (h, o, h)
    assert await replies_then_pong(other, b"dump shared") == expected
    await holder.send(b"sr p1\nsr p2\n")
    await other.send(b"sr p1\n")
    for client in (holder, holder, other):
        await client.line()
    assert await replies_then_pong(other, b"dump shared") == b"map[]\r\n"
