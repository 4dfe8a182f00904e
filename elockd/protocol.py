"""Sans-IO request handling: a request line in, a reply (or a wait) out.

A :class:`Connection` is one client's view of the lock service. The server feeds it
the lines that :class:`elockd.framing.LineReader` cut from the socket and writes
back what it returns; nothing here touches a socket or a clock, so every reply of
PROTOCOL.md is a one-line unit test. Requests that wait return a :class:`Pending`,
which the server awaits and then asks for its final reply; multi-line replies that
grow with the tables return a :class:`Streamed`, which the server sends a chunk at a
time, as fast as the client reads.

One table (:data:`COMMANDS`, built from :mod:`elockd.terse` and :mod:`elockd.word`)
maps each verb to its handler; the dispatcher counts the verb, then calls it.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable, Iterator

from elockd.backend import BackendUnavailable as BackendUnavailable
from elockd.backend import QueueFull as QueueFull
from elockd.backend import TooManyHolds as TooManyHolds
from elockd.config import Config
from elockd.locks import LockEngine, Waiter
from elockd.logs import log_refusal
from elockd.replies import STYLES, TerseReplies
from elockd.stats import Backend, Counters, Timings, snapshot

LINE_TOO_LONG = b"0 Line Too Long\r\n"
TERSE_AUTH_REQUIRED = b"0 Auth Required\r\n"
WORD_AUTH_REQUIRED = b"403 Auth Required\r\n"
TERSE_TOO_MANY_HOLDS = b"0 Too Many Holds\r\n"
WORD_TOO_MANY_HOLDS = b"413 Too Many Holds\r\n"
INVALID_VERB_SHOWN = 64  # bytes of an unknown verb echoed back


class BadRequest(Exception):
    """Raised by a word handler for bad arguments; becomes ``400 Bad Request: …``."""


TERSE_UNAVAILABLE = b"0 Backend Unavailable\r\n"
WORD_UNAVAILABLE = b"409 Backend Unavailable\r\n"


class Pending:
    """A request that waits for a grant, at most ``timeout`` seconds.

    The engine keeps the deadline (so 10,000 waits that end together are timed out
    a slice at a time, not all in one scheduler batch) and calls ``waiter.wake`` on
    the grant or the timeout; the server points that at an event, waits for it, then
    calls :meth:`finish` for the reply. Finishing a waiter that still waits (its
    client went away) cancels it and counts a timeout, so a waiter that gave up can
    never be granted later.
    """

    __slots__ = ("connection", "on_granted", "on_refused", "timeout", "waiter")

    def __init__(
        self,
        connection: Connection,
        waiter: Waiter,
        timeout: float,
        on_granted: Callable[[], bytes],
        on_refused: Callable[[list[bytes]], bytes],
    ) -> None:
        self.connection = connection
        self.waiter = waiter
        self.timeout = timeout
        self.on_granted = on_granted
        self.on_refused = on_refused

    def finish(self, now: float) -> bytes:
        waiter = self.waiter
        if waiter.granted:
            return self.on_granted()
        engine = self.connection.service.engine
        if waiter.waiting:
            return self.on_refused(engine.cancel(waiter, now, timed_out=True))
        return self.on_refused(engine.blocked_keys(waiter))  # the engine timed it out


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


class Deferred:
    """A reply that needs the backend's I/O first (the etcd backend): the server
    awaits :meth:`settle`. ``waits`` marks requests that may wait for a grant, which
    the server abandons when the peer goes away."""

    __slots__ = ("run", "waits", "word")

    def __init__(
        self,
        run: Callable[[], Awaitable[bytes | Streamed]],
        *,
        word: bool,
        waits: bool = False,
    ):
        self.run = run
        self.word = word
        self.waits = waits

    async def settle(self) -> bytes | Streamed:
        try:
            return await self.run()
        except BackendUnavailable:
            return WORD_UNAVAILABLE if self.word else TERSE_UNAVAILABLE
        except TooManyHolds:
            log_refusal("--max-holds")
            return WORD_TOO_MANY_HOLDS if self.word else TERSE_TOO_MANY_HOLDS


Reply = bytes | Pending | Deferred | Streamed | Delayed
Handler = Callable[["Connection", bytes, float], Reply]


class Service:
    """What every connection shares: the engine, the counters, the settings."""

    def __init__(
        self,
        config: Config,
        engine: LockEngine,
        auth_token: bytes | None = None,
        *,
        backend: Backend | None = None,
        commands: dict[bytes, Handler] | None = None,
    ) -> None:
        """``engine`` answers the lock verbs of the default command table. A cluster
        node passes its ``backend`` and the ``commands`` that use it; ``engine``
        then only stands idle."""
        from elockd.commands import COMMANDS, WORD_VERBS

        self.config = config
        self.engine = engine
        self.backend: Backend = engine if backend is None else backend
        self.commands: dict[bytes, Handler] = COMMANDS if commands is None else commands
        # Runs beside the listeners for the server's lifetime (the cluster's watch
        # and keepalives), started before the first connection is accepted.
        self.background: Callable[..., Awaitable[None]] | None = None
        self.word_verbs = WORD_VERBS
        self.replies: TerseReplies = STYLES[config.replies]
        self.counters = Counters(list(COMMANDS))
        # Wait and hold times for /metrics; the engine feeds them only once a
        # metrics registry asks for them (feed_timings), so without a metrics port
        # no release pays for the hook.
        self.timings = Timings()
        self.connections: set[Connection] = set()
        # Connections that set a name with `iam`, oldest naming first (for `who`).
        self.named: dict[Connection, None] = {}
        self.auth_token = auth_token
        # Before `auth` succeeds a connection dispatches through this table, where
        # every verb but `auth` is refused: no per-request check on the hot path.
        self.unauthenticated_commands: dict[bytes, Handler] = {
            verb: _refuse_word if verb in WORD_VERBS else _refuse_terse for verb in self.commands
        }
        self.unauthenticated_commands[b"auth"] = self.commands[b"auth"]

    def feed_timings(self) -> None:
        """Point the engine's wait and hold hooks at :attr:`timings` (unless the
        caller wired its own)."""
        engine = self.backend
        if engine.on_wait_end is None:
            engine.on_wait_end = self.timings.wait_ended
        if engine.on_hold_end is None:
            engine.on_hold_end = self.timings.hold_ended
            engine.on_holds_end = self.timings.holds_ended

    def snapshot(self) -> dict[str, int]:
        return snapshot(self.backend, self.counters)

    def new_session_id(self) -> str:
        """128 random bits from the OS CSPRNG: a session id is a bearer secret."""
        return secrets.token_hex(16)


class Connection:
    """One client connection: its session, its name, and request dispatch."""

    __slots__ = (
        "abort",
        "closing",
        "command_counts",
        "commands",
        "engine",
        "peer",
        "replies",
        "service",
        "session",
    )

    def __init__(self, service: Service, peer: bytes) -> None:
        self.service = service
        self.engine = service.engine
        self.replies = service.replies
        self.peer = peer
        self.session = service.backend.open_session(service.new_session_id(), peer)
        self.session.grace = service.config.grace
        self.closing = False  # set by `quit` and a failed `auth`: close after this reply
        # Set by the server: ends this connection (the backend lost its session).
        self.abort: Callable[[], None] | None = None
        self.command_counts = service.counters.commands
        self.commands = (
            service.commands if service.auth_token is None else service.unauthenticated_commands
        )
        service.connections.add(self)
        service.counters.connections += 1

    def handle(self, line: bytes | None, now: float) -> Reply:
        """Answer one request line (None stands for an over-long line).

        This runs once per request, so the common shape (``verb`` or ``verb args``
        with single spaces) is split with one ``partition``; anything else (leading
        blanks, tabs, unknown verbs) takes :meth:`_split_carefully`.
        """
        if line is None:
            self.service.counters.invalid_commands += 1
            return LINE_TOO_LONG
        if line[-1:] == b"\r":
            line = line[:-1]
        verb, _, rest = line.partition(b" ")
        handler = self.commands.get(verb)
        if handler is None:
            verb, rest = _split_carefully(line)
            handler = self.commands.get(verb)
            if handler is None:
                self.service.counters.invalid_commands += 1
                return b"0 Invalid Command: %s\r\n" % verb[:INVALID_VERB_SHOWN]
        self.command_counts[verb] += 1
        try:
            return handler(self, rest, now)
        except BadRequest as error:
            return b"400 Bad Request: %s\r\n" % str(error).encode()
        except TooManyHolds:
            log_refusal("--max-holds", self.peer)
            if verb in self.service.word_verbs:
                return WORD_TOO_MANY_HOLDS
            return TERSE_TOO_MANY_HOLDS

    def check_token(self, token: bytes) -> bool:
        """``auth TOKEN``: constant-time comparison, so timing leaks nothing."""
        expected = self.service.auth_token
        if expected is None:
            return True
        if not hmac.compare_digest(token, expected):
            return False
        self.commands = self.service.commands
        return True

    def close(self, now: float) -> None:
        """The connection is gone: its session follows its grace rule."""
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


def _refuse_terse(conn: Connection, rest: bytes, now: float) -> Reply:
    return TERSE_AUTH_REQUIRED


def _refuse_word(conn: Connection, rest: bytes, now: float) -> Reply:
    return WORD_AUTH_REQUIRED
