"""The word family: elock's verbs and this project's extensions.

Each handler gets the request's arguments already split by the verb's declaration
(:mod:`elockd.protocol.commands`; a bad argument is a ``400`` before the handler runs),
validates what the declaration cannot (numbers, a missing key), asks the backend
one question, and formats the answer, now or once it comes
(:func:`elockd.protocol.connection.answer`). A bad request changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elockd.backend.interface import Grant, KeyInfo
from elockd.engine.gcra import Rate, Verdict, milliseconds
from elockd.engine.sessions import Session
from elockd.protocol.arguments import Args, BadRequest, parse_number, parse_seconds, parse_whole
from elockd.protocol.connection import WORD, Delayed, Reply, answer
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
    if len(parts) == 3:
        key, count, period = parts
        # A tab in the key splits it in the declared arguments (Args): not this shape.
        if (
            key
            and count.isdigit()
            and period.isdigit()
            and len(count) + len(period) < 16
            and b"\t" not in key
        ):
            calls, seconds = int(count), int(period)
            if calls and 0 < seconds <= conn.service.config.max_ttl:
                rate = Rate(calls, float(seconds), calls, 1)
                result = conn.backend.throttle(conn.session, key, now, rate, wait=0.0)
                if result.__class__ is Verdict:
                    return throttle_line(result)
                return answer(result, throttle_line, WORD, conn.peer)
    args = Args(rest, THROTTLE_OPTIONS, 3, conn.service.config.max_ttl)
    return cmd_throttle(conn, args, now)


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
