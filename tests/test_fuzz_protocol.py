"""Hypothesis fuzz of the request path: bytes in, replies out, engine still sound.

The server's per-connection loop is thin: bytes go through
:class:`elockd.protocol.framing.LineReader`, each line through
:meth:`elockd.protocol.connection.Connection.handle`, and an
:class:`~elockd.protocol.connection.Outcome` is awaited until granted or timed out.
This test plays that loop without sockets, for several connections at once, with
arbitrary bytes and with plausible requests of both families (valid, malformed,
over-long), random chunking, time passing and disconnects. Whatever comes in:

* no exception escapes (in the server one would end the whole process);
* every line gets exactly one reply, in order (``0 Line Too Long`` for an over-long
  one), a reply is one ``\\r\\n`` line unless it is a multi-line ``END`` reply;
* the engine's tables stay consistent: one exclusive holder per key, shared counts
  and per-session views agree, lease and waiter counts match, no queue on a free key.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elockd.engine.sessions import WAITING
from elockd.protocol.config import Config
from elockd.protocol.connection import LINE_TOO_LONG, Connection, Outcome
from elockd.protocol.framing import LineReader
from tests.support.sansio import memory_service, waiting, whole

MULTI_LINE_VERBS = {b"q", b"d", b"sd", b"dump", b"who", b"stats"}
#: glockd's dialect: listings without END, and silent when they match nothing.
GLOCKD_LISTINGS = {b"q", b"d", b"sd", b"dump", b"who"}
GLOCKD_SILENT_WHEN_EMPTY = {b"d", b"sd", b"who"}
VERBS = [
    *(b"g r i sg sr si q d sd dump iam who me".split()),
    *(b"lock unlock unlock_all conn_id set_timeout stats quit".split()),
    *(b"lock_shared unlock_shared mlock renew token info ping auth".split()),
    b"G",
    b"nope",
    b"",
]
KEYS = [b"a", b"b", b"c", b"a b", b"\xff\x00", b"END"]
ARGS = [
    *KEYS,
    b"0",
    b"0.5",
    b"2",
    b".25",
    b"-1",
    b"1e3",
    b"nan",
    b"9" * 30,
    b"ttl=1",
    b"ttl=0",
    b"ttl=0.5",
    b"ttl=x",
    b"limit=1",
    b"limit=2",
    b"limit=0",
    b"limit=" + b"9" * 40,
    b"wait=1",
    b"wait=-1",
    b"wait=0.5",
    b"bogus=1",
    b"shared",
]
BLANKS = [b" ", b"  ", b"\t", b" \t "]


LOCK_KEYS = [b"a", b"b"]


@st.composite
def lock_requests(draw: st.DrawFn) -> bytes:
    """A valid request on a few keys, so that clients contend, wait, and hand over."""
    key = draw(st.sampled_from(LOCK_KEYS))
    wait = draw(st.sampled_from([b"", b" 0", b" 0.5", b" 2", b" 2"]))
    ttl = draw(st.sampled_from([b"", b"", b" ttl=1", b" ttl=0.5"]))
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return b"g " + key
    if kind == 1:
        return draw(st.sampled_from([b"r ", b"unlock ", b"unlock_shared ", b"token "])) + key
    if kind == 2:
        return (
            b"lock_shared " + key + wait + draw(st.sampled_from([b" limit=1", b" limit=2"])) + ttl
        )
    if kind == 3:
        keys = draw(st.lists(st.sampled_from(LOCK_KEYS), min_size=1, max_size=4))
        return (
            b"mlock " + b" ".join(keys) + draw(st.sampled_from([b"", b" wait=1", b" wait=2"])) + ttl
        )
    if kind == 4:
        return b"renew " + key + b" ttl=" + draw(st.sampled_from([b"0.5", b"2"]))
    if kind == 5:
        return draw(st.sampled_from([b"unlock_all", b"sg " + key, b"sr " + key, b"info " + key]))
    return b"lock " + key + wait + ttl


@st.composite
def request_lines(draw: st.DrawFn) -> bytes:
    """A request that is mostly well-formed: a valid lock request, or a verb, blanks,
    some arguments, maybe a stray ``\\r``; or an arbitrary byte string without a
    newline."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=80)).replace(b"\n", b"")
    if kind < 7:
        return draw(lock_requests())
    parts = [draw(st.sampled_from(VERBS))]
    for _ in range(draw(st.integers(0, 4))):
        parts.append(draw(st.sampled_from(BLANKS)))
        parts.append(draw(st.sampled_from(ARGS)))
    line = b"".join(parts)
    if draw(st.booleans()):
        line = draw(st.sampled_from([b"", b" ", b"\t"])) + line
    if draw(st.integers(0, 4)) == 0:
        line += b"\r"
    return line


@st.composite
def actions(draw: st.DrawFn) -> tuple[str, int, bytes | float]:
    kind = draw(st.sampled_from(["feed"] * 5 + ["raw", "advance", "advance", "close"]))
    client = draw(st.integers(0, 2))
    if kind == "feed":
        lines = draw(st.lists(request_lines(), min_size=1, max_size=6))
        data = b"\n".join(lines) + draw(st.sampled_from([b"\n", b""]))
        return kind, client, data
    if kind == "raw":
        return "feed", client, draw(st.binary(max_size=200))
    if kind == "advance":
        return kind, client, draw(st.sampled_from([0.1, 0.5, 1.0, 3.0]))
    return kind, client, b""


@dataclass
class Client:
    """One connection as the server loop sees it."""

    conn: Connection
    reader: LineReader
    queue: deque[bytes | None] = field(default_factory=deque)
    pending: Outcome | None = None
    pending_line: bytes | None = None
    held_before: tuple[set[bytes], set[bytes]] = field(default_factory=lambda: (set(), set()))
    expired_before: int = 0
    lines: int = 0
    replies: int = 0
    last_reply: bytes = b""
    closed: bool = False


class Harness:
    """Plays the server's connection loop (elockd/daemon/server.py) without sockets."""

    def __init__(self, config: Config, clients: int) -> None:
        self.service = memory_service(replace(config, max_holds=3))
        self.now = 0.0
        self.clients = [
            Client(Connection(self.service, b"10.0.0.%d:1" % n), LineReader(config.max_line))
            for n in range(clients)
        ]

    def feed(self, client: Client, data: bytes) -> None:
        if client.closed:
            return
        lines = client.reader.feed(data)
        client.lines += len(lines)
        client.queue.extend(lines)
        self.drain(client)
        self.settle()

    def drain(self, client: Client) -> None:
        """Handle queued lines until one waits (later lines wait behind it)."""
        while client.queue and client.pending is None and not client.closed:
            line = client.queue.popleft()
            session = client.conn.session
            client.held_before = set(session.exclusive), set(session.shared)
            client.expired_before = self.service.backend.expired
            reply = client.conn.handle(line, self.now)
            if waiting(reply):
                assert isinstance(reply, Outcome)
                client.pending, client.pending_line = reply, line
                continue
            self.check_reply(client, line, whole(reply))
            if client.conn.closing:  # quit, failed auth: the server hangs up
                self.close(client)

    def settle(self) -> None:
        """Finish waits that were granted or timed out (what the server's tasks do),
        until nothing changes."""
        changed = True
        while changed:
            changed = False
            for client in self.clients:
                pending = client.pending
                if pending is None or client.closed:
                    continue
                if not waiting(pending):  # the engine granted it or timed it out
                    client.pending = None
                    reply = whole(pending)
                    self.check_reply(client, client.pending_line, reply, waited=True)
                    self.drain(client)
                    changed = True

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.service.backend.advance(self.now)
        self.settle()

    def close(self, client: Client) -> None:
        if not client.closed:
            client.closed = True
            client.pending = None
            client.conn.close(self.now)
            self.settle()

    def check_reply(
        self, client: Client, line: bytes | None, reply: object, *, waited: bool = False
    ) -> None:
        assert isinstance(reply, bytes), (line, reply)
        client.replies += 1
        client.last_reply = reply
        if line is None:
            assert reply == LINE_TOO_LONG
            return
        verb = (
            (line[:-1] if line.endswith(b"\r") else line)
            .strip(b" \t")
            .replace(b"\t", b" ")
            .split(b" ")[0]
        )
        glockd = self.service.config.replies == "glockd"
        unknown = verb not in self.service.commands
        if glockd and (unknown or (verb in GLOCKD_SILENT_WHEN_EMPTY and reply == b"")):
            assert reply == b"", (line, reply)  # r312: no reply at all
            return
        assert reply.endswith(b"\r\n"), (line, reply)
        self.check_truth(client, line, verb, reply, waited)
        if glockd and verb in GLOCKD_LISTINGS:
            assert not reply.endswith(b"END\r\n") or reply.count(b"\n") > 1, (line, reply)
        elif verb in MULTI_LINE_VERBS and reply[:1] != b"4":  # not a 400 for bad arguments
            assert reply.endswith(b"END\r\n"), (line, reply)
        else:
            assert reply.count(b"\n") == 1, (line, reply)

    def check_truth(
        self, client: Client, line: bytes, verb: bytes, reply: bytes, waited: bool
    ) -> None:
        """A grant or refusal of a taking verb says what this session now holds; an
        ``mlock`` that gave up keeps none of the keys it took while waiting. (A waited
        grant's count is that of its grant: others may have come or gone since. And a
        lease the session already had may run out in the same instant as the grant.)"""
        line = line[:-1] if line.endswith(b"\r") else line
        tokens = [t for t in line.replace(b"\t", b" ").split(b" ") if t][1:]
        # As elockd.protocol.word.Args: a first token is positional even with a "=" in it.
        keys = [t for i, t in enumerate(tokens) if i == 0 or b"=" not in t]
        keys = keys[: None if verb == b"mlock" else 1]
        session = client.conn.session
        exclusive, shared = set(session.exclusive), set(session.shared)
        code = reply.split(b" ", 1)[0]
        expired = self.service.backend.expired > client.expired_before
        if verb in (b"lock", b"mlock") and code in (b"200", b"409"):
            if code == b"200":
                assert set(keys) <= exclusive or expired, (line, reply)
            else:
                assert exclusive <= client.held_before[0], (line, reply)
        if verb == b"lock_shared" and code in (b"200", b"409"):
            assert (keys[0] in shared) == (code == b"200") or expired, (line, reply)
            if code == b"200":
                count = int(reply[4:])
                assert count >= 1
                assert waited or count == self.service.backend.shared_count(keys[0])
                options = [t for t in tokens[1:] if b"=" in t]
                limit = next((t[6:] for t in options if t.startswith(b"limit=")), b"")
                repeat = keys[0] in client.held_before[1]  # a holder asking again
                if 0 < len(limit) < 18 and not repeat:  # never past the request's limit
                    assert count <= int(limit), (line, reply)

    def check_engine(self) -> None:
        engine = self.service.backend
        leases = 0
        for key, hold in engine.exclusive.items():
            assert hold.key == key and not hold.shared
            assert hold.session.exclusive.get(key) is hold
            assert engine.sessions.get(hold.session.id) is hold.session
            leases += hold.lease_deadline is not None
        for key in engine.shared:
            holders = list(engine.shared_holds(key))
            assert holders, f"empty holder table for {key!r}"
            for hold in holders:
                session = hold.session
                assert hold.key == key and hold.shared
                assert session.shared.get(key) is hold
                leases += hold.lease_deadline is not None
        assert engine.leases == leases
        waiting = 0
        for session in engine.sessions.values():
            for key, hold in session.exclusive.items():
                assert engine.exclusive[key] is hold
            for key, hold in session.shared.items():
                assert hold in engine.shared_holds(key)
            session_leases = sum(
                h.lease_deadline is not None
                for h in [*session.exclusive.values(), *session.shared.values()]
            )
            assert session.leases == session_leases
            waiting += len(session.waiters)
            assert session.connected or not session.waiters
        assert engine.waiting == waiting
        for key, queue in engine._xqueues.items():
            assert queue and key in engine.exclusive, "a free exclusive key has a queue"
            assert all(w.state == WAITING for w in queue)
        for key, queue in engine._squeues.items():
            assert queue and all(w.state == WAITING for w in queue)
            assert (
                engine.shared_count(key) >= next(iter(queue)).limit
            ), "a head waiter that fits waits"
        live = sum(not c.closed for c in self.clients)
        assert self.service.counters.connections == live
        assert len(self.service.connections) == live


FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(
    steps=st.lists(actions(), max_size=40),
    replies=st.sampled_from(["elockd", "glockd"]),
    max_line=st.sampled_from([8, 24, 4096]),
)
# Two hand-overs that random steps reach only now and then, so every run covers them:
# two waiters with limit=1 when the one holder leaves (only one may get in), and an
# mlock that took one key, then gave up (it must let go of it).
@example(
    steps=[
        ("feed", 0, b"lock_shared k limit=1\n"),
        ("feed", 1, b"lock_shared k 5 limit=1\n"),
        ("feed", 2, b"lock_shared k 5 limit=1\n"),
        ("feed", 0, b"unlock_shared k\n"),
    ],
    replies="elockd",
    max_line=4096,
)
@example(
    steps=[("feed", 0, b"g a\n"), ("feed", 1, b"mlock b a wait=1\n"), ("advance", 0, 2.0)],
    replies="elockd",
    max_line=4096,
)
def test_any_input_gets_one_reply_per_line_and_keeps_the_engine_sound(
    steps: list[tuple[str, int, bytes | float]], replies: str, max_line: int
) -> None:
    config = Config(replies=replies, max_line=max_line, max_waiters=2, max_keys=3)
    harness = Harness(config, clients=3)
    for kind, index, value in steps:
        client = harness.clients[index]
        if kind == "feed":
            assert isinstance(value, bytes)
            harness.feed(client, value)
        elif kind == "advance":
            assert isinstance(value, float)
            harness.advance(value)
        else:
            harness.close(client)
        harness.check_engine()
    for _ in range(100):  # every wait times out (one after another), every lease ends
        harness.advance(10_000.0)
    harness.check_engine()
    for client in harness.clients:
        if client.closed:
            assert client.replies <= client.lines
        else:
            assert client.pending is None and not client.queue
            assert client.replies == client.lines


@FUZZ
@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_arbitrary_bytes_in_arbitrary_chunks(data: bytes, cuts: list[int]) -> None:
    """Raw bytes, split anywhere: the reply count depends only on the bytes."""
    harness = Harness(Config(max_line=32), clients=1)
    client = harness.clients[0]
    start = 0
    for cut in sorted(cuts):
        harness.feed(client, data[start:cut])
        start = max(start, cut)
    harness.feed(client, data[start:])
    harness.advance(10_000.0)
    harness.check_engine()
    if not client.closed:
        whole = LineReader(32).feed(data)
        assert client.lines == len(whole)
        assert client.replies == client.lines


def test_a_huge_limit_is_a_bad_request_not_a_crash() -> None:
    """Regression: ``limit=`` with more digits than int() accepts (4300) raised
    ValueError out of the handler, which in the server ended the whole process (every
    lock lost). Only reachable with --max-line above ~4300."""
    harness = Harness(Config(max_line=10_000), clients=1)
    client = harness.clients[0]
    harness.feed(client, b"lock_shared k 1 limit=" + b"7" * 5000 + b"\n")
    assert client.replies == 1
    assert client.last_reply == b"200 1\r\n"  # a limit no count reaches
    harness.check_engine()
