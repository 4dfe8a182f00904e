"""Every row of the word table, and every bad argument, on both backends (the
in-memory server and a cluster node on a real etcd): one contract, byte for byte.

In memory the test runs on a MockClock, so waits and leases are exact; on a
cluster node it runs in real time, so durations are short and read with a margin.
"""

from __future__ import annotations

import re

import pytest
import trio

from elockd.protocol.config import Config
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import eventually, resumed, stats_showing, until_waiting


async def pair(server: RunningServer) -> tuple[LineClient, LineClient]:
    return await server.connect(), await server.connect()


def seconds_left(info: bytes) -> float:
    match = re.search(rb" ttl=([0-9.]+) ", info)
    assert match, info
    return float(match.group(1))


async def test_lock_unlock_and_the_shared_table_of_g(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"lock k") == b"200 Acquired\r\n"
    assert await a.reply(b"lock k") == b"200 Acquired\r\n"  # a repeat: no second hold
    assert await b.reply(b"lock k") == b"409 Unavailable\r\n"
    assert await b.reply(b"lock k 0") == b"409 Unavailable\r\n"  # WAIT 0: try once
    assert await b.reply(b"g k") == b"0 Cannot Get Lock\r\n"
    assert await b.reply(b"unlock k") == b"403 Not Locked\r\n"
    assert await a.reply(b"unlock k") == b"200 Unlocked\r\n"
    assert await a.reply(b"unlock k") == b"403 Not Locked\r\n"
    assert await b.reply(b"g t") == b"1 Got Lock\r\n"
    assert await b.reply(b"unlock t") == b"200 Unlocked\r\n"  # unlock frees a g hold


async def test_a_waiting_lock_is_granted_when_the_holder_lets_go(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"lock k") == b"200 Acquired\r\n"
    await b.send(b"lock k 30\n")
    await until_waiting(a, b"k")
    assert await a.reply(b"unlock k") == b"200 Unlocked\r\n"
    assert await b.line() == b"200 Acquired\r\n"


async def test_a_wait_that_ends_ungranted_is_a_timeout_and_can_never_be_granted(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"lock k") == b"200 Acquired\r\n"
    started = trio.current_time()
    assert await b.reply(b"lock k 0.5") == b"409 Unavailable\r\n"
    assert trio.current_time() - started >= 0.5
    assert await a.reply(b"unlock k") == b"200 Unlocked\r\n"
    assert (await b.reply(b"info k")).startswith(b"200 key=k exclusive=- ")
    assert (await a.stats())["timeouts"] == 1


async def test_unlock_all_frees_both_tables(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    await a.reply(b"lock x")
    await a.reply(b"lock_shared s")
    assert await a.reply(b"unlock_all") == b"200 OK\r\n"
    assert await b.reply(b"lock x") == b"200 Acquired\r\n"
    assert await b.reply(b"si s") == b"0 Not Locked\r\n"


async def test_conn_id_is_128_random_bits_in_hex(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    first = await a.reply(b"conn_id")
    assert re.fullmatch(rb"200 [0-9a-f]{32}\r\n", first)
    assert await a.reply(b"conn_id") == first
    assert await b.reply(b"conn_id") != first


async def test_conn_id_takeover_rules(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"set_timeout 30000") == b"200 timeout set\r\n"
    assert await a.reply(b"lock k") == b"200 Acquired\r\n"
    session_id = (await a.reply(b"conn_id"))[4:-2]
    assert await b.reply(b"conn_id " + session_id) == b"403 cannot set conn id\r\n"  # connected
    await a.aclose()
    await b.reply(b"lock mine")
    assert await b.reply(b"conn_id " + session_id) == b"403 cannot set conn id\r\n"  # b holds
    await b.reply(b"unlock mine")
    await eventually(lambda: resumed(b, session_id))  # once the server has seen a go
    assert await b.reply(b"conn_id") == b"200 " + session_id + b"\r\n"
    assert await b.reply(b"unlock k") == b"200 Unlocked\r\n"
    assert (await b.stats())["orphans"] == 0
    c = await lock_server.connect()
    assert await c.reply(b"conn_id nosuchsession") == b"403 cannot set conn id\r\n"


async def test_set_timeout_and_quit(lock_server: RunningServer, clock: object) -> None:
    a = await lock_server.connect()
    assert await a.reply(b"set_timeout 1500") == b"200 timeout set\r\n"
    assert await a.reply(b"quit") == b"200 Bye\r\n"
    assert await a.at_eof()


async def test_stats_lists_elock_names_first_then_every_q_counter_once(
    lock_server: RunningServer, clock: object
) -> None:
    a, _ = await pair(lock_server)
    await a.reply(b"lock k")
    await eventually(lambda: stats_showing(a, locks=1), what="the lock counted")
    lines = (await a.listing(b"stats")).split(b"\r\n")
    assert lines[0] == b"200 STATS"
    assert lines[1:4] == [b"STAT clients 2", b"STAT locks 1", b"STAT monitoring 2"]
    assert lines[-2:] == [b"END", b""]
    names = [line.split()[1] for line in lines[1:-2]]
    assert len(names) == len(set(names))
    q_names = {name.encode() for name in await a.stats()}
    assert q_names - {b"command_q"} <= set(names)
    for extra in (b"waiting", b"leases", b"expired", b"timeouts", b"sessions"):
        assert extra in names


async def test_lock_shared_counts_limits_and_repeats(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    c = await lock_server.connect()
    assert await a.reply(b"lock_shared s") == b"200 1\r\n"
    assert await a.reply(b"lock_shared s") == b"200 1\r\n"
    assert await b.reply(b"lock_shared s limit=2") == b"200 2\r\n"
    assert await c.reply(b"lock_shared s limit=2") == b"409 2\r\n"
    assert await c.reply(b"sg s") == b"3 Got Lock\r\n"  # sg has no limit of its own
    assert await b.reply(b"unlock_shared s") == b"200 2\r\n"
    assert await b.reply(b"unlock_shared s") == b"403 Not Locked\r\n"
    assert await b.reply(b"lock_shared s 5") == b"200 3\r\n"  # WAIT without limit: never waits


async def test_unlock_shared_reports_holders_after_a_hand_over(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"lock_shared s limit=1") == b"200 1\r\n"
    await b.send(b"lock_shared s 30 limit=1\n")
    await until_waiting(a, b"s")
    assert await a.reply(b"unlock_shared s") == b"200 1\r\n"  # b got it in the same step
    assert await b.line() == b"200 1\r\n"


async def test_mlock_all_or_nothing_names_keys_held_by_others(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    await b.reply(b"lock y")
    await b.reply(b"lock z")
    assert await a.reply(b"mlock x y z") == b"409 Unavailable y z\r\n"
    assert (await a.reply(b"info x")).startswith(b"200 key=x exclusive=- ")
    await b.reply(b"unlock_all")
    assert await a.reply(b"mlock x y z ttl=5") == b"200 Acquired\r\n"
    await trio.sleep(1)
    info = await b.reply(b"info y")
    assert re.fullmatch(
        rb"200 key=y exclusive=%s shared=0 waiting=0 ttl=[0-9.]+ token=\d+\r\n" % a.peer, info
    )
    assert 3.5 <= seconds_left(info) <= 4.0


@pytest.mark.parametrize("server_config", [Config(max_keys=3)])
async def test_mlock_key_limit(lock_server: RunningServer, clock: object) -> None:
    a = await lock_server.connect()
    assert await a.reply(b"mlock a b c") == b"200 Acquired\r\n"
    assert await a.reply(b"mlock a b c d") == b"413 Too Many Keys\r\n"
    assert await a.reply(b"mlock a a b b c c") == b"200 Acquired\r\n"  # distinct keys count


async def test_renew_token_info_ping(lock_server: RunningServer, clock: object) -> None:
    a, b = await pair(lock_server)
    await a.reply(b"lock k")
    await a.reply(b"sg s")
    assert await a.reply(b"renew k ttl=2") == b"200 Renewed\r\n"
    assert await a.reply(b"renew s ttl=2") == b"200 Renewed\r\n"  # shared hold, else
    assert await b.reply(b"renew k ttl=2") == b"403 Not Locked\r\n"
    token = await a.reply(b"token k")
    assert re.fullmatch(rb"200 [1-9][0-9]*\r\n", token)
    assert await a.reply(b"token s") == b"403 Not Locked\r\n"
    assert await b.reply(b"token k") == b"403 Not Locked\r\n"
    await trio.sleep(0.5)
    info = await b.reply(b"info k")
    assert info.startswith(b"200 key=k exclusive=%s shared=0 waiting=0 ttl=" % a.peer)
    assert info.endswith(b" token=%s" % token[4:])
    assert 1.0 <= seconds_left(info) <= 1.5
    assert await a.reply(b"iam builder") == b"1 ok\r\n"
    assert await b.reply(b"info s") == b"200 key=s exclusive=- shared=1 waiting=0 ttl=- token=-\r\n"
    assert (await b.reply(b"info k")).startswith(b"200 key=k exclusive=builder ")
    assert await b.reply(b"ping") == b"200 PONG\r\n"


async def test_tokens_increase_over_every_grant(lock_server: RunningServer, clock: object) -> None:
    """Across keys and sessions, and across the keys of one mlock."""
    a, b = await pair(lock_server)
    seen = []
    for i in range(5):
        client = a if i % 2 else b
        assert await client.reply(b"g k%d" % i) == b"1 Got Lock\r\n"
        seen.append(int((await client.reply(b"token k%d" % i))[4:-2]))
    assert await a.reply(b"mlock m1 m2 m3") == b"200 Acquired\r\n"
    for key in (b"m1", b"m2", b"m3"):
        seen.append(int((await a.reply(b"token " + key))[4:-2]))
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen


BAD_REQUESTS = [
    (b"lock", b"missing key"),
    (b"lock k soon", b"WAIT must be a non-negative number"),
    (b"lock k -1", b"WAIT must be a non-negative number"),
    (b"lock k 1 2", b"too many arguments"),
    (b"lock k ttl=0", b"ttl must be above 0"),
    (b"lock k ttl=x", b"ttl must be a non-negative number"),
    (b"lock k color=red", b"unknown option color"),
    (b"lock k ttl=1 ttl=2", b"option ttl given twice"),
    (b"lock k ttl=1 5", b"options must follow the arguments"),
    (b"unlock", b"missing key"),
    (b"unlock_all now", b"too many arguments"),
    (b"set_timeout", b"missing MS"),
    (b"set_timeout soon", b"MS must be a non-negative number"),
    (b"lock_shared", b"missing key"),
    (b"lock_shared s limit=0", b"limit must be a whole number above 0"),
    (b"lock_shared s limit=1.5", b"limit must be a whole number above 0"),
    (b"lock_shared s limit=-2", b"limit must be a whole number above 0"),
    (b"unlock_shared", b"missing key"),
    (b"mlock", b"missing key"),
    (b"mlock a b wait=x", b"wait must be a non-negative number"),
    (b"mlock a b limit=2", b"unknown option limit"),
    (b"mlock a b=c", b"unknown option b"),  # after the first key, '=' marks an option
    (b"renew k", b"missing ttl"),
    (b"renew", b"missing key"),
    (b"renew k ttl=-1", b"ttl must be a non-negative number"),
    (b"token", b"missing key"),
    (b"info", b"missing key"),
    # Numbers that are not finite, and durations above --max-ttl (default 86400 s).
    (b"lock k inf", b"WAIT must be a non-negative number"),
    (b"lock k nan", b"WAIT must be a non-negative number"),
    (b"lock k 1e400", b"WAIT must be a non-negative number"),
    (b"lock k " + b"9" * 400, b"WAIT is too large"),
    (b"lock k 86400.5", b"WAIT above --max-ttl (86400 s)"),
    (b"lock k ttl=" + b"9" * 400, b"ttl is too large"),
    (b"lock k ttl=inf", b"ttl must be a non-negative number"),
    (b"lock k ttl=86401", b"ttl above --max-ttl (86400 s)"),
    (b"lock_shared s 90000 limit=2", b"WAIT above --max-ttl (86400 s)"),
    (b"lock_shared s ttl=1e400", b"ttl must be a non-negative number"),
    (b"mlock a b wait=" + b"9" * 400, b"wait is too large"),
    (b"mlock a b wait=86401", b"wait above --max-ttl (86400 s)"),
    (b"mlock a b ttl=nan", b"ttl must be a non-negative number"),
    (b"renew k ttl=" + b"9" * 400, b"ttl is too large"),
    (b"renew k ttl=100000", b"ttl above --max-ttl (86400 s)"),
    (b"set_timeout inf", b"MS must be a non-negative number"),
    (b"set_timeout 1e400", b"MS must be a non-negative number"),
    (b"set_timeout " + b"9" * 400, b"MS is too large"),
    (b"set_timeout 999999999999", b"MS above --max-ttl (86400 s)"),
]


async def test_bad_arguments_get_400_and_change_nothing(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"lock k") == b"200 Acquired\r\n"
    assert await a.reply(b"lock_shared s") == b"200 1\r\n"
    await eventually(lambda: stats_showing(a, locks=1, shared_locks=1), what="the holds counted")
    holds = await a.listing(b"d"), await a.listing(b"sd")
    for request_line, reason in BAD_REQUESTS:
        before = await a.stats()
        assert await a.reply(request_line) == b"400 Bad Request: " + reason + b"\r\n"
        after = await a.stats()
        verb = "command_" + request_line.split()[0].decode()
        before[verb] = before.get(verb, 0) + 1  # it still counts
        before["command_q"] += 1  # and so does the q that read it
        assert after == before, request_line
    assert (await a.listing(b"d"), await a.listing(b"sd")) == holds
    assert await b.reply(b"lock k") == b"409 Unavailable\r\n"


@pytest.mark.parametrize("server_config", [Config(max_waiters=1)])
async def test_waiter_limit_gets_413_and_changes_nothing(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    c = await lock_server.connect()
    assert await a.reply(b"lock k") == b"200 Acquired\r\n"
    await b.send(b"lock k 30\n")
    await until_waiting(a, b"k")
    assert await c.reply(b"lock k 30") == b"413 Too Many Waiters\r\n"
    assert (await a.stats())["waiting"] == 1


@pytest.mark.parametrize("server_config", [Config(max_ttl=10.0)])
async def test_max_ttl_is_a_flag_and_its_bound_itself_is_allowed(
    lock_server: RunningServer, clock: object
) -> None:
    a, b = await pair(lock_server)
    assert await a.reply(b"lock k ttl=10") == b"200 Acquired\r\n"
    assert await a.reply(b"renew k ttl=10.001") == (
        b"400 Bad Request: ttl above --max-ttl (10 s)\r\n"
    )
    assert await a.reply(b"set_timeout 10000") == b"200 timeout set\r\n"
    assert (await a.reply(b"set_timeout 10001")).startswith(b"400 Bad Request: MS above")
    await b.send(b"lock k 10\n")
    await until_waiting(a, b"k")
