"""The word family: elock's verbs and this project's extensions.

Each handler gets the request's arguments already split by the verb's declaration
(:mod:`elockd.protocol.commands`; a bad argument is a ``400`` before the handler runs),
validates what the declaration cannot (numbers, a missing key), asks the backend
one question, and formats the answer, now or once it comes
(:func:`elockd.protocol.connection.answer`). A bad request changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from elockd.backend.interface import Evicted, Grant, KeyInfo, KeyRows
from elockd.engine.gcra import Rate, Verdict, milliseconds
from elockd.engine.sessions import Session
from elockd.engine.watchers import TooManyWatchers, snapshot
from elockd.protocol.arguments import (
    Args,
    BadRequest,
    parse_number,
    parse_seconds,
    parse_whole,
)
from elockd.protocol.connection import WORD, Delayed, Reply, Streamed, answer
from elockd.protocol.replies import chunked
from elockd.protocol.stats import render_stats

if TYPE_CHECKING:
    from elockd.protocol.connection import Connection

ACQUIRED = b"200 Acquired\r\n"
UNAVAILABLE = b"409 Unavailable\r\n"
UNLOCKED = b"200 Unlocked\r\n"
NOT_LOCKED = b"403 Not Locked\r\n"
TOO_MANY_KEYS = b"413 Too Many Keys\r\n"
CONN_ID_REFUSED = b"403 cannot set conn id\r\n"

#: The options each verb takes (the table in :mod:`elockd.protocol.commands` declares them).
TTL_OPTION = frozenset({b"ttl"})
SHARED_OPTIONS = frozenset({b"limit", b"ttl"})
MLOCK_OPTIONS = frozenset({b"wait", b"ttl"})
THROTTLE_OPTIONS = frozenset({b"burst", b"cost", b"wait"})
LS_OPTIONS = frozenset({b"older", b"limit"})

FORBIDDEN = b"403 Forbidden\r\n"
#: The line after the ``limit=N`` rows of ``ls`` when more keys match.
MORE = "… more\r\n".encode()


def cmd_lock(conn: Connection, args: Args, now: float) -> Reply:
    """``lock K [WAIT] [ttl=S]``: WAIT 0 (or none) tries once."""
    key = args.key()
    wait = args.seconds(1, "WAIT") or 0.0
    ttl = args.option_seconds(b"ttl")
    result = conn.backend.lock(conn.session, [key], now, wait=wait, ttl=ttl)
    return answer(result, acquired_or_not, WORD, conn.peer)


def acquired_or_not(grant: Grant) -> bytes:
    return ACQUIRED if grant.granted else UNAVAILABLE


def cmd_unlock(conn: Connection, args: Args, now: float) -> Reply:
    result = conn.backend.release(conn.session, args.key(), now)
    return answer(result, lambda freed: UNLOCKED if freed else NOT_LOCKED, WORD, conn.peer)


def cmd_unlock_all(conn: Connection, args: Args, now: float) -> Reply:
    result = conn.backend.release_all(conn.session, now)
    return answer(result, lambda _: b"200 OK\r\n", WORD, conn.peer)


def cmd_conn_id(conn: Connection, args: Args, now: float) -> Reply:
    if not args.positional:
        return b"200 %s\r\n" % conn.session.id.encode()
    wanted = args.positional[0].decode("ascii", errors="replace")

    def moved(session: Session | None) -> bytes:
        if session is None:
            return CONN_ID_REFUSED
        conn.adopt(session)
        return b"200 conn id set\r\n"

    return answer(conn.backend.take_over(wanted, conn.session), moved, WORD, conn.peer)


def cmd_set_timeout(conn: Connection, args: Args, now: float) -> Reply:
    if not args.positional:
        raise BadRequest("missing MS")
    grace = parse_number(args.positional[0], "MS") / 1000
    if grace > conn.service.config.max_ttl:
        raise BadRequest(f"MS above --max-ttl ({conn.service.config.max_ttl:g} s)")
    conn.session.grace = grace
    return b"200 timeout set\r\n"


def cmd_stats(conn: Connection, args: Args, now: float) -> Reply:
    return render_stats(conn.service.snapshot(), len(conn.service.connections))


def cmd_quit(conn: Connection, args: Args, now: float) -> Reply:
    conn.closing = True
    return b"200 Bye\r\n"


def cmd_lock_shared(conn: Connection, args: Args, now: float) -> Reply:
    """``lock_shared K [WAIT] [limit=N] [ttl=S]``: without a limit it never waits."""
    key = args.key()
    wait = args.seconds(1, "WAIT") or 0.0
    limit = args.limit()
    ttl = args.option_seconds(b"ttl")
    result = conn.backend.lock_shared(
        conn.session, key, now, limit=limit, wait=wait if limit is not None else 0.0, ttl=ttl
    )
    return answer(result, holders_after, WORD, conn.peer)


def holders_after(grant: Grant) -> bytes:
    return b"%d %d\r\n" % (200 if grant.granted else 409, grant.count)


def cmd_unlock_shared(conn: Connection, args: Args, now: float) -> Reply:
    result = conn.backend.release_shared(conn.session, args.key(), now)
    return answer(
        result, lambda left: NOT_LOCKED if left is None else b"200 %d\r\n" % left, WORD, conn.peer
    )


def cmd_mlock(conn: Connection, args: Args, now: float) -> Reply:
    """``mlock K1 K2 ... [wait=S] [ttl=S]``: all or nothing, never deadlocks."""
    keys = list(dict.fromkeys(args.positional))
    if not keys:
        raise BadRequest("missing key")
    wait_option = args.options.get(b"wait")
    wait = 0.0 if wait_option is None else parse_seconds(wait_option, "wait", args.max_seconds)
    ttl = args.option_seconds(b"ttl")
    if len(keys) > conn.service.config.max_keys:
        conn.service.reports.refusal("--max-keys", conn.peer)
        return TOO_MANY_KEYS
    result = conn.backend.lock(conn.session, keys, now, wait=wait, ttl=ttl)
    return answer(result, acquired_or_keys, WORD, conn.peer)


def acquired_or_keys(grant: Grant) -> bytes:
    if grant.granted:
        return ACQUIRED
    return b"409 Unavailable %s\r\n" % b" ".join(grant.blocked)


def cmd_renew(conn: Connection, args: Args, now: float) -> Reply:
    """``renew K ttl=S``: this session's hold of K (exclusive, else shared) becomes a
    lease ending S seconds from now."""
    key = args.key()
    ttl = args.option_seconds(b"ttl")
    if ttl is None:
        raise BadRequest("missing ttl")
    return b"200 Renewed\r\n" if conn.backend.renew(conn.session, key, now, ttl) else NOT_LOCKED


def cmd_token(conn: Connection, args: Args, now: float) -> Reply:
    token = conn.backend.token(conn.session, args.key())
    return NOT_LOCKED if token is None else b"200 %d\r\n" % token


def cmd_info(conn: Connection, args: Args, now: float) -> Reply:
    key = args.key()

    def line(found: KeyInfo) -> bytes:
        return b"200 key=%s exclusive=%s shared=%d waiting=%d ttl=%s token=%s\r\n" % (
            key,
            b"-" if found.owner is None else found.owner,
            found.shared,
            found.waiting,
            b"-" if found.ttl is None else b"%.3f" % found.ttl,
            b"-" if found.token is None else b"%d" % found.token,
        )

    return answer(conn.backend.info(key, now), line, WORD, conn.peer)


def cmd_throttle_line(conn: Connection, rest: bytes, now: float) -> Reply:
    """The table's handler for ``throttle`` (it takes the rest of the line): the
    common shape, ``K COUNT PERIOD`` in whole numbers, is parsed with one split,
    since a fleet of rate-limited workers asks it as often as ``g``; every other
    shape goes through the declared arguments (:func:`cmd_throttle`), whose 400
    reasons it shares."""
    parts = rest.split(b" ")
    # A tab in the key splits it in the declared arguments (Args): not this shape.
    if len(parts) == 3 and parts[0] and b"\t" not in parts[0]:
        key, count, period = parts
        rates = conn.service.throttle_rates
        rate = rates.get((count, period))
        if rate is None and (rate := plain_rate(count, period, conn.service.config.max_ttl)):
            if len(rates) >= RATES_KEPT:
                rates.clear()
            rates[count, period] = rate
        if rate is not None:
            result = conn.backend.throttle(conn.session, key, now, rate, wait=0.0)
            if result.__class__ is Verdict:
                return throttle_line(result)
            return answer(result, throttle_line, WORD, conn.peer)
    args = Args(rest, THROTTLE_OPTIONS, 3, conn.service.config.max_ttl)
    return cmd_throttle(conn, args, now)


#: How many (COUNT, PERIOD) spellings the service keeps parsed: a fleet asks a few
#: rates over and over; a client sending new ones only empties the cache.
RATES_KEPT = 256


def plain_rate(count: bytes, period: bytes, most: float) -> Rate | None:
    """``COUNT PERIOD`` in whole numbers, as the declared arguments would read them
    (None for any other spelling, which those then read or refuse)."""
    if not (count.isdigit() and period.isdigit() and len(count) + len(period) < 16):
        return None
    calls, seconds = int(count), int(period)
    if not calls or not 0 < seconds <= most:
        return None
    return Rate(calls, float(seconds), calls, 1)


def cmd_throttle(conn: Connection, args: Args, now: float) -> Reply:
    """``throttle K COUNT PERIOD [burst=B] [cost=N] [wait=S]``: admitted or not by
    the GCRA (docs/rate-limits.md); COUNT, PERIOD, B and N are this request's own."""
    key = args.key()
    if len(args.positional) < 3:
        raise BadRequest("missing COUNT PERIOD" if len(args.positional) < 2 else "missing PERIOD")
    count = parse_whole(args.positional[1], "COUNT", 1)
    period = parse_seconds(args.positional[2], "PERIOD", args.max_seconds)
    if period <= 0:
        raise BadRequest("PERIOD must be above 0")
    options = args.options
    burst = count if b"burst" not in options else parse_whole(options[b"burst"], "burst", 1)
    cost = 1 if b"cost" not in options else parse_whole(options[b"cost"], "cost", 0)
    if cost > burst:
        raise BadRequest("cost above burst")
    wait_option = options.get(b"wait")
    wait = 0.0 if wait_option is None else parse_seconds(wait_option, "wait", args.max_seconds)
    result = conn.backend.throttle(
        conn.session, key, now, Rate(count, period, burst, cost), wait=wait
    )
    return answer(result, throttle_line, WORD, conn.peer)


def throttle_line(verdict: Verdict) -> bytes:
    """``200 limit=B remaining=R reset=MS`` or ``409 limit=B remaining=0 retry=MS reset=MS``."""
    if verdict.admitted:
        return b"200 limit=%d remaining=%d reset=%d\r\n" % (
            verdict.limit,
            verdict.remaining,
            milliseconds(verdict.reset),
        )
    return b"409 limit=%d remaining=0 retry=%d reset=%d\r\n" % (
        verdict.limit,
        max(1, milliseconds(verdict.retry)),
        milliseconds(verdict.reset),
    )


def cmd_ls(conn: Connection, args: Args, now: float) -> Reply:
    """``ls [PREFIX] [older=S] [limit=N]``: a line per key with a hold or a waiter,
    sorted, streamed like ``d``. ``ls older=S`` (no prefix) is read as the option, not
    as a prefix: the one place a first word with ``=`` is not a key."""
    prefix = b""
    if args.positional:
        first = args.positional[0]
        name, equals, value = first.partition(b"=")
        if equals and name in LS_OPTIONS:
            if name in args.options:
                raise BadRequest(f"option {name.decode()} given twice")
            args.options[name] = value
        else:
            prefix = first
    older_option = args.options.get(b"older")
    older = None if older_option is None else parse_number(older_option, "older")
    limit = args.limit()
    rows = conn.backend.listing(
        prefix, now, older=older, limit=None if limit is None else limit + 1
    )
    return answer(rows, lambda found: Streamed(_ls_chunks(found, limit)), WORD, conn.peer)


def _ls_chunks(rows: KeyRows, limit: int | None) -> Iterator[bytes]:
    """The rows as lines, chunked as ``d`` is, then ``END``; after ``limit`` rows,
    ``… more`` if another one came. A stretch of keys left out (a None row) sends
    the chunk so far, possibly empty, so other connections run."""
    return chunked(_ls_lines(rows, limit))


def _ls_lines(rows: KeyRows, limit: int | None) -> Iterator[bytes]:
    listed = 0
    for row in rows:
        if row is None:
            yield b""
            continue
        if listed == limit:
            yield MORE
            return
        listed += 1
        yield b"%s exclusive=%s shared=%d waiting=%d age=%s token=%s ttl=%s\r\n" % (
            row.key,
            b"-" if row.owner is None else row.owner,
            row.shared,
            row.waiting,
            b"-" if row.age is None else b"%.3f" % row.age,
            b"-" if row.token is None else b"%d" % row.token,
            b"-" if row.ttl is None else b"%.3f" % row.ttl,
        )


def cmd_kill(conn: Connection, args: Args, now: float) -> Reply:
    """``kill K``: an operator frees every hold on K (only a connection that passed
    ``auth`` with the ``--admin-token-file`` token). Logged at warning, with the
    admin's peer and every evicted owner."""
    if not conn.admin:  # before anything else: a non-operator learns nothing
        return FORBIDDEN
    key = args.key()
    reports, peer = conn.service.reports, conn.peer

    def killed(evicted: list[Evicted]) -> bytes:
        reports.kill(peer, key, evicted)
        return b"200 Killed %d\r\n" % len(evicted)

    return answer(conn.backend.kill(key, now), killed, WORD, conn.peer)


def cmd_ping(conn: Connection, args: Args, now: float) -> Reply:
    return b"200 PONG\r\n"


def cmd_auth(conn: Connection, rest: bytes, now: float) -> Reply:
    """``auth TOKEN`` (the token is the rest of the line). A wrong token is reported
    with the peer (the server logs it) and answered only after
    ``--auth-failure-delay``; then the connection closes."""
    token = rest.strip(b" \t")
    if conn.check_token(token):
        return b"200 OK\r\n"
    conn.service.reports.auth_failure(conn.peer)
    conn.closing = True
    return Delayed(b"403 Bad Token\r\n", conn.service.config.auth_failure_delay)


# ------------------------------------------------------------------ watch (issue 28)

WATCHING = b"200 Watching\r\n"
TOO_MANY_WATCHERS = b"413 Too Many Watchers\r\n"


def cmd_watch(conn: Connection, args: Args, now: float) -> Reply:
    """``watch [PREFIX]``: ``200 Watching``, a ``+`` line per hold under PREFIX,
    ``SYNCED``; from then on the connection is an event stream
    (:mod:`elockd.net.watching` sends it). From the watcher's registration on, the
    snapshot and the events add up to the tables, whatever changes while the
    snapshot is sent (:func:`elockd.engine.watchers.snapshot`)."""
    prefix = args.positional[0] if args.positional else b""
    config, backend = conn.service.config, conn.backend
    try:
        backend.watch_keys(prefix, None, 0)
    except NotImplementedError:
        return WORD.unavailable
    try:
        watcher = backend.books.watchers.add(prefix, config.watch_buffer, config.max_watchers)
    except TooManyWatchers:
        conn.service.reports.refusal("--max-watchers", conn.peer)
        return TOO_MANY_WATCHERS
    conn.watcher = watcher
    lines = snapshot(
        watcher, lambda after, count: backend.watch_keys(prefix, after, count), backend.watch_lines
    )
    return Streamed(chunked(_after(WATCHING, lines), b""))


def _after(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest
