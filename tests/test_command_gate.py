"""The deadline gate, as the command table declares it (docs/cluster.md, "What is
guaranteed"): every verb whose reply confirms, describes or lists a hold passes one
check after the last await of its request, :func:`elockd.protocol.connection.gated`.

The structural test reads the handlers the way tests/test_package_shape.py reads
imports: a handler that asks the backend a verb that reports holds (directly, or
through a helper of its module) must sit in a row marked ``holds=True``, and the
service puts exactly the marked rows behind the gate. The check runs over the real
table and, in ``test_the_check_fails_when_any_one_mark_is_removed``, over copies
of it with one mark taken off: it can fail, and names the verb.

The behavioural tests run every marked verb on an in-memory backend whose gate is
switched by hand: passing, the replies are the usual ones; stale, every one is its
family's refusal, never a hold.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest
import trio

from elockd.backend.interface import Backend, Later
from elockd.backend.memory import MemoryBackend
from elockd.ctl.status import EXIT_ERROR
from elockd.ctl.watch import print_events
from elockd.daemon.server import serve
from elockd.net.serving import PausableService, settle
from elockd.protocol.commands import TABLE
from elockd.protocol.config import Config
from elockd.protocol.connection import (
    TERSE,
    WORD,
    Command,
    Connection,
    Outcome,
    Reports,
    Service,
    Streamed,
    gated,
)
from tests.support.line_client import LineClient
from tests.support.sansio import whole

#: The backend verbs whose answer is about a hold: a grant, a token, a key's
#: holder, a listing or a watch's lines of holds, a session taken over with its holds.
REPORT_HOLDS = frozenset(
    {
        "acquire",
        "lock",
        "lock_shared",
        "renew",
        "token",
        "info",
        "holders",
        "listing",
        "watch_keys",
        "watch_lines",
        "take_over",
    }
)
#: The rest of the interface: frees, throttles (an admission holds nothing), the
#: operator's kill (it reports evictions), the timer, the hand-over, the books.
REPORT_NO_HOLDS = frozenset(
    {
        "open_session",
        "disconnect",
        "rename",
        "release",
        "release_shared",
        "release_all",
        "kill",
        "throttle",
        "next_deadline",
        "advance",
        "background",
        "freeze",
        "settle",
        "thaw",
        "hand_off",
        "dump",
        "restore",
        "books",
        "deadline_gate",
    }
)


def test_every_backend_verb_is_classified() -> None:
    """A verb added to the interface must be put on one side, so a new way to ask
    about holds cannot slip past the check below."""
    verbs = {name for name in vars(Backend) if not name.startswith("_")}
    assert verbs == REPORT_HOLDS | REPORT_NO_HOLDS
    assert not REPORT_HOLDS & REPORT_NO_HOLDS


@cache
def _functions(module: str) -> dict[str, ast.FunctionDef]:
    """The module-level functions of a module, by name."""
    source = Path(inspect.getfile(sys.modules[module])).read_text()
    tree = ast.parse(source)
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _is_backend(node: ast.expr) -> bool:
    """``backend`` or ``<anything>.backend``."""
    if isinstance(node, ast.Name):
        return node.id == "backend"
    return isinstance(node, ast.Attribute) and node.attr == "backend"


def asks_about_holds(module: str, name: str, seen: set[str] | None = None) -> set[str]:
    """The hold-reporting backend verbs a function of ``module`` calls, itself or
    through the module's other functions it calls."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    functions = _functions(module)
    found: set[str] = set()
    for node in ast.walk(functions[name]):
        if isinstance(node, ast.Attribute) and _is_backend(node.value):
            if node.attr in REPORT_HOLDS:
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in functions
        ):
            found |= asks_about_holds(module, node.func.id, seen)
    return found


def unmarked(table: Iterable[Command]) -> list[str]:
    """Each row whose handler can answer about a hold but is not behind the gate."""
    missing = []
    for command in table:
        handler = command.handler
        asked = asks_about_holds(handler.__module__, handler.__name__)
        if asked and not command.holds:
            missing.append(f"{command.verb.decode()} ({', '.join(sorted(asked))})")
    return missing


def test_every_handler_that_answers_about_a_hold_is_behind_the_gate() -> None:
    assert unmarked(TABLE) == []


def _without_mark(table: tuple[Command, ...], verb: bytes) -> list[Command]:
    return [command.marked(False) if command.verb == verb else command for command in table]


def test_the_check_fails_when_any_one_mark_is_removed() -> None:
    """The check can fail: a copy of the table with any one row's mark taken off is
    reported, by verb (the rows whose handlers ask the backend about holds)."""
    needed = [c for c in TABLE if asks_about_holds(c.handler.__module__, c.handler.__name__)]
    verbs = {c.verb for c in needed}
    # Every verb that answers about a hold and whose handler asks the backend.
    assert {b"g", b"sg", b"i", b"si", b"d", b"sd", b"dump", b"lock", b"lock_shared"} <= verbs
    assert {b"mlock", b"renew", b"token", b"info", b"ls", b"watch", b"conn_id"} <= verbs
    for command in needed:
        missing = unmarked(_without_mark(TABLE, command.verb))
        assert len(missing) == 1 and missing[0].startswith(command.verb.decode() + " ")


# ------------------------------------------------------------ the gate at work


class Lapsing(MemoryBackend):
    """An in-memory backend whose deadline gate is switched by hand."""

    stale = False

    def deadline_gate(self) -> object:  # type: ignore[override]
        return lambda asked: self.stale


def lapsing_service(replies: str = "elockd") -> tuple[Service, Lapsing]:
    backend = Lapsing(first_token=100)
    return Service(Config(replies=replies), backend, {c.verb: c for c in TABLE}), backend


#: A request for every marked verb, each answered with something about a hold.
ABOUT_HOLDS = [
    b"g k",
    b"i k",
    b"sg s",
    b"si s",
    b"d",
    b"sd",
    b"dump",
    b"who",
    b"lock k",
    b"lock_shared s",
    b"mlock k m",
    b"renew k ttl=5",
    b"token k",
    b"info k",
    b"ls",
    b"conn_id",
]


def test_in_memory_nothing_is_gated() -> None:
    """The in-memory backend has no gate: the table's rows are served as they are,
    so its hot path pays nothing for it."""
    backend = MemoryBackend(first_token=100)
    service = Service(Config(), backend, {c.verb: c for c in TABLE})
    assert service.stale is None
    assert all(service.commands[c.verb] is c for c in TABLE)


def test_a_stale_backend_answers_every_marked_verb_with_its_refusal() -> None:
    service, backend = lapsing_service()
    conn = Connection(service, b"peer")
    conn.handle(b"iam me", 0.0)
    for line in ABOUT_HOLDS:  # passing: the usual replies
        reply = whole(conn.handle(line, 0.0))
        assert b"Backend Unavailable" not in reply, line
    backend.stale = True
    for line in ABOUT_HOLDS:
        verb = line.split()[0]
        family = TERSE if verb in {b"g", b"i", b"sg", b"si", b"d", b"sd", b"dump", b"who"} else WORD
        assert whole(conn.handle(line, 0.0)) == family.unavailable, line
    # Verbs about no hold are not gated: a release, a ping.
    assert whole(conn.handle(b"r k", 0.0)) == b"1 Released Lock\r\n"
    assert whole(conn.handle(b"ping", 0.0)) == b"200 PONG\r\n"


def test_a_streamed_listing_that_goes_stale_ends_with_the_refusal() -> None:
    """Each chunk is checked once made: rows sent before the deadline stand, the
    rest (and the END) is replaced by the refusal, which no row looks like."""
    service, backend = lapsing_service()
    conn = Connection(service, b"peer")
    keys = [b"key%06d" % n for n in range(5000)]  # more than one chunk
    for key in keys:
        whole(conn.handle(b"g " + key, 0.0))
    stream = conn.handle(b"ls", 0.0)
    assert isinstance(stream, Streamed)
    parts = iter(stream.chunks)
    first = next(parts)
    assert first.startswith(b"key000000 exclusive=")
    backend.stale = True
    rest = b"".join(parts)
    assert rest == WORD.unavailable + b"END\r\n"  # a client reading to END stays in step
    assert b"key004999" not in rest


def test_a_glockd_listing_cut_midway_ends_as_that_dialect_ends_one() -> None:
    """glockd's ``d`` has no ``END``: a cut one ends with the refusal line alone. Its
    ``dump`` is one line (Go's print of a map): cut inside it, no line can follow,
    so the connection ends rather than glue the refusal onto the map."""
    service, backend = lapsing_service("glockd")
    conn = Connection(service, b"peer")
    conn.handle(b"iam me", 0.0)
    for n in range(5000):  # more than one chunk
        whole(conn.handle(b"g key%06d" % n, 0.0))
    stream = conn.handle(b"d", 0.0)
    assert isinstance(stream, Streamed)
    parts = iter(stream.chunks)
    assert next(parts).endswith(b"\r\n")
    backend.stale = True
    assert b"".join(parts) == TERSE.unavailable
    assert not conn.closing
    backend.stale = False
    stream = conn.handle(b"dump", 0.0)
    assert isinstance(stream, Streamed)
    parts = iter(stream.chunks)
    assert not next(parts).endswith(b"\n")  # inside the map's one line
    backend.stale = True
    assert b"".join(parts) == b""
    assert conn.closing


def test_a_watch_whose_snapshot_went_out_before_the_node_lost_vouch_ends() -> None:
    """The snapshot's last chunk went out; the stream that follows would send events
    from before a loss: the gate asks once more after the snapshot, and the watch
    gets the refusal in place of its stream."""
    service, backend = lapsing_service()
    conn = Connection(service, b"peer")
    whole(conn.handle(b"g a", 0.0))
    stream = conn.handle(b"watch", 0.0)
    assert isinstance(stream, Streamed)
    sent = []
    for chunk in stream.chunks:
        sent.append(chunk)
        if chunk.endswith(b"SYNCED\r\n"):
            backend.stale = True  # lost while the last chunk was being sent
    assert sent[-1] == WORD.unavailable and b"SYNCED" in sent[-2]
    assert conn.closing


def test_a_watch_refused_by_the_gate_ends_its_connection() -> None:
    service, backend = lapsing_service()
    conn = Connection(service, b"peer")
    backend.stale = True
    assert whole(conn.handle(b"watch", 0.0)) == WORD.unavailable
    assert conn.closing


async def test_a_live_watch_stream_that_goes_stale_says_so_and_ends(
    nursery: trio.Nursery,
) -> None:
    """Over a real socket: a watcher gets its events while the gate passes; once it
    does not, the next event is not sent: ``409 Backend Unavailable`` is, then the
    connection closes."""
    config = Config(host="127.0.0.1", port=0, metrics_port=0)
    backend = Lapsing(first_token=100)
    service = PausableService(config, backend, {c.verb: c for c in TABLE})
    addresses = await nursery.start(serve, config, service)
    port = next(a[1] for a in addresses if isinstance(a, tuple))
    watcher = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    locker = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    with trio.fail_after(5):
        await watcher.send(b"watch\n")
        assert await watcher.line() == b"200 Watching\r\n"
        assert await watcher.line() == b"SYNCED\r\n"
        assert await locker.request(b"iam x") == b"1 ok"
        assert await locker.request(b"g a") == b"1 Got Lock"
        assert await watcher.line() == b"+ a exclusive x token=100\r\n"
        backend.stale = True
        assert await locker.request(b"r a") == b"1 Released Lock"  # not gated
        assert await watcher.line() == WORD.unavailable
        assert await watcher.at_eof()
    await watcher.aclose()
    await locker.aclose()


async def test_a_refused_watch_over_a_socket_is_one_refusal_then_the_end(
    nursery: trio.Nursery,
) -> None:
    """``watch`` on a node that cannot vouch: one ``409 Backend Unavailable``, then
    the connection closes; a request behind it on the same line is not served."""
    config = Config(host="127.0.0.1", port=0, metrics_port=0)
    backend = Lapsing(first_token=100)
    backend.stale = True
    service = PausableService(config, backend, {c.verb: c for c in TABLE})
    addresses = await nursery.start(serve, config, service)
    port = next(a[1] for a in addresses if isinstance(a, tuple))
    client = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    with trio.fail_after(5):
        await client.send(b"watch\nping\n")
        assert await client.line() == WORD.unavailable
        assert await client.at_eof()
    await client.aclose()


async def test_elockctl_watch_says_why_the_server_ended_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``elockctl watch`` reads the refusal as the end of the stream, says why, and
    exits 3 (it cannot tell what the table is), not printing it as an event."""
    events = [b"+ a exclusive x token=1", b"409 Backend Unavailable"]

    class Events:
        async def event(self) -> bytes | None:
            return events.pop(0) if events else None

    assert await print_events(Events(), "127.0.0.1:9999") == EXIT_ERROR  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert "+ a exclusive x token=1" in out and "409" not in out
    assert "the server ended the watch: 409 Backend Unavailable" in err


async def test_a_waited_grant_is_gated_after_its_wait_has_closed() -> None:
    """A waiting request's grant comes while its connection's peer watcher still
    runs; closing that race is an await, and the node may lose its sessions there
    (a pause): the reply is made after it, so the gate refuses the grant."""
    stale = [False]

    class Watching:
        pause = None

        async def watch_for_close(self) -> None:
            try:
                await trio.sleep_forever()
            finally:
                stale[0] = True  # the node passed its deadline while this stopped

    async def granted() -> bool:
        return True

    conn = Connection(lapsing_service()[0], b"peer")
    outcome = Outcome(Later(granted, waits=True), lambda ok: b"200 Acquired\r\n", WORD, b"peer")
    gated(outcome, WORD, lambda asked: stale[0], 0.0, conn)
    assert await settle(outcome, Watching(), Reports()) == WORD.unavailable  # type: ignore[arg-type]
