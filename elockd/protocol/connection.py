"""Sans-IO request handling: a request line in, a reply out.

A :class:`Connection` is one client's view of the lock service. The server feeds it
the lines that :class:`elockd.protocol.framing.LineReader` cut from the socket and writes
back what it returns; nothing here touches a socket or a clock, so every reply of
docs/protocol.md is a one-line unit test.

A reply is one of:

* ``bytes``: the reply, now (almost every request);
* :class:`Outcome`: a reply that comes later, because the request waits for a grant
  or needs the backend's I/O. The server awaits the backend's answer (racing it
  against the client going away when it waits) and makes the reply with
  :meth:`Outcome.finish`, or :meth:`Family.refusal` when the backend refused;
* :class:`Streamed`: a multi-line reply that grows with the tables (a dump), sent a
  chunk at a time as fast as the client reads;
* :class:`Delayed`: a reply held back on purpose (a wrong ``auth`` token).

Every reply that confirms, describes or lists a hold passes one check, the
*deadline gate* (:func:`gated`), after the last await of its request: a cluster
node past its lease's local deadline, without a lease, or that lost its sessions
since the request was read answers the family's refusal instead
(``0 Backend Unavailable`` / ``409 Backend Unavailable``), never a hold it may no
longer have. The table marks which verbs answer about holds (``holds=True``); the
:class:`Service` puts exactly those behind the gate, once, when it is made.

The verbs come from a declarative table (:mod:`elockd.protocol.commands`) that the caller
passes in: each :class:`Command` declares its family, arguments, whether it needs
``auth``, and its handler. The dispatcher counts the verb, splits a word request's
arguments by the declaration, and calls the handler.

Nothing here awaits, sleeps or logs: what an operator should hear of (a refusal at
a limit, a failed ``auth``) goes to the :class:`Reports` hooks, which the server
wires to its log records (:mod:`elockd.observe.logs`).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from elockd.backend.interface import (
    REFUSALS,
    Backend,
    Evicted,
    Later,
    QueueFull,
    Result,
    TooManyHolds,
    TooManyThrottles,
)
from elockd.engine.gcra import Rate
from elockd.engine.sessions import Session
from elockd.engine.watchers import Watcher
from elockd.protocol.arguments import Args, BadRequest
from elockd.protocol.config import Config
from elockd.protocol.replies import STYLES, TerseReplies
from elockd.protocol.stats import Counters, Timings, snapshot

T = TypeVar("T")

LINE_TOO_LONG = b"0 Line Too Long\r\n"
INVALID_VERB_SHOWN = 64  # bytes of an unknown verb echoed back


def _unreported(*_: object) -> None:
    """A hook nobody wired (tests, tools): the event is not reported."""


class Reports:
    """What the request layer has to tell an operator, as hooks: it never logs
    itself. The server wires them to :mod:`elockd.observe.logs` (rate-limited
    records); unwired, nothing is reported."""

    __slots__ = ("auth_failure", "kill", "refusal")

    def __init__(self) -> None:
        #: A request refused at the limit the flag names (``--max-holds``), and by whom.
        self.refusal: Callable[[str, bytes], None] = _unreported
        #: A wrong ``auth`` token, and from whom.
        self.auth_failure: Callable[[bytes], None] = _unreported
        #: An operator's ``kill K``: the admin's peer, the key, the holds it freed.
        self.kill: Callable[[bytes, bytes, list[Evicted]], None] = _unreported


class Family:
    """A command family: how its clients are told a request was refused outside the
    verb's own replies (``0 …`` for lockd clients, which read the leading integer;
    ``4xx …`` for the word family)."""

    __slots__ = ("auth_required", "name", "too_many_holds", "too_many_waiters", "unavailable")

    def __init__(
        self,
        name: str,
        *,
        auth_required: bytes,
        too_many_holds: bytes,
        too_many_waiters: bytes,
        unavailable: bytes,
    ) -> None:
        self.name = name
        self.auth_required = auth_required
        self.too_many_holds = too_many_holds
        self.too_many_waiters = too_many_waiters
        self.unavailable = unavailable

    def refusal(self, error: Exception, peer: bytes, reports: Reports) -> bytes:
        """The reply for a backend's refusal (reported: limit refusals are what an
        operator tunes a flag for)."""
        if isinstance(error, TooManyHolds):
            reports.refusal("--max-holds", peer)
            return self.too_many_holds
        if isinstance(error, QueueFull):
            reports.refusal("--max-waiters", peer)
            return self.too_many_waiters
        if isinstance(error, TooManyThrottles):
            reports.refusal("--max-throttles", peer)
            return b"413 Too Many Throttles\r\n"  # a word verb's only
        return self.unavailable


TERSE = Family(
    "terse",
    auth_required=b"0 Auth Required\r\n",
    too_many_holds=b"0 Too Many Holds\r\n",
    too_many_waiters=b"0 Too Many Waiters\r\n",  # never: terse requests do not wait
    unavailable=b"0 Backend Unavailable\r\n",
)
WORD = Family(
    "word",
    auth_required=b"403 Auth Required\r\n",
    too_many_holds=b"413 Too Many Holds\r\n",
    too_many_waiters=b"413 Too Many Waiters\r\n",
    unavailable=b"409 Backend Unavailable\r\n",
)


class Streamed:
    """A reply that can outgrow any buffer (``d`` over a million holds): ``chunks``
    yields it a piece at a time, and the server asks for the next piece only once the
    last one was sent, so what one connection holds stays bounded however big the
    tables are and however slowly the client reads."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks

    def whole(self) -> bytes:
        """Every chunk joined: for tests and for callers that need it in one piece."""
        return b"".join(self.chunks)


class Delayed:
    """A reply sent only after ``seconds``: a wrong ``auth`` token is answered late,
    so guessing tokens is slow. Only this connection waits; the server sleeps in its
    task, never in the loop other clients share."""

    __slots__ = ("reply", "seconds")

    def __init__(self, reply: bytes, seconds: float) -> None:
        self.reply = reply
        self.seconds = seconds


class Outcome:
    """A reply that comes later: the backend's :class:`~elockd.backend.interface.Later` result,
    and what turns it into the reply: ``finish(value)`` once the backend answered,
    ``family.refusal(...)`` if it refused (a limit, or etcd without quorum). The
    awaiting is the server's (:func:`elockd.net.serving.answered`). ``waits`` marks a
    request waiting for a grant, which the server abandons when its client goes away."""

    __slots__ = ("family", "finish", "later", "peer")

    def __init__(
        self,
        later: Later[Any],
        finish: Callable[[Any], bytes | Streamed],
        family: Family,
        peer: bytes,
    ) -> None:
        self.later = later
        self.finish = finish
        self.family = family
        self.peer = peer

    @property
    def waits(self) -> bool:
        return self.later.waits


Reply = bytes | Outcome | Streamed | Delayed
#: A handler: (connection, what follows the verb, now) for the terse family, and
#: (connection, the split arguments, now) for the word family.
Handler = Callable[["Connection", Any, float], Reply]
#: A backend's deadline gate (:meth:`~elockd.backend.interface.Backend.deadline_gate`),
#: given when the request was read: True when the backend can no longer vouch for
#: what it would say about a hold read since then.
Stale = Callable[[float], bool]


def gated(reply: Reply, family: Family, stale: Stale, asked: float, conn: Connection) -> Reply:
    """The deadline gate: ``reply``, about a hold, as it may be sent, checked at the
    last moment before it is sent and after every await of its request.

    * bytes: checked now (the handler answered at once, nothing was awaited);
    * an :class:`Outcome`: checked when its value has come, as it is made into the
      reply (its ``finish``), so a backend answer that came just before a pause is
      not sent after it;
    * a :class:`Streamed` reply (``d``, ``ls``, ``who``, a ``watch`` snapshot):
      checked before each chunk goes out (:func:`_gated_chunks`).

    The refusal is the family's (``0 Backend Unavailable``, ``409 Backend
    Unavailable``); ``asked``, when the request was read (a node whose sessions
    were lost since may have read holds that etcd freed meanwhile). A stale
    backend's reply is never the stale hold."""
    if isinstance(reply, bytes):
        return family.unavailable if reply and stale(asked) else reply
    if isinstance(reply, Outcome):
        finish = reply.finish

        def checked(value: Any) -> bytes | Streamed:
            made = gated(finish(value), family, stale, asked, conn)
            assert isinstance(made, bytes | Streamed)
            return made

        checked.__wrapped__ = finish  # type: ignore[attr-defined]  # a hand-over names
        reply.finish = checked  # a waiting reply by what it wraps (inspect.unwrap)
        return reply
    if isinstance(reply, Streamed):
        return Streamed(_gated_chunks(reply.chunks, family, stale, asked, conn))
    return reply  # Delayed: a wrong auth token, about no hold


#: What closes a word-family listing (``ls``) the gate cut after some of its rows.
CUT_END = b"END\r\n"


def _gated_chunks(
    chunks: Iterator[bytes], family: Family, stale: Stale, asked: float, conn: Connection
) -> Iterator[bytes]:
    """Each chunk once made and checked; a ``watch``'s snapshot once more after its
    last chunk went out (its stream goes on from there). Once stale, the rest is
    :func:`_cut`'s."""
    last = b""
    for chunk in chunks:
        if stale(asked):
            yield _cut(family, conn, last)
            return
        last = chunk or last
        yield chunk
    if conn.watcher is not None and stale(asked):
        yield _cut(family, conn, last)


def _cut(family: Family, conn: Connection, last: bytes) -> bytes:
    """What ends a stream the gate stopped, ``last`` being the last chunk sent:

    * a ``watch``: the refusal, and its connection ends;
    * nothing sent yet: the one-line refusal a client expects in place of a listing;
    * midway, at a line's end: the refusal, then what ends the listing in its
      style (``END``; nothing in glockd's), so that a client reading to the end
      stays in step and sees the refusal as the last line (no row equals it);
    * inside a line (glockd's ``dump`` is one line): no line can follow, so the
      connection ends there."""
    if conn.watcher is not None:
        conn.closing = True
        return family.unavailable
    if not last:
        return family.unavailable
    if not last.endswith(b"\n"):
        conn.closing = True
        return b""
    return family.unavailable + (CUT_END if family is WORD else conn.replies.listing_end)


def answer(
    result: Result[T], finish: Callable[[T], bytes | Streamed], family: Family, peer: bytes
) -> Reply:
    """The reply to a backend operation's result: ``finish(value)`` now, or an
    :class:`Outcome` that finishes the same way once the value comes."""
    if isinstance(result, Later):
        return Outcome(result, finish, family, peer)
    return finish(result)


class Command:
    """One verb of the table: its family, what it takes, whether it may be asked
    before ``auth``, and its handler. A word verb takes at most ``arguments``
    positional arguments and the ``options`` named; the dispatcher splits them into
    :class:`~elockd.protocol.arguments.Args` before the handler runs. A terse verb's
    handler gets the rest of the line (its key is the whole of it)."""

    __slots__ = (
        "arguments",
        "call",
        "family",
        "handler",
        "holds",
        "needs_auth",
        "options",
        "raw",
        "secret",
        "verb",
        "wait_reply",
    )

    def __init__(
        self,
        verb: bytes,
        family: Family,
        handler: Handler,
        *,
        arguments: int = 0,
        options: frozenset[bytes] = frozenset(),
        needs_auth: bool = True,
        raw: bool = False,
        secret: bool = False,
        wait_reply: Callable[[Any], bytes] | None = None,
        holds: bool = False,
    ) -> None:
        """``raw``: a word verb whose handler takes the rest of the line as it is
        (``auth``: a token may hold blanks). ``secret``: its arguments or its reply
        carry a bearer secret (a token, a session id), which no log may show.
        ``holds``: its reply confirms, describes or lists a hold, so it passes the
        deadline gate (:func:`gated`; tests/test_command_gate.py checks the table)."""
        self.verb = verb
        self.holds = holds
        self.family = family
        self.handler = handler
        self.arguments = arguments
        self.options = options
        self.needs_auth = needs_auth
        self.raw = raw
        self.secret = secret
        #: For a verb that may wait: how its answer is worded once it comes, named by
        #: the verb in a hand-over's state so that the successor words it the same.
        self.wait_reply = wait_reply
        # What the dispatcher calls: the handler itself when it takes the rest of
        # the line (the terse family: the hot path pays no extra call), else one
        # that splits the arguments first.
        self.call: Callable[[Connection, bytes, float], Reply] = (
            handler if family is TERSE or raw else self._split_then_handle
        )

    def _split_then_handle(self, conn: Connection, rest: bytes, now: float) -> Reply:
        args = Args(rest, self.options, self.arguments, conn.service.config.max_ttl)
        return self.handler(conn, args, now)

    def marked(self, holds: bool) -> Command:
        """This row as it is, with its ``holds`` mark set to ``holds``."""
        copy = object.__new__(Command)
        for name in Command.__slots__:
            setattr(copy, name, getattr(self, name))
        copy.holds = holds
        return copy

    def behind(self, stale: Stale) -> Command:
        """This verb with its every reply passed through the deadline gate."""
        copy = self.marked(self.holds)
        call, family = self.call, self.family

        def checked(conn: Connection, rest: bytes, now: float) -> Reply:
            return gated(call(conn, rest, now), family, stale, now, conn)

        copy.call = checked
        return copy


def _refused_before_auth(command: Command) -> Command:
    """The stand-in for ``command`` until ``auth`` succeeds: refused, nothing done."""
    refusal = command.family.auth_required
    return Command(command.verb, TERSE, lambda conn, rest, now: refusal)


class Service:
    """What every connection shares: the backend, the command table, the counters,
    the settings."""

    def __init__(
        self,
        config: Config,
        backend: Backend,
        commands: Mapping[bytes, Command],
        auth_token: bytes | None = None,
        admin_token: bytes | None = None,
    ) -> None:
        """``auth_token``: what ``auth`` must be given before anything else is served
        (``--auth-token-file``); ``admin_token``: what marks a connection as an
        operator's, which alone may ``kill`` (``--admin-token-file``)."""
        self.config = config
        self.backend = backend
        #: The backend's deadline gate; None (in memory): every answer holds good
        #: when it is sent, and no verb pays for a check.
        self.stale = backend.deadline_gate()
        if self.stale is not None:
            stale = self.stale
            commands = {
                verb: command.behind(stale) if command.holds else command
                for verb, command in commands.items()
            }
        self.commands = commands
        # Runs beside the listeners for the server's lifetime (the cluster's watch
        # and keepalives), started before the first connection is accepted.
        self.replies: TerseReplies = STYLES[config.replies]
        self.counters = Counters(list(self.commands))
        # Wait and hold times for /metrics; the backend feeds them only once a
        # metrics registry asks for them (feed_timings), so without a metrics port
        # no release pays for the hook.
        self.timings = Timings()
        self.connections: set[Connection] = set()
        # Connections that set a name with `iam`, oldest naming first (for `who`).
        self.named: dict[Connection, None] = {}
        self.auth_token = auth_token
        self.admin_token = admin_token
        self.reports = Reports()
        # `throttle`'s common (COUNT, PERIOD) spellings, parsed once (protocol.word).
        self.throttle_rates: dict[tuple[bytes, bytes], Rate] = {}
        # Before `auth` succeeds a connection dispatches through this table, where
        # every verb that needs auth is refused: no per-request check on the hot path.
        self.unauthenticated_commands = {
            verb: command if not command.needs_auth else _refused_before_auth(command)
            for verb, command in self.commands.items()
        }

    def feed_timings(self) -> None:
        """Point the backend's wait and hold hooks at :attr:`timings` (unless the
        caller wired its own)."""
        books = self.backend.books
        if books.on_wait_end is None:
            books.on_wait_end = self.timings.wait_ended
        if books.on_hold_end is None:
            books.on_hold_end = self.timings.hold_ended
            books.on_holds_end = self.timings.holds_ended

    def snapshot(self) -> dict[str, int]:
        return snapshot(self.backend.books, self.counters)

    def new_session_id(self) -> str:
        """128 random bits from the OS CSPRNG: a session id is a bearer secret."""
        return secrets.token_hex(16)


class Connection:
    """One client connection: its session, its name, and request dispatch."""

    __slots__ = (
        "abort",
        "admin",
        "backend",
        "closing",
        "command_counts",
        "commands",
        "peer",
        "replies",
        "service",
        "session",
        "watcher",
    )

    def __init__(
        self,
        service: Service,
        peer: bytes,
        session: Session | None = None,
        *,
        counted: bool = False,
    ) -> None:
        """``session``: an existing one this connection serves on (a hand-over's
        successor); else a new session is opened. ``counted``: the accept loop counted
        the connection in ``connections`` already (it counts at accept, so that the
        count never lags behind connections the server has taken)."""
        self.service = service
        self.backend = service.backend
        self.replies = service.replies
        self.peer = peer
        if session is None:
            session = service.backend.open_session(service.new_session_id(), peer)
            session.grace = service.config.grace
        self.session = session
        self.closing = False  # set by `quit` and a failed `auth`: close after this reply
        # Set by `watch`: the connection is an event stream from its reply on.
        self.watcher: Watcher | None = None
        # Passed `auth` with the --admin-token-file token: may `kill`.
        self.admin = False
        # Set by the server: ends this connection (the backend lost its session).
        self.abort: Callable[[], None] | None = None
        self.command_counts = service.counters.commands
        self.commands = (
            service.commands if service.auth_token is None else service.unauthenticated_commands
        )
        service.connections.add(self)
        if not counted:
            service.counters.connections += 1

    def handle(self, line: bytes | None, now: float) -> Reply:
        """Answer one request line (None stands for an over-long line).

        This runs once per request, so the common shape (``verb`` or ``verb args``
        with single spaces) is split with one ``partition``; anything else (leading
        blanks, tabs, unknown verbs) takes :func:`_split_carefully`.
        """
        if line is None:
            self.service.counters.invalid_commands += 1
            return LINE_TOO_LONG
        if line[-1:] == b"\r":
            line = line[:-1]
        verb, _, rest = line.partition(b" ")
        command = self.commands.get(verb)
        if command is None:
            verb, rest = _split_carefully(line)
            command = self.commands.get(verb)
            if command is None:
                self.service.counters.invalid_commands += 1
                return self.replies.unknown_verb(verb[:INVALID_VERB_SHOWN])
        self.command_counts[verb] += 1
        try:
            return command.call(self, rest, now)
        except BadRequest as error:
            return b"400 Bad Request: %s\r\n" % str(error).encode()
        except REFUSALS as error:
            return command.family.refusal(error, self.peer, self.service.reports)

    def set_abort(self, abort: Callable[[], None]) -> None:
        """How the backend may end this connection (its session was lost)."""
        self.abort = abort
        self.session.abort = abort

    def adopt(self, session: Session) -> None:
        """``conn_id``: this connection now serves ``session``."""
        session.abort = self.abort
        self.session = session

    @property
    def authenticated(self) -> bool:
        """Whether requests that need ``auth`` are served (no token, or ``auth`` done)."""
        return self.commands is self.service.commands

    def authenticate(self) -> None:
        self.commands = self.service.commands

    def check_token(self, token: bytes) -> bool:
        """``auth TOKEN``: constant-time comparisons, so timing leaks nothing. The
        admin token passes wherever the lock token does, and marks the connection
        as an operator's. Without either token any token passes; with only an admin
        token, requests need no ``auth``, but an ``auth`` with any other token fails
        as a wrong one does (delayed, then closed), so guessing it stays slow."""
        service = self.service
        expected, admin = service.auth_token, service.admin_token
        if admin is not None and hmac.compare_digest(token, admin):
            self.admin = True
        elif expected is None:
            return admin is None
        elif not hmac.compare_digest(token, expected):
            return False
        self.commands = service.commands
        return True

    def close(self, now: float) -> None:
        """The connection is gone: its session follows its grace rule."""
        if self.watcher is not None:
            self.backend.books.watchers.remove(self.watcher)
            self.watcher = None
        if self in self.service.connections:
            self.service.connections.discard(self)
            self.service.named.pop(self, None)
            self.service.counters.connections -= 1
            self.service.backend.disconnect(self.session, now)


def _split_carefully(line: bytes) -> tuple[bytes, bytes]:
    """The verb and the rest of a line with outer blanks dropped; the verb ends at the
    first space or tab."""
    line = line.strip(b" \t")
    cut = line.find(b" ")
    tab = line.find(b"\t", 0, len(line) if cut < 0 else cut)
    if tab >= 0:
        cut = tab
    if cut < 0:
        return line, b""
    return line[:cut], line[cut + 1 :]
