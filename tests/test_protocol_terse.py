"""Every row of the terse table, both reply styles, on both backends (the in-memory
server and a cluster node on a real etcd): one contract, byte for byte."""

from __future__ import annotations

import pytest

from elockd.protocol.config import Config
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import counted_stats, eventually, stats_showing

ELOCKD, GLOCKD = "elockd", "glockd"


@pytest.fixture(params=[ELOCKD, GLOCKD])
def server_config(request: pytest.FixtureRequest) -> Config:
    return Config(replies=request.param)


async def pair(server: RunningServer) -> tuple[LineClient, LineClient]:
    return await server.connect(), await server.connect()


# (request by b, expected reply in the elockd style, in the glockd style), after a
# took "theirs" exclusively and "shared" shared, and b took "mine" and "myshared".
ROWS = [
    # g: free / already mine / held by another
    (b"g free", b"1 Got Lock\r\n", b"1 Lock Get Success: free\r\n"),
    (b"g mine", b"1 Got Lock\r\n", b"1 Lock Get Success: mine\r\n"),
    (b"g theirs", b"0 Cannot Get Lock\r\n", b"0 Lock Get Failure: theirs\r\n"),
    # r
    (b"r mine", b"1 Released Lock\r\n", b"1 Lock Release Success: mine\r\n"),
    (b"r theirs", b"0 Cannot Release Lock\r\n", b"0 Lock Release Failure: theirs\r\n"),
    (b"r free", b"0 Cannot Release Lock\r\n", b"0 Lock Release Failure: free\r\n"),
    # i
    (b"i theirs", b"1 Locked\r\n", b"1 Lock Is Locked: theirs\r\n"),
    (b"i free", b"0 Not Locked\r\n", b"0 Lock Not Locked: free\r\n"),
    # sg: N holders after; a repeat adds no hold
    (b"sg shared", b"2 Got Lock\r\n", b"2 Shared Lock Get Success: shared\r\n"),
    (b"sg myshared", b"1 Got Lock\r\n", b"1 Shared Lock Get Success: myshared\r\n"),
    # sr
    (b"sr myshared", b"1 Released Lock\r\n", b"1 Shared Lock Release Success: myshared\r\n"),
    (b"sr shared", b"0 Cannot Release Lock\r\n", b"0 Shared Lock Release Failure: shared\r\n"),
    # si: anyone may ask
    (b"si shared", b"1 Locked\r\n", b"1 Shared Lock Is Locked: shared\r\n"),
    (b"si free", b"0 Not Locked\r\n", b"0 Shared Lock Not Locked: free\r\n"),
]


async def test_terse_table(lock_server: RunningServer, clock: object) -> None:
    """Each row on a fresh pair of holders (rows change the tables)."""
    glockd = lock_server.config.replies == GLOCKD
    for row, (request_line, elockd_reply, glockd_reply) in enumerate(ROWS):
        a, b = await pair(lock_server)
        suffix = b"-%d" % row  # each row on keys of its own
        for client, line in ((a, b"g theirs"), (a, b"sg shared"), (b, b"g mine")):
            assert (await client.reply(line + suffix))[:1] == b"1"
        assert (await b.reply(b"sg myshared" + suffix))[:1] == b"1"
        # glockd's texts end with the key, which carries the row's suffix here.
        expected = glockd_reply[:-2] + suffix + b"\r\n" if glockd else elockd_reply
        assert await b.reply(request_line + suffix) == expected, request_line
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("server_config", [Config()])
async def test_repeated_get_keeps_one_hold(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    assert (await a.reply(b"g k"))[:1] == b"1"
    assert (await a.reply(b"g k"))[:1] == b"1"
    assert (await a.reply(b"r k"))[:1] == b"1"
    assert (await b.reply(b"g k"))[:1] == b"1"


@pytest.mark.parametrize("server_config", [Config()])
async def test_shared_counts_and_repeat_by_holder(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"sg k") == b"1 Got Lock\r\n"
    assert await a.reply(b"sg k") == b"1 Got Lock\r\n"
    assert await b.reply(b"sg k") == b"2 Got Lock\r\n"
    assert await b.reply(b"si k") == b"2 Locked\r\n"
    assert await a.reply(b"sr k") == b"1 Released Lock\r\n"
    assert await a.reply(b"si k") == b"1 Locked\r\n"


@pytest.mark.parametrize("server_config", [Config()])
async def test_exclusive_and_shared_tables_are_separate(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"g k") == b"1 Got Lock\r\n"
    assert await b.reply(b"sg k") == b"1 Got Lock\r\n"
    assert await b.reply(b"i k") == b"1 Locked\r\n"
    assert await a.reply(b"si k") == b"1 Locked\r\n"


@pytest.mark.parametrize("server_config", [Config(replies=GLOCKD)])
async def test_terse_key_normalisation(lock_server: RunningServer, clock: object) -> None:
    a = await lock_server.connect()
    for line, key in [
        (b"g  a   b ", b"a b"),
        (b"g\ta\t\tb", b"a b"),
        (b"  g a b  \r", b"a b"),
        (b"g", b""),
        (b"g   ", b""),
    ]:
        assert await a.reply(line) == b"1 Lock Get Success: " + key + b"\r\n", line


@pytest.mark.parametrize("server_config", [Config(replies=GLOCKD)])
async def test_binary_keys_are_never_decoded(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    key = bytes(range(0x80, 0x100)) + b"\x00\x01\rz"
    assert await a.reply(b"g " + key) == b"1 Lock Get Success: " + key + b"\r\n"
    assert await b.reply(b"g " + key) == b"0 Lock Get Failure: " + key + b"\r\n"


@pytest.mark.parametrize("server_config", [Config()])
async def test_unknown_verbs_empty_lines_and_case(
    lock_server: RunningServer, clock: object
) -> None:
    a = await lock_server.connect()
    assert await a.reply(b"G k") == b"0 Invalid Command: G\r\n"
    assert await a.reply(b"nope k") == b"0 Invalid Command: nope\r\n"
    assert await a.reply(b"") == b"0 Invalid Command: \r\n"
    assert await a.reply(b" \t ") == b"0 Invalid Command: \r\n"
    assert await a.reply(b"v" * 100) == b"0 Invalid Command: " + b"v" * 64 + b"\r\n"
    assert await a.reply(b"x" * 5000) == b"0 Line Too Long\r\n"
    assert (await a.stats())["invalid_commands"] == 6


@pytest.mark.parametrize("server_config", [Config()])
async def test_q_lists_every_counter_sorted(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    await a.reply(b"g k")
    await b.reply(b"sg k")
    await b.reply(b"sg j")
    await b.reply(b"ping")
    values, reads = await counted_stats(a, locks=1, shared_locks=2)
    assert list(values) == sorted(values)
    always = (
        "command_d command_dump command_g command_i command_q command_r command_sd "
        "command_sg command_si command_sr connections invalid_commands locks orphans "
        "shared_locks shared_orphans expired handovers leases sessions timeouts waiting"
    ).split()
    assert set(always) <= set(values)
    assert values["handovers"] == 0  # counted by a successor (docs/upgrade.md)
    assert values["command_g"] == 1
    assert values["command_sg"] == 2
    assert values["command_q"] == reads  # a q counts itself
    assert values["command_ping"] == 1  # other verbs appear once used
    assert "command_lock" not in values
    assert values["locks"] == 1
    assert values["shared_locks"] == 2  # keys, not holders
    assert values["connections"] == 2


@pytest.mark.parametrize("server_config", [Config()])
async def test_disconnect_frees_and_counts_orphans(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    for line in (b"g x", b"g y", b"sg s"):
        assert (await a.reply(line))[:1] == b"1"
    await eventually(lambda: stats_showing(b, locks=2, shared_locks=1), what="the holds counted")
    await a.aclose()
    values = await eventually(lambda: stats_showing(b, locks=0, shared_locks=0), what="freed")
    assert values["orphans"] == 2
    assert values["shared_orphans"] == 1
    assert values["connections"] == 1
    assert (await b.reply(b"g x"))[:1] == b"1"


@pytest.mark.parametrize("server_config", [Config()])
async def test_dump_lists_holders_by_owner(lock_server: RunningServer, clock: object) -> None:
    """A name set with ``iam`` after the hold was taken shows in the dump."""
    a, b = await pair(lock_server)
    await a.reply(b"g x")
    await b.reply(b"g y")
    assert await b.reply(b"iam worker-7") == b"1 ok\r\n"
    await a.reply(b"sg s")
    await b.reply(b"sg s")
    mine = a.peer
    assert await a.listing(b"d") == b"x: %s\r\ny: worker-7\r\nEND\r\n" % mine
    assert await a.listing(b"d y") == b"y: worker-7\r\nEND\r\n"
    assert await a.listing(b"d nothing") == b"END\r\n"
    assert await a.listing(b"sd s") == b"s: %s\r\ns: worker-7\r\nEND\r\n" % mine
    assert await a.listing(b"dump") == await a.listing(b"d")
    assert await a.listing(b"dump shared") == await a.listing(b"sd")
    assert await a.listing(b"dump y") == await a.listing(b"d")  # no keyed dump: all keys


@pytest.mark.parametrize("server_config", [Config()])
async def test_iam_who_me(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    pa, pb = a.peer, b.peer
    assert await a.reply(b"me") == b"1 %s %s\r\n" % (pa, pa)
    assert await a.reply(b"iam  cron  job ") == b"1 ok\r\n"
    assert await a.reply(b"me") == b"1 %s cron job\r\n" % pa
    assert await b.reply(b"iam web") == b"1 ok\r\n"
    listing = await b.listing(b"who")
    assert listing == b"%s: cron job\r\n%s: web\r\nEND\r\n" % (pa, pb)  # naming order
    assert await a.reply(b"iam cron") == b"1 ok\r\n"  # naming again moves it last
    assert await b.listing(b"who") == b"%s: web\r\n%s: cron\r\nEND\r\n" % (pb, pa)
    assert await b.listing(b"who web") == b"%s: web\r\nEND\r\n" % pb
    assert await b.listing(b"who nobody") == b"END\r\n"
    assert await a.reply(b"iam") == b"1 ok\r\n"  # no name: cleared
    assert await a.reply(b"me") == b"1 %s %s\r\n" % (pa, pa)


@pytest.mark.parametrize("server_config", [Config()])
async def test_only_one_cr_before_the_newline_is_dropped(
    lock_server: RunningServer, clock: object
) -> None:
    """A key may end in \\r: send one more (``g a\\r\\r\\n`` locks ``a\\r``)."""
    a, b = await pair(lock_server)
    assert await a.reply(b"g a\r\r") == b"1 Got Lock\r\n"
    assert await b.reply(b"i a\r") == b"0 Not Locked\r\n"  # that is key "a"
    assert await b.reply(b"i a\r\r") == b"1 Locked\r\n"  # and this "a\r"
    assert await a.listing(b"d") == b"a\r: %s\r\nEND\r\n" % a.peer
