"""``throttle``'s one-split parser (:func:`elockd.protocol.word.cmd_throttle_line`)
answers every line byte for byte as the declared arguments do
(:func:`elockd.protocol.word.cmd_throttle`): the same replies, the same state after.

Two in-memory services see the same lines at the same times; one has the table's
``throttle`` (the fast path first), the other the general parser alone.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from elockd.protocol import word
from elockd.protocol.commands import COMMANDS
from elockd.protocol.connection import WORD, Command, Connection, Service
from elockd.protocol.stats import snapshot
from tests.support.sansio import memory_service, waiting, whole

GENERAL = Command(
    b"throttle",
    WORD,
    word.cmd_throttle,
    arguments=3,
    options=word.THROTTLE_OPTIONS,
    wait_reply=word.throttle_line,
)


def general_service() -> Service:
    service = memory_service(max_ttl=3600)
    service.commands = {**COMMANDS, b"throttle": GENERAL}
    return service


def reply_of(conn: Connection, line: bytes, now: float) -> bytes:
    reply = conn.handle(line, now)
    return b"(waits)" if waiting(reply) else whole(reply)


def throttle_throttled(service: Service) -> tuple[int, int, int]:
    values = snapshot(service.backend, service.counters)
    return values["admitted"], values["throttled"], values["throttles"]


ODD_BLANKS = [b"  ", b"\t", b" \t", b"\t ", b"\r", b""]
#: Between tokens: mostly the one space of the fast path's shape.
BLANK = st.sampled_from([b" "] * 6 + ODD_BLANKS)
#: After the last token: mostly nothing.
TRAIL = st.sampled_from([b""] * 6 + [b" "] + ODD_BLANKS)
#: Mostly the fast path's whole numbers (leading zeros too), else anything odd.
WHOLE = st.tuples(st.integers(0, 3), st.integers(0, 4000)).map(lambda z: b"0" * z[0] + b"%d" % z[1])
NUMBER = st.one_of(
    WHOLE,
    WHOLE,
    WHOLE,
    st.sampled_from([b"0", b"0000000000000010", b"3600", b"3601", b"1.5", b".5", b"1e3"]),
    st.sampled_from([b"-1", b"+1", b"", b"99999999999999999999", b"\xd9\xa1"]),
    st.integers(0, 10**30).map(lambda n: b"%d" % n),
    st.binary(min_size=0, max_size=4),
)
KEY = st.one_of(
    st.sampled_from([b"api", b"a=b", b"k\r", b"a\tb", b"k\t", b"", b"\t", b"10"]),
    st.binary(min_size=0, max_size=5).filter(lambda k: b"\n" not in k),
)
OPTION = st.sampled_from(
    [b"burst=5", b"cost=0", b"cost=2", b"wait=1", b"wait=0", b"burst=0", b"x=1", b"cost=20"]
)


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    parts = [draw(KEY), draw(NUMBER), draw(NUMBER)][: draw(st.sampled_from([3, 3, 3, 0, 1, 2]))]
    if draw(st.booleans()):
        parts += draw(st.lists(OPTION, max_size=2))
    return b"".join(part + draw(BLANK) for part in parts[:-1]) + b"".join(
        [*parts[-1:], draw(TRAIL)]
    )


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(lines(), st.binary(max_size=30).filter(lambda b: b"\n" not in b)),
            st.floats(0, 5),
        ),
        min_size=1,
        max_size=12,
    )
)
@example([(b"api 10 60", 0.0)] * 11)
@example([(b"a\tb 10 60", 0.0)])
@example([(b"k\t 1 60", 0.0), (b"k 1 60", 0.0)])
def test_the_fast_path_answers_as_the_declared_arguments_do(
    requests: list[tuple[bytes, float]],
) -> None:
    fast_service, general = memory_service(max_ttl=3600), general_service()
    fast, slow = Connection(fast_service, b"fast"), Connection(general, b"slow")
    now = 0.0
    for rest, step in requests:
        now += step
        line = b"throttle " + rest
        assert reply_of(fast, line, now) == reply_of(slow, line, now), line
        assert throttle_throttled(fast_service) == throttle_throttled(general), line


def test_every_reason_a_throttle_is_refused_for_is_in_the_protocol_doc() -> None:
    """Each ``400`` a bad ``throttle`` gets names a reason docs/protocol.md lists (the
    throttle table's, or the reasons every word verb shares)."""
    doc = " ".join((Path(__file__).parent.parent / "docs" / "protocol.md").read_text().split())
    conn = Connection(memory_service(max_ttl=3600), b"bad")
    bad = [
        b"",
        b"k",
        b"k 10",
        b"k 0 60",
        b"k x 60",
        b"k 10 0",
        b"k 10 1m",
        b"k 10 -1",
        b"k 10 3601",
        b"k 10 60 burst=0",
        b"k 10 60 cost=x",
        b"k 10 60 burst=2 cost=3",
        b"k 10 60 wait=-1",
        b"k 10 60 wait=3601",
        b"k 10 60 bogus=1",
        b"k 10 60 wait=1 wait=2",
        b"k 10 60 wait=1 5",
        b"k 10 60 5",
    ]
    for rest in bad:
        reply = reply_of(conn, b"throttle " + rest, 0.0)
        assert reply.startswith(b"400 Bad Request: "), (rest, reply)
        reason = reply[len(b"400 Bad Request: ") : -2].decode()
        reason = re.sub(r"(unknown option|option) \w+", r"\1 NAME", reason)
        reason = re.sub(r"\(3600 s\)", "(", reason)
        assert f"`{reason}" in doc, (rest, reason)
