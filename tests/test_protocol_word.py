"""Every row of the word table through the sans-IO layer, and every bad argument."""

from __future__ import annotations

import re

import pytest

from elockd.protocol import Connection, Service
from tests.sansio import memory_service, waiting, whole


def make_service(**settings: object) -> Service:
    return memory_service(**settings)


def pair(**settings: object) -> tuple[Connection, Connection]:
    service = make_service(**settings)
    return Connection(service, b"10.0.0.1:1111"), Connection(service, b"10.0.0.2:2222")


def test_lock_unlock_and_the_shared_table_of_g() -> None:
    a, b = pair()
    assert a.handle(b"lock k", 0.0) == b"200 Acquired\r\n"
    assert a.handle(b"lock k", 0.0) == b"200 Acquired\r\n"  # a repeat: no second hold
    assert b.handle(b"lock k", 0.0) == b"409 Unavailable\r\n"
    assert b.handle(b"lock k 0", 0.0) == b"409 Unavailable\r\n"  # WAIT 0: try once
    assert b.handle(b"g k", 0.0) == b"0 Cannot Get Lock\r\n"
    assert b.handle(b"unlock k", 0.0) == b"403 Not Locked\r\n"
    assert a.handle(b"unlock k", 0.0) == b"200 Unlocked\r\n"
    assert a.handle(b"unlock k", 0.0) == b"403 Not Locked\r\n"
    assert b.handle(b"g t", 0.0) == b"1 Got Lock\r\n"
    assert b.handle(b"unlock t", 0.0) == b"200 Unlocked\r\n"  # unlock frees a g hold


def test_lock_with_wait_returns_a_pending_request() -> None:
    a, b = pair()
    a.handle(b"lock k", 0.0)
    pending = b.handle(b"lock k 2.5", 0.0)
    assert waiting(pending)
    a.handle(b"unlock k", 1.0)
    assert whole(pending) == b"200 Acquired\r\n"


def test_a_wait_that_ends_ungranted_is_a_timeout_and_can_never_be_granted() -> None:
    a, b = pair()
    a.handle(b"lock k", 0.0)
    pending = b.handle(b"lock k 1", 0.0)
    assert waiting(pending)
    a.service.backend.advance(1.0)  # the engine times the wait out
    assert whole(pending) == b"409 Unavailable\r\n"
    a.handle(b"unlock k", 2.0)
    assert b.handle(b"info k", 2.0).startswith(b"200 key=k exclusive=- ")
    assert a.service.snapshot()["timeouts"] == 1


def test_unlock_all_frees_both_tables() -> None:
    a, b = pair()
    a.handle(b"lock x", 0.0)
    a.handle(b"lock_shared s", 0.0)
    assert a.handle(b"unlock_all", 0.0) == b"200 OK\r\n"
    assert b.handle(b"lock x", 0.0) == b"200 Acquired\r\n"
    assert b.handle(b"si s", 0.0) == b"0 Not Locked\r\n"


def test_conn_id_is_128_random_bits_in_hex() -> None:
    a, b = pair()
    first = a.handle(b"conn_id", 0.0)
    assert re.fullmatch(rb"200 [0-9a-f]{32}\r\n", first)
    assert a.handle(b"conn_id", 0.0) == first
    assert b.handle(b"conn_id", 0.0) != first


def test_conn_id_takeover_rules() -> None:
    a, b = pair()
    service = a.service
    a.handle(b"set_timeout 5000", 0.0)
    a.handle(b"lock k", 0.0)
    session_id = a.handle(b"conn_id", 0.0)[4:-2]
    assert b.handle(b"conn_id " + session_id, 0.0) == b"403 cannot set conn id\r\n"  # connected
    a.close(1.0)
    b.handle(b"lock mine", 1.0)
    assert b.handle(b"conn_id " + session_id, 1.0) == b"403 cannot set conn id\r\n"  # b holds
    b.handle(b"unlock mine", 1.0)
    assert b.handle(b"conn_id " + session_id, 1.0) == b"200 conn id set\r\n"
    assert b.handle(b"conn_id", 1.0) == b"200 " + session_id + b"\r\n"
    assert b.handle(b"unlock k", 1.0) == b"200 Unlocked\r\n"
    assert service.snapshot()["orphans"] == 0
    c = Connection(service, b"10.0.0.3:3")
    assert c.handle(b"conn_id nosuchsession", 1.0) == b"403 cannot set conn id\r\n"


def test_set_timeout_and_quit() -> None:
    a, _ = pair()
    assert a.handle(b"set_timeout 1500", 0.0) == b"200 timeout set\r\n"
    assert a.session.grace == 1.5
    assert a.handle(b"quit", 0.0) == b"200 Bye\r\n"
    assert a.closing


def test_stats_lists_elock_names_first_then_every_q_counter_once() -> None:
    a, _ = pair()
    a.handle(b"lock k", 0.0)
    lines = a.handle(b"stats", 0.0).split(b"\r\n")
    assert lines[0] == b"200 STATS"
    assert lines[1:4] == [b"STAT clients 2", b"STAT locks 1", b"STAT monitoring 2"]
    assert lines[-2:] == [b"END", b""]
    names = [line.split()[1] for line in lines[1:-2]]
    assert len(names) == len(set(names))
    q_names = {name.encode() for name in a.service.snapshot()}
    assert q_names <= set(names)
    for extra in (b"waiting", b"leases", b"expired", b"timeouts", b"sessions"):
        assert extra in names


def test_lock_shared_counts_limits_and_repeats() -> None:
    a, b = pair()
    c = Connection(a.service, b"10.0.0.3:3")
    assert a.handle(b"lock_shared s", 0.0) == b"200 1\r\n"
    assert a.handle(b"lock_shared s", 0.0) == b"200 1\r\n"
    assert b.handle(b"lock_shared s limit=2", 0.0) == b"200 2\r\n"
    assert c.handle(b"lock_shared s limit=2", 0.0) == b"409 2\r\n"
    assert c.handle(b"sg s", 0.0) == b"3 Got Lock\r\n"  # sg has no limit of its own
    assert b.handle(b"unlock_shared s", 0.0) == b"200 2\r\n"
    assert b.handle(b"unlock_shared s", 0.0) == b"403 Not Locked\r\n"
    assert b.handle(b"lock_shared s 5", 0.0) == b"200 3\r\n"  # WAIT without limit: never waits


def test_unlock_shared_reports_holders_after_a_hand_over() -> None:
    a, b = pair()
    a.handle(b"lock_shared s limit=1", 0.0)
    pending = b.handle(b"lock_shared s 10 limit=1", 0.0)
    assert waiting(pending)
    assert a.handle(b"unlock_shared s", 1.0) == b"200 1\r\n"  # b got it in the same step
    assert whole(pending) == b"200 1\r\n"


def test_mlock_all_or_nothing_names_keys_held_by_others() -> None:
    a, b = pair()
    b.handle(b"lock y", 0.0)
    b.handle(b"lock z", 0.0)
    assert a.handle(b"mlock x y z", 0.0) == b"409 Unavailable y z\r\n"
    assert a.handle(b"info x", 0.0).startswith(b"200 key=x exclusive=- ")
    b.handle(b"unlock_all", 0.0)
    assert a.handle(b"mlock x y z ttl=5", 0.0) == b"200 Acquired\r\n"
    assert re.fullmatch(
        rb"200 key=y exclusive=10.0.0.1:1111 shared=0 waiting=0 ttl=4.000 token=\d+\r\n",
        b.handle(b"info y", 1.0),
    )


def test_mlock_key_limit() -> None:
    a, _ = pair(max_keys=3)
    assert a.handle(b"mlock a b c", 0.0) == b"200 Acquired\r\n"
    assert a.handle(b"mlock a b c d", 0.0) == b"413 Too Many Keys\r\n"
    assert a.handle(b"mlock a a b b c c", 0.0) == b"200 Acquired\r\n"  # distinct keys count


def test_renew_token_info_ping() -> None:
    a, b = pair()
    a.handle(b"lock k", 0.0)
    a.handle(b"sg s", 0.0)
    assert a.handle(b"renew k ttl=2", 0.0) == b"200 Renewed\r\n"
    assert a.handle(b"renew s ttl=2", 0.0) == b"200 Renewed\r\n"  # shared hold, else
    assert b.handle(b"renew k ttl=2", 0.0) == b"403 Not Locked\r\n"
    assert a.handle(b"token k", 0.0) == b"200 100\r\n"
    assert a.handle(b"token s", 0.0) == b"403 Not Locked\r\n"
    assert b.handle(b"token k", 0.0) == b"403 Not Locked\r\n"
    assert b.handle(b"info k", 0.5) == (
        b"200 key=k exclusive=10.0.0.1:1111 shared=0 waiting=0 ttl=1.500 token=100\r\n"
    )
    a.handle(b"iam builder", 0.5)
    assert b.handle(b"info s", 0.5) == (
        b"200 key=s exclusive=- shared=1 waiting=0 ttl=- token=-\r\n"
    )
    assert b.handle(b"info k", 0.5).startswith(b"200 key=k exclusive=builder ")
    assert b.handle(b"ping", 0.0) == b"200 PONG\r\n"


def test_tokens_increase_over_every_grant() -> None:
    a, b = pair()
    seen = []
    for i in range(5):
        conn = a if i % 2 else b
        conn.handle(b"g k%d" % i, 0.0)
        seen.append(int(conn.handle(b"token k%d" % i, 0.0)[4:-2]))
    assert seen == sorted(seen) and len(set(seen)) == 5


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


@pytest.mark.parametrize(("request_line", "reason"), BAD_REQUESTS)
def test_bad_arguments_get_400_and_change_nothing(request_line: bytes, reason: bytes) -> None:
    a, b = pair()
    a.handle(b"lock k", 0.0)
    a.handle(b"lock_shared s", 0.0)
    before = (a.service.snapshot(), sorted(a.session.exclusive), sorted(a.session.shared))
    assert a.handle(request_line, 0.0) == b"400 Bad Request: " + reason + b"\r\n"
    after = (a.service.snapshot(), sorted(a.session.exclusive), sorted(a.session.shared))
    verb = request_line.split()[0].decode()
    before[0]["command_" + verb] = before[0].get("command_" + verb, 0) + 1  # it still counts
    assert after == before
    assert b.handle(b"lock k", 0.0) == b"409 Unavailable\r\n"


def test_waiter_limit_gets_413_and_changes_nothing() -> None:
    a, b = pair(max_waiters=1)
    c = Connection(a.service, b"10.0.0.3:3")
    a.handle(b"lock k", 0.0)
    assert waiting(b.handle(b"lock k 5", 0.0))
    assert c.handle(b"lock k 5", 0.0) == b"413 Too Many Waiters\r\n"
    assert a.service.snapshot()["waiting"] == 1


def test_max_ttl_is_a_flag_and_its_bound_itself_is_allowed() -> None:
    a, b = pair(max_ttl=10.0)
    assert a.handle(b"lock k ttl=10", 0.0) == b"200 Acquired\r\n"
    assert (
        a.handle(b"renew k ttl=10.001", 0.0) == b"400 Bad Request: ttl above --max-ttl (10 s)\r\n"
    )
    assert a.handle(b"set_timeout 10000", 0.0) == b"200 timeout set\r\n"
    assert a.handle(b"set_timeout 10001", 0.0).startswith(b"400 Bad Request: MS above")
    assert waiting(b.handle(b"lock k 10", 0.0))
