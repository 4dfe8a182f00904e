"""Every row of the terse table, both reply styles, through the sans-IO layer."""

from __future__ import annotations

import pytest

from elockd.protocol import Connection, Reply, Service, Streamed
from tests.sansio import memory_service

ELOCKD, GLOCKD = "elockd", "glockd"


def make_service(style: str = ELOCKD, **settings: int) -> Service:
    return memory_service(replies=style, **settings)


def whole(reply: Reply) -> bytes:
    """A streamed reply (dumps, `who`) joined, as the client receives it."""
    assert isinstance(reply, Streamed), reply
    return reply.whole()


def pair(style: str = ELOCKD) -> tuple[Connection, Connection]:
    service = make_service(style)
    return Connection(service, b"10.0.0.1:1111"), Connection(service, b"10.0.0.2:2222")


# (style, request by a, request by b, expected reply to b) after a took the locks below.
ROWS = [
    # g: free / already mine / held by another
    (ELOCKD, b"g free", b"1 Got Lock\r\n"),
    (GLOCKD, b"g free", b"1 Lock Get Success: free\r\n"),
    (ELOCKD, b"g mine", b"1 Got Lock\r\n"),
    (GLOCKD, b"g mine", b"1 Lock Get Success: mine\r\n"),
    (ELOCKD, b"g theirs", b"0 Cannot Get Lock\r\n"),
    (GLOCKD, b"g theirs", b"0 Lock Get Failure: theirs\r\n"),
    # r
    (ELOCKD, b"r mine", b"1 Released Lock\r\n"),
    (GLOCKD, b"r mine", b"1 Lock Release Success: mine\r\n"),
    (ELOCKD, b"r theirs", b"0 Cannot Release Lock\r\n"),
    (GLOCKD, b"r theirs", b"0 Lock Release Failure: theirs\r\n"),
    (ELOCKD, b"r free", b"0 Cannot Release Lock\r\n"),
    # i
    (ELOCKD, b"i theirs", b"1 Locked\r\n"),
    (GLOCKD, b"i theirs", b"1 Lock Is Locked: theirs\r\n"),
    (ELOCKD, b"i free", b"0 Not Locked\r\n"),
    (GLOCKD, b"i free", b"0 Lock Not Locked: free\r\n"),
    # sg: N holders after; a repeat adds no hold
    (ELOCKD, b"sg shared", b"2 Got Lock\r\n"),
    (GLOCKD, b"sg shared", b"2 Shared Lock Get Success: shared\r\n"),
    (ELOCKD, b"sg myshared", b"1 Got Lock\r\n"),
    (GLOCKD, b"sg myshared", b"1 Shared Lock Get Success: myshared\r\n"),
    # sr
    (ELOCKD, b"sr myshared", b"1 Released Lock\r\n"),
    (GLOCKD, b"sr myshared", b"1 Shared Lock Release Success: myshared\r\n"),
    (ELOCKD, b"sr shared", b"0 Cannot Release Lock\r\n"),
    (GLOCKD, b"sr shared", b"0 Shared Lock Release Failure: shared\r\n"),
    # si: anyone may ask
    (ELOCKD, b"si shared", b"1 Locked\r\n"),
    (GLOCKD, b"si shared", b"1 Shared Lock Is Locked: shared\r\n"),
    (ELOCKD, b"si free", b"0 Not Locked\r\n"),
    (GLOCKD, b"si free", b"0 Shared Lock Not Locked: free\r\n"),
]


@pytest.mark.parametrize(("style", "request_line", "expected"), ROWS)
def test_terse_table(style: str, request_line: bytes, expected: bytes) -> None:
    a, b = pair(style)
    # a holds "theirs" exclusively and "shared" shared; b holds "mine" and "myshared".
    assert a.handle(b"g theirs", 0.0)[:1] == b"1"
    assert a.handle(b"sg shared", 0.0)[:1] == b"1"
    assert b.handle(b"g mine", 0.0)[:1] == b"1"
    assert b.handle(b"sg myshared", 0.0)[:1] == b"1"
    assert b.handle(request_line, 0.0) == expected


def test_repeated_get_keeps_one_hold() -> None:
    a, b = pair()
    assert a.handle(b"g k", 0.0) == b"1 Got Lock\r\n"
    assert a.handle(b"g k", 0.0) == b"1 Got Lock\r\n"
    assert a.handle(b"r k", 0.0) == b"1 Released Lock\r\n"
    assert b.handle(b"g k", 0.0) == b"1 Got Lock\r\n"


def test_shared_counts_and_repeat_by_holder() -> None:
    a, b = pair()
    assert a.handle(b"sg k", 0.0) == b"1 Got Lock\r\n"
    assert a.handle(b"sg k", 0.0) == b"1 Got Lock\r\n"
    assert b.handle(b"sg k", 0.0) == b"2 Got Lock\r\n"
    assert b.handle(b"si k", 0.0) == b"2 Locked\r\n"
    assert a.handle(b"sr k", 0.0) == b"1 Released Lock\r\n"
    assert a.handle(b"si k", 0.0) == b"1 Locked\r\n"


def test_exclusive_and_shared_tables_are_separate() -> None:
    a, b = pair()
    assert a.handle(b"g k", 0.0) == b"1 Got Lock\r\n"
    assert b.handle(b"sg k", 0.0) == b"1 Got Lock\r\n"
    assert b.handle(b"i k", 0.0) == b"1 Locked\r\n"
    assert a.handle(b"si k", 0.0) == b"1 Locked\r\n"


@pytest.mark.parametrize(
    ("line", "key_line"),
    [
        (b"g  a   b ", b"a b"),
        (b"g\ta\t\tb", b"a b"),
        (b"  g a b  \r", b"a b"),
        (b"g", b""),
        (b"g   ", b""),
    ],
)
def test_terse_key_normalisation(line: bytes, key_line: bytes) -> None:
    a, _ = pair(GLOCKD)
    assert a.handle(line, 0.0) == b"1 Lock Get Success: " + key_line + b"\r\n"


def test_only_one_trailing_cr_is_dropped() -> None:
    a, _ = pair(GLOCKD)
    assert a.handle(b"g a\r\r", 0.0) == b"1 Lock Get Success: a\r\r\n"


def test_binary_keys_are_never_decoded() -> None:
    a, b = pair(GLOCKD)
    key = bytes(range(0x80, 0x100)) + b"\x00\x01\rz"
    assert a.handle(b"g " + key, 0.0) == b"1 Lock Get Success: " + key + b"\r\n"
    assert b.handle(b"g " + key, 0.0) == b"0 Lock Get Failure: " + key + b"\r\n"


def test_verbs_are_case_sensitive() -> None:
    a, _ = pair()
    assert a.handle(b"G k", 0.0) == b"0 Invalid Command: G\r\n"


def test_unknown_verb_and_empty_line() -> None:
    service = make_service()
    a = Connection(service, b"x:1")
    assert a.handle(b"nope k", 0.0) == b"0 Invalid Command: nope\r\n"
    assert a.handle(b"", 0.0) == b"0 Invalid Command: \r\n"
    assert a.handle(b" \t ", 0.0) == b"0 Invalid Command: \r\n"
    assert a.handle(b"v" * 100, 0.0) == b"0 Invalid Command: " + b"v" * 64 + b"\r\n"
    assert service.counters.invalid_commands == 4


def test_too_long_marker_is_answered_and_counted() -> None:
    service = make_service()
    a = Connection(service, b"x:1")
    assert a.handle(None, 0.0) == b"0 Line Too Long\r\n"
    assert service.counters.invalid_commands == 1


def parse_q(reply: bytes) -> dict[str, int]:
    lines = reply.split(b"\r\n")
    assert lines[-2:] == [b"END", b""]
    values = {}
    for line in lines[:-2]:
        name, _, value = line.decode().partition(": ")
        values[name] = int(value)
    return values


def test_q_lists_every_counter_sorted() -> None:
    a, b = pair()
    a.handle(b"g k", 0.0)
    b.handle(b"sg k", 0.0)
    b.handle(b"sg j", 0.0)
    b.handle(b"ping", 0.0)
    values = parse_q(a.handle(b"q", 0.0))
    assert list(values) == sorted(values)
    always = (
        "command_d command_dump command_g command_i command_q command_r command_sd "
        "command_sg command_si command_sr connections invalid_commands locks orphans "
        "shared_locks shared_orphans expired leases sessions timeouts waiting"
    ).split()
    assert set(always) <= set(values)
    assert values["command_g"] == 1
    assert values["command_sg"] == 2
    assert values["command_q"] == 1  # a q counts itself
    assert values["command_ping"] == 1  # other verbs appear once used
    assert "command_lock" not in values
    assert values["locks"] == 1
    assert values["shared_locks"] == 2  # keys, not holders
    assert values["connections"] == 2


def test_disconnect_frees_and_counts_orphans() -> None:
    a, b = pair()
    a.handle(b"g x", 0.0)
    a.handle(b"g y", 0.0)
    a.handle(b"sg s", 0.0)
    a.close(1.0)
    values = parse_q(b.handle(b"q", 1.0))
    assert values["orphans"] == 2
    assert values["shared_orphans"] == 1
    assert values["locks"] == 0
    assert values["connections"] == 1
    assert b.handle(b"g x", 1.0) == b"1 Got Lock\r\n"


def test_dump_lists_holders_by_owner() -> None:
    a, b = pair()
    a.handle(b"g x", 0.0)
    b.handle(b"g y", 0.0)
    b.handle(b"iam worker-7", 0.0)
    a.handle(b"sg s", 0.0)
    b.handle(b"sg s", 0.0)
    assert whole(a.handle(b"d", 0.0)) == b"x: 10.0.0.1:1111\r\ny: worker-7\r\nEND\r\n"
    assert whole(a.handle(b"d y", 0.0)) == b"y: worker-7\r\nEND\r\n"
    assert whole(a.handle(b"d nothing", 0.0)) == b"END\r\n"
    assert whole(a.handle(b"sd s", 0.0)) == b"s: 10.0.0.1:1111\r\ns: worker-7\r\nEND\r\n"
    assert whole(a.handle(b"dump", 0.0)) == whole(a.handle(b"d", 0.0))
    assert whole(a.handle(b"dump shared", 0.0)) == whole(a.handle(b"sd", 0.0))
    assert whole(a.handle(b"dump y", 0.0)) == whole(a.handle(b"d", 0.0))  # no keyed dump: all keys


def test_iam_who_me() -> None:
    a, b = pair()
    assert a.handle(b"me", 0.0) == b"1 10.0.0.1:1111 10.0.0.1:1111\r\n"
    assert a.handle(b"iam  cron  job ", 0.0) == b"1 ok\r\n"
    assert a.handle(b"me", 0.0) == b"1 10.0.0.1:1111 cron job\r\n"
    assert b.handle(b"iam web", 0.0) == b"1 ok\r\n"
    listing = whole(b.handle(b"who", 0.0))
    assert listing == b"10.0.0.1:1111: cron job\r\n10.0.0.2:2222: web\r\nEND\r\n"  # naming order
    assert a.handle(b"iam cron", 0.0) == b"1 ok\r\n"  # naming again moves it last
    assert whole(b.handle(b"who", 0.0)) == b"10.0.0.2:2222: web\r\n10.0.0.1:1111: cron\r\nEND\r\n"
    assert whole(b.handle(b"who web", 0.0)) == b"10.0.0.2:2222: web\r\nEND\r\n"
    assert whole(b.handle(b"who nobody", 0.0)) == b"END\r\n"
    assert a.handle(b"iam", 0.0) == b"1 ok\r\n"  # no name: cleared
    assert a.handle(b"me", 0.0) == b"1 10.0.0.1:1111 10.0.0.1:1111\r\n"


def test_only_one_cr_before_the_newline_is_dropped() -> None:
    """A key may end in \\r: send one more (``g a\\r\\r\\n`` locks ``a\\r``)."""
    a, b = pair()
    assert a.handle(b"g a\r\r", 0.0) == b"1 Got Lock\r\n"  # LineReader gives lines without \n
    assert b.handle(b"i a\r", 0.0) == b"0 Not Locked\r\n"  # that is key "a"
    assert b.handle(b"i a\r\r", 0.0) == b"1 Locked\r\n"  # and this "a\r"
    assert whole(a.handle(b"d", 0.0)) == b"a\r: 10.0.0.1:1111\r\nEND\r\n"
