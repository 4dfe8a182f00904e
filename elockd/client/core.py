"""The client's protocol logic, sans-IO: requests out, reply lines in, holds tracked.

Both clients (:mod:`elockd.client.trio_client` and :mod:`elockd.client.blocking`) are
thin I/O shells around one :class:`ClientCore`, so the rules live here once:

* **Pipelining.** :meth:`ClientCore.submit` appends the request to a FIFO and its
  bytes to the output buffer in one synchronous step; replies are matched to the
  FIFO's head as they arrive. Because submission never awaits, a request is either
  fully queued or not sent at all: there is no half-sent state to clean up. Cutting
  the received bytes into replies, strictly and in linear time, is
  :class:`~elockd.client.replies.ReplyReader`'s job.
* **Deadlines.** Every request gets a deadline (reply timeout plus the time it may
  wait on the server, chained behind the requests before it, since the server runs
  one connection's commands in order). :meth:`ClientCore.tick` fails the whole
  connection when the oldest reply is late: FIFO replies cannot skip one.
* **Leases.** Holds with a ``ttl`` are renewed at a third of it; a ``403`` to a
  renewal, a lease that reached its end without a confirmed renewal, or a dropped
  connection marks the hold lost.
* **Cancellation.** An operation that is interrupted after its request was queued
  queues the matching release right behind it (:meth:`Operation.abandon`). The server
  runs the two in order, so whatever the first one granted the second one frees:
  cancelling an acquire can never leave a hold behind.

Time is passed in by the caller (``trio.current_time()`` or ``time.monotonic()``).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from elockd.client.errors import (
    AuthError,
    ConnectionLost,
    KeyBusy,
    LockLost,
    ReplyTimeout,
    RequestError,
    Unavailable,
)
from elockd.client.replies import ReplyReader, cut_with, is_refusal

# Where they were first defined: elockctl and the tests import them from here.
from elockd.client.replies import printable as printable
from elockd.client.replies import quoted as quoted

T = TypeVar("T")

KeyLike = str | bytes
DEFAULT_REPLY_TIMEOUT = 10.0
DEFAULT_CONNECT_TIMEOUT = 5.0

#: Verbs whose reply is several lines ending in ``END`` (when not refused).
MULTILINE_VERBS = frozenset({b"stats", b"q", b"d", b"sd", b"dump", b"who", b"ls"})
#: The server's answers to a missing or wrong ``auth`` token.
AUTH_REFUSALS = frozenset({b"0 Auth Required", b"403 Auth Required", b"403 Bad Token"})
#: A word verb's answer when a cluster node cannot reach etcd: nothing was granted,
#: and nothing is known about the key.
BACKEND_UNAVAILABLE = b"409 Backend Unavailable"
#: What a terse probe's reply may say after its leading integer: the texts that mean
#: yes (integer above 0) and no (integer 0), each as elockd's whole text and the
#: start of glockd's (which goes on with the key). ``sg`` has no "no". Anything
#: else (``0 Auth Required``, ``0 Backend Unavailable``, ``0 Too Many Holds``, a
#: foreign line) answers neither.
Answer = tuple[bytes, bytes]
TERSE_ANSWERS: dict[bytes, tuple[Answer, Answer | None]] = {
    b"g": ((b"Got Lock", b"Lock Get Success: "), (b"Cannot Get Lock", b"Lock Get Failure: ")),
    b"r": (
        (b"Released Lock", b"Lock Release Success: "),
        (b"Cannot Release Lock", b"Lock Release Failure: "),
    ),
    b"i": ((b"Locked", b"Lock Is Locked: "), (b"Not Locked", b"Lock Not Locked: ")),
    b"sg": ((b"Got Lock", b"Shared Lock Get Success: "), None),
    b"sr": (
        (b"Released Lock", b"Shared Lock Release Success: "),
        (b"Cannot Release Lock", b"Shared Lock Release Failure: "),
    ),
    b"si": ((b"Locked", b"Shared Lock Is Locked: "), (b"Not Locked", b"Shared Lock Not Locked: ")),
}

_INFO = re.compile(
    rb"200 key=(?P<key>.*) exclusive=(?P<owner>.*) shared=(?P<shared>\d+)"
    rb" waiting=(?P<waiting>\d+) ttl=(?P<ttl>\S+) token=(?P<token>\S+)\Z"
)


class Settable(Protocol):
    """``trio.Event`` and ``threading.Event`` both fit: the shell picks one."""

    def set(self) -> None: ...


class Request:
    """One request in flight: its line, its deadline, and (once here) its reply.

    ``lines`` holds the reply without ``\\r\\n``; ``error`` is set instead when the
    connection failed first. ``on_reply`` lets the core act on replies nobody awaits
    (renewals).
    """

    __slots__ = (
        "arrived",
        "deadline",
        "done",
        "error",
        "event",
        "line",
        "lines",
        "multiline",
        "on_reply",
    )

    def __init__(
        self,
        line: bytes,
        deadline: float,
        event: Settable,
        on_reply: Callable[[Request], None] | None = None,
    ) -> None:
        self.line = line
        self.multiline = request_verb(line) in MULTILINE_VERBS
        self.deadline = deadline
        self.event = event
        self.on_reply = on_reply
        self.lines: list[bytes] = []
        self.error: ConnectionLost | None = None
        self.done = False
        self.arrived = math.inf  # when the reply came, in the caller's clock

    @property
    def reply(self) -> bytes:
        """The first reply line; raises the connection's error if it failed first."""
        if self.error is not None:
            raise self.error
        assert self.done, "reply read before it arrived"
        return self.lines[0]

    @property
    def code(self) -> int:
        """The reply's leading integer (-1 when there is none)."""
        head = self.reply.split(b" ", 1)[0]
        return int(head) if head.isdigit() else -1


def request_verb(line: bytes) -> bytes:
    """The verb of a request line, found the way the server finds it: a final ``\\r``
    and outer blanks dropped, the verb ending at the first space or tab.

    Whether a reply is one line or several depends on the verb alone, so reading
    ``" d"`` or ``"d\\tk"`` differently from the server would take one line of a
    multi-line reply as the whole of it and match every later reply to the wrong
    request.
    """
    if line.endswith(b"\r"):
        line = line[:-1]
    line = line.strip(b" \t")
    for cut, char in enumerate(line):
        if char in b" \t":
            return line[:cut]
    return line


class Hold:
    """A lock this client holds: one key, or several for ``mlock``.

    ``token`` is the fencing token of an exclusive hold (pass it to the resource you
    protect, which should refuse tokens older than the newest it saw); shared holds
    have none. ``lost`` turns True, and ``on_lost(hold)`` is called once, when the
    hold ends behind the holder's back; leaving its ``with`` block then raises
    :class:`LockLost`.
    """

    def __init__(
        self,
        keys: tuple[bytes, ...],
        *,
        shared: bool,
        ttl: float | None,
        tokens: dict[bytes, int],
        holders: int | None,
        on_lost: Callable[[Hold], object] | None,
    ) -> None:
        self.keys = keys
        self.shared = shared
        self.ttl = ttl
        self.tokens = tokens
        self.holders = holders
        self.on_lost = on_lost
        self.lost = False
        self.lost_reason: str | None = None
        # On the shell's clock (trio.current_time() or time.monotonic()): when the
        # loss was found, or when the renewal or release that found it was sent.
        self.lost_at: float | None = None
        self.released = False
        self.renewals = 0
        # Lease bookkeeping, in the caller's clock.
        self._expires_at = math.inf
        self._next_renew = math.inf
        self._renewing = 0  # renew requests in flight

    @property
    def key(self) -> bytes:
        return self.keys[0]

    @property
    def token(self) -> int | None:
        return self.tokens.get(self.keys[0])

    @property
    def held(self) -> bool:
        return not (self.lost or self.released)

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self.released else "held"
        kind = "shared" if self.shared else "exclusive"
        return f"<Hold {kind} {b' '.join(self.keys)!r} token={self.token} {state}>"

    def raise_if_lost(self) -> None:
        if self.lost:
            raise LockLost(f"lock {quoted(self.key)} lost: {self.lost_reason}", self)


@dataclass(frozen=True)
class LockInfo:
    """``info K``: who holds the key and how."""

    key: bytes
    owner: bytes | None  # the exclusive holder's name or IP:PORT
    shared: int
    waiting: int
    ttl: float | None
    token: int | None

    @property
    def locked(self) -> bool:
        return self.owner is not None


class Operation(Generic[T]):
    """Requests already queued, how to turn their replies into a result, and what to
    queue if the caller gives up before the result is in.

    ``abandon(now)`` takes the time of the giving up, not of the operation's start:
    the undo it queues gets its reply deadline from ``now``, and a start time from
    before a long wait would put that deadline in the past.
    """

    __slots__ = ("abandon", "finish", "requests")

    def __init__(
        self,
        requests: list[Request],
        finish: Callable[[], T],
        abandon: Callable[[float], None] | None = None,
    ) -> None:
        self.requests = requests
        self.finish = finish
        self.abandon = abandon or _abandon_nothing


def _nothing() -> None:
    return None


def _abandon_nothing(now: float) -> None:
    return None


def encode_key(key: KeyLike) -> bytes:
    """A word-family key is one token: bytes, no blanks, no line ends, not empty."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw or any(c in raw for c in b" \t\r\n"):
        raise ValueError(f"a key must be non-empty without blanks or line ends: {quoted(raw)}")
    return raw


def number(value: float, what: str) -> bytes:
    """Seconds in the plain decimal form the server parses (no sign, no exponent)."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be a finite number >= 0, not {value!r}")
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text.encode()


def _ttl(ttl: float | None) -> bytes:
    if ttl is None:
        return b""
    if not ttl >= 0.001:
        raise ValueError(f"ttl must be at least 0.001 s, not {ttl!r}")
    return b" ttl=" + number(ttl, "ttl")


class ClientCore:
    """One connection's protocol state. Not thread-safe: the blocking shell holds a
    lock around every call, the trio shell runs in one thread."""

    def __init__(
        self, make_event: Callable[[], Settable], reply_timeout: float = DEFAULT_REPLY_TIMEOUT
    ) -> None:
        self.make_event = make_event
        self.reply_timeout = reply_timeout
        self.pending: deque[Request] = deque()
        self.holds: dict[bytes, Hold] = {}  # every key this client holds or is acquiring
        self.error: ConnectionLost | None = None
        # The first request goes out after one blank, which elockd drops (leading
        # blanks of a line are, docs/protocol.md) and an HTTP/1.1 server (h11,
        # hypercorn, nginx) or a TLS port refuses at once: a client sent to the
        # wrong door hears so now, not after its reply timeout.
        self._out: list[bytes] = [b" "]
        self._replies = ReplyReader()
        self._lost: list[Hold] = []  # lost holds whose on_lost is still to be called
        self._busy: set[bytes] = set()  # keys with an acquire in flight

    # ------------------------------------------------------------ I/O side

    def submit(
        self,
        line: bytes,
        now: float,
        *,
        wait: float = 0.0,
        on_reply: Callable[[Request], None] | None = None,
    ) -> Request:
        """Queue a request; its reply is due ``wait`` + reply timeout after the
        server gets to it, which is after every request queued before it."""
        if self.error is not None:
            raise self.error
        start = now
        if self.pending:
            start = max(now, self.pending[-1].deadline - self.reply_timeout)
        request = Request(line, start + wait + self.reply_timeout, self.make_event(), on_reply)
        self.pending.append(request)
        self._out.append(line + b"\n")
        return request

    def data_to_send(self) -> bytes:
        if self._out == [b" "]:
            return b""  # the blank goes with the first request, never alone
        data = b"".join(self._out)
        self._out.clear()
        return data

    def receive(self, data: bytes, now: float) -> None:
        """Feed bytes from the server; completes requests in order.

        Bytes that are no reply of the protocol (a line without a leading integer, a
        bare ``\\n``, anything with no request waiting for it) fail the connection
        with :class:`ProtocolError`: the peer is not elockd, and reading its banner
        as an answer would turn "cannot tell" into "no".
        """
        self._replies.feed(data)
        try:
            while self.pending:
                request = self.pending[0]
                lines = self._replies.take_reply(request.multiline)
                if lines is None:
                    return
                self.pending.popleft()
                request.lines = lines
                request.arrived = now
                request.done = True
                if request.on_reply is not None:
                    request.on_reply(request)
                request.event.set()
            if self._replies.buffer:
                raise self._replies.unasked()
        except ConnectionLost as error:
            self.fail(error, now)

    def fail(self, error: ConnectionLost, now: float) -> None:
        """The connection is unusable: fail every request, lose every hold."""
        if self.error is not None:
            return
        self.error = error
        pending, self.pending = self.pending, deque()
        for request in pending:
            request.error = error
            request.done = True
            request.event.set()
        for hold in list(self.holds.values()):
            self.lose(hold, f"connection lost: {error}", now)
        self._out.clear()

    def take_lost(self) -> list[Hold]:
        """Holds lost since the last call: the shell calls their ``on_lost``."""
        lost, self._lost = self._lost, []
        return lost

    def lose(self, hold: Hold, reason: str, now: float) -> None:
        for key in hold.keys:
            if self.holds.get(key) is hold:
                del self.holds[key]
        if not hold.lost and not hold.released:
            hold.lost = True
            hold.lost_reason = reason
            hold.lost_at = now
            self._lost.append(hold)

    # ------------------------------------------------------------ timers

    def next_timer(self) -> float | None:
        """When :meth:`tick` has something to do next (None: nothing scheduled)."""
        when = self.pending[0].deadline if self.pending else math.inf
        for hold in self.holds.values():
            if hold.ttl is not None:
                when = min(when, hold._expires_at, hold._next_renew)
        return None if when == math.inf else when

    def tick(self, now: float) -> None:
        """Fail a connection whose oldest reply is late; renew leases that are due;
        give up leases whose end passed without a confirmed renewal."""
        if self.error is not None:
            return
        if self.pending and now >= self.pending[0].deadline:
            late = request_verb(self.pending[0].line).decode(errors="replace")
            self.fail(ReplyTimeout(f"no reply to {late!r} in time"), now)
            return
        for hold in list(dict.fromkeys(self.holds.values())):
            if hold.ttl is None:
                continue
            if now >= hold._expires_at:
                self.lose(hold, "lease ran out before a renewal was confirmed", now)
            elif now >= hold._next_renew and not hold._renewing:
                self._renew(hold, now)

    def _renew(self, hold: Hold, now: float) -> None:
        assert hold.ttl is not None
        ttl = hold.ttl
        hold._next_renew = math.inf
        hold._renewing = len(hold.keys)
        for key in hold.keys:
            self.submit(
                b"renew %s%s" % (key, _ttl(ttl)), now, on_reply=self._renewed(hold, now, ttl)
            )

    def _renewed(self, hold: Hold, sent_at: float, ttl: float) -> Callable[[Request], None]:
        def on_reply(request: Request) -> None:
            hold._renewing -= 1
            if request.reply != b"200 Renewed":
                reason = request.reply.decode(errors="replace")
                self.lose(hold, f"renewal refused ({reason})", sent_at)
                return
            if hold._renewing == 0 and hold.held:
                hold.renewals += 1
                # The server's new deadline is at least sent_at + ttl.
                hold._expires_at = sent_at + ttl
                hold._next_renew = sent_at + ttl / 3

        return on_reply

    # ------------------------------------------------------------ operations

    def _claim(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        for key in keys:
            if key in self.holds or key in self._busy:
                raise KeyBusy(f"this client already holds or is acquiring {quoted(key)}")
        if self.error is not None:
            raise self.error
        self._busy.update(keys)

    def _track(self, hold: Hold, request: Request, submitted: float, waited: bool) -> None:
        """Start tracking (and renewing) a granted hold.

        A try-once grant happened after submission, so the lease is counted from
        there (early, hence safe). A grant after a wait happened just before its
        reply arrived; it is counted from the arrival and renewed at once, which
        pins the lease end down to a time the client knows.
        """
        for key in hold.keys:
            self.holds[key] = hold
        if hold.ttl is not None:
            base = request.arrived if waited else submitted
            hold._expires_at = base + hold.ttl
            hold._next_renew = base if waited else base + hold.ttl / 3

    def lock(
        self,
        key: KeyLike,
        now: float,
        wait: float | None,
        ttl: float | None,
        on_lost: Callable[[Hold], object] | None,
    ) -> Operation[Hold]:
        """``lock K [WAIT] [ttl=S]`` pipelined with ``token K``."""
        raw = encode_key(key)
        waiting = number(wait, "wait") if wait else b""
        line = b"lock %s%s%s" % (raw, b" " + waiting if waiting else b"", _ttl(ttl))
        self._claim([raw])
        try:
            lock = self.submit(line, now, wait=wait or 0.0)
            token = self.submit(b"token %s" % raw, now)
        except BaseException:
            self._busy.discard(raw)
            raise

        def finish() -> Hold:
            self._busy.discard(raw)
            if not_granted(lock):
                raise Unavailable(f"lock {quoted(raw)} unavailable")
            _expect(lock, b"200 Acquired")
            if token.code != 200:
                # Lost between the two requests (a lease shorter than a round trip).
                raise LockLost(
                    f"lock {quoted(raw)} lost right after the grant: {quoted(token.reply)}"
                )
            hold = Hold(
                (raw,),
                shared=False,
                ttl=ttl,
                tokens={raw: int(token.reply.split()[1])},
                holders=None,
                on_lost=on_lost,
            )
            self._track(hold, lock, now, bool(wait))
            return hold

        def abandon(at: float) -> None:
            self._busy.discard(raw)
            if self.error is None:
                self.submit(b"unlock %s" % raw, at)

        return Operation([lock, token], finish, abandon)

    def shared(
        self,
        key: KeyLike,
        now: float,
        limit: int | None,
        wait: float | None,
        ttl: float | None,
        on_lost: Callable[[Hold], object] | None,
    ) -> Operation[Hold]:
        """``lock_shared K [WAIT] [limit=N] [ttl=S]``."""
        raw = encode_key(key)
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be a whole number >= 1, not {limit!r}")
        waiting = number(wait, "wait") if wait else b""
        line = b"lock_shared %s%s%s%s" % (
            raw,
            b" " + waiting if waiting else b"",
            b"" if limit is None else b" limit=%d" % limit,
            _ttl(ttl),
        )
        self._claim([raw])
        try:
            request = self.submit(line, now, wait=wait or 0.0)
        except BaseException:
            self._busy.discard(raw)
            raise

        def finish() -> Hold:
            self._busy.discard(raw)
            code = request.code
            if not_granted(request):
                holders = int(request.reply.split()[1])
                raise Unavailable(
                    f"shared lock {quoted(raw)} full ({holders} holders)", holders=holders
                )
            if code != 200:
                raise refusal(request)
            holders = int(request.reply.split()[1])
            hold = Hold((raw,), shared=True, ttl=ttl, tokens={}, holders=holders, on_lost=on_lost)
            self._track(hold, request, now, bool(wait))
            return hold

        def abandon(at: float) -> None:
            self._busy.discard(raw)
            if self.error is None:
                self.submit(b"unlock_shared %s" % raw, at)

        return Operation([request], finish, abandon)

    def mlock(
        self,
        keys: Sequence[KeyLike],
        now: float,
        wait: float | None,
        ttl: float | None,
        on_lost: Callable[[Hold], object] | None,
    ) -> Operation[Hold]:
        """``mlock K1 K2 … [wait=S] [ttl=S]``, all or nothing, plus a token per key."""
        raws = tuple(dict.fromkeys(encode_key(k) for k in keys))
        if not raws:
            raise ValueError("mlock needs at least one key")
        if any(b"=" in raw for raw in raws):
            raise ValueError("mlock keys cannot contain '=' (it marks options)")
        line = b"mlock %s%s%s" % (
            b" ".join(raws),
            b" wait=" + number(wait, "wait") if wait else b"",
            _ttl(ttl),
        )
        self._claim(raws)
        try:
            request = self.submit(line, now, wait=wait or 0.0)
            tokens = [self.submit(b"token %s" % raw, now) for raw in raws]
        except BaseException:
            self._busy.difference_update(raws)
            raise

        def finish() -> Hold:
            self._busy.difference_update(raws)
            if not_granted(request):
                held = tuple(request.reply.split()[2:])
                raise Unavailable(f"mlock unavailable: {quoted(b' '.join(held))} held", keys=held)
            _expect(request, b"200 Acquired")
            values: dict[bytes, int] = {}
            for raw, token in zip(raws, tokens, strict=True):
                if token.code != 200:
                    raise LockLost(
                        f"lock {quoted(raw)} lost right after the grant: {quoted(token.reply)}"
                    )
                values[raw] = int(token.reply.split()[1])
            hold = Hold(raws, shared=False, ttl=ttl, tokens=values, holders=None, on_lost=on_lost)
            self._track(hold, request, now, bool(wait))
            return hold

        def abandon(at: float) -> None:
            self._busy.difference_update(raws)
            if self.error is None:
                for raw in raws:
                    self.submit(b"unlock %s" % raw, at)

        return Operation([request, *tokens], finish, abandon)

    def release(self, hold: Hold, now: float) -> Operation[None]:
        """Free a hold. A hold found lost raises :class:`LockLost` instead."""
        if hold.released:
            return Operation([], _nothing)
        if hold.lost:
            hold.released = True
            return Operation([], hold.raise_if_lost)
        for key in hold.keys:
            if self.holds.get(key) is hold:
                del self.holds[key]
        hold.released = True  # stops renewal; from here on the hold cannot be "lost"
        if self.error is not None:
            hold.released = False
            self.lose(hold, f"connection lost: {self.error}", now)
            return Operation([], hold.raise_if_lost)
        verb = b"unlock_shared" if hold.shared else b"unlock"
        requests = [self.submit(b"%s %s" % (verb, key), now) for key in hold.keys]

        def finish() -> None:
            refused = [r for r in requests if r.error is None and r.code != 200]
            failed = next((r.error for r in requests if r.error is not None), None)
            if refused or failed:
                hold.released = False
                reason = (
                    f"it was no longer held at release ({refused[0].reply.decode()})"
                    if refused
                    else f"connection lost before the release was confirmed: {failed}"
                )
                self.lose(hold, reason, now)
                hold.raise_if_lost()
            if hold.shared and requests:
                hold.holders = int(requests[0].reply.split()[1])

        return Operation(requests, finish)

    def simple(
        self, line: bytes, now: float, parse: Callable[[Request], T], *, wait: float = 0.0
    ) -> Operation[T]:
        """One request, one result (``ping``, ``info``, ``throttle``…); ``wait``, the
        seconds the server may keep it waiting, is added to its reply deadline."""
        request = self.submit(line, now, wait=wait)
        return Operation([request], lambda: parse(request))

    def close_holds(self, reason: str, now: float) -> None:
        """The client is closing: every hold still tracked is reported lost."""
        for hold in list(self.holds.values()):
            self.lose(hold, reason, now)


def not_granted(request: Request) -> bool:
    """A ``409`` that says "held by others, not granted within the wait". ``409
    Backend Unavailable`` (a cluster node without etcd quorum) is no such answer:
    nobody knows whether the key is free, so it raises as a refusal instead, and a
    cron guard never reads it as "busy, skip this run"."""
    return request.code == 409 and request.reply != BACKEND_UNAVAILABLE


def refusal(request: Request) -> RequestError:
    """The error for a reply that is no answer: :class:`AuthError` or :class:`RequestError`."""
    reply = request.reply
    message = f"{printable(request_verb(request.line))}: {printable(reply)}"
    if reply in AUTH_REFUSALS or reply.startswith(b"403 Bad Token"):
        return AuthError(message, reply)
    return RequestError(message, reply)


def _expect(request: Request, wanted: bytes) -> None:
    if request.reply != wanted:
        raise refusal(request)


# ---------------------------------------------------------------- reply parsers


def parse_ok(wanted: bytes) -> Callable[[Request], None]:
    def parse(request: Request) -> None:
        _expect(request, wanted)

    return parse


def parse_word(request: Request) -> bytes:
    """The text after ``200 `` (``conn_id``)."""
    if request.code != 200:
        raise refusal(request)
    return request.reply[4:]


def parse_resume(request: Request) -> bool:
    if request.reply == b"200 conn id set":
        return True
    if request.reply == b"403 cannot set conn id":
        return False
    raise refusal(request)


def parse_info(request: Request) -> LockInfo:
    match = _INFO.match(request.reply)
    if match is None:
        raise refusal(request)
    owner, ttl, token = match["owner"], match["ttl"], match["token"]
    return LockInfo(
        key=match["key"],
        owner=None if owner == b"-" else owner,
        shared=int(match["shared"]),
        waiting=int(match["waiting"]),
        ttl=None if ttl == b"-" else float(ttl),
        token=None if token == b"-" else int(token),
    )


def parse_stats(request: Request) -> dict[str, int]:
    """``stats``: ``200 STATS``, ``STAT name value`` lines, ``END``."""
    if request.reply != b"200 STATS":
        raise refusal(request)
    values: dict[str, int] = {}
    for line in request.lines[1:-1]:
        _, name, value = line.decode().split(" ", 2)
        values[name] = int(value)
    return values


def parse_lines(request: Request) -> list[bytes]:
    """A raw reply (one line, or every line of a multi-line reply but ``END``)."""
    lines = list(request.lines)
    if request.error is not None:
        raise request.error
    if request.multiline and lines and lines[-1] == b"END":
        lines.pop()
    return lines


def parse_checked(request: Request) -> list[bytes]:
    """:func:`parse_lines`, but an auth refusal raises :class:`AuthError`, and a refusal of a
    listing or cutting it (:func:`cut_with`), or a terse probe's other lines, RequestError."""
    reply = request.reply
    verb = request_verb(request.line)
    if reply in AUTH_REFUSALS or (request.multiline and is_refusal(reply)):
        raise refusal(request)
    if verb in TERSE_ANSWERS and terse_answer(verb, reply) is None:
        raise refusal(request)
    if request.multiline and (cut := cut_with(request.lines)) is not None:
        raise RequestError(f"{printable(verb)}: {printable(cut)}", cut)
    return parse_lines(request)


def terse_answer(verb: bytes, reply: bytes) -> int | None:
    """A terse probe's leading integer (0 means no) when ``reply`` is one of the
    answers :data:`TERSE_ANSWERS` lists for ``verb``; None for any other line."""
    count, _, text = reply.partition(b" ")
    if not count.isdigit():
        return None
    yes, no = TERSE_ANSWERS[verb]
    answer = yes if int(count) > 0 else no
    if answer is None or not (text == answer[0] or text.startswith(answer[1])):
        return None
    return int(count)


def auth_line(token: str | bytes) -> bytes:
    raw = (token.encode() if isinstance(token, str) else bytes(token)).strip()
    if not raw or b"\n" in raw or b"\r" in raw:
        raise ValueError("auth token must be one non-empty line")
    return b"auth " + raw


def raw_line(line: str | bytes) -> bytes:
    raw = line.encode() if isinstance(line, str) else bytes(line)
    if b"\n" in raw:
        raise ValueError("a request is one line")
    return raw
