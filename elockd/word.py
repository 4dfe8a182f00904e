"""The word family: elock's verbs and this project's extensions.

Arguments are blank-separated tokens; the key is one token. Options are
``name=value`` tokens after the positional arguments. A handler validates every
argument before it touches the engine, so a bad request (``400 Bad Request: …``)
changes nothing.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from elockd.locks import QueueFull, Waiter
from elockd.logs import log_auth_failure, log_refusal
from elockd.protocol import BadRequest, Delayed, Pending
from elockd.stats import render_stats

if TYPE_CHECKING:
    from elockd.protocol import Connection, Reply

ACQUIRED = b"200 Acquired\r\n"
UNAVAILABLE = b"409 Unavailable\r\n"
UNLOCKED = b"200 Unlocked\r\n"
NOT_LOCKED = b"403 Not Locked\r\n"
TOO_MANY_WAITERS = b"413 Too Many Waiters\r\n"
TOO_MANY_KEYS = b"413 Too Many Keys\r\n"

_NUMBER = re.compile(rb"(?:\d+(?:\.\d*)?|\.\d+)\Z")


class Args:
    """A word request's tokens, split into positional arguments and options."""

    __slots__ = ("max_seconds", "options", "positional")

    def __init__(
        self,
        rest: bytes,
        allowed: frozenset[bytes],
        max_positional: int,
        max_seconds: float = math.inf,
    ) -> None:
        """``max_seconds`` bounds every duration the request gives (``--max-ttl``)."""
        self.max_seconds = max_seconds
        tokens = [t for t in rest.replace(b"\t", b" ").split(b" ") if t]
        self.positional: list[bytes] = []
        self.options: dict[bytes, bytes] = {}
        for index, token in enumerate(tokens):
            if index > 0 and b"=" in token:
                name, _, value = token.partition(b"=")
                if name not in allowed:
                    raise BadRequest(f"unknown option {name.decode(errors='replace')}")
                if name in self.options:
                    raise BadRequest(f"option {name.decode()} given twice")
                self.options[name] = value
            elif self.options:
                raise BadRequest("options must follow the arguments")
            else:
                self.positional.append(token)
        if len(self.positional) > max_positional:
            raise BadRequest("too many arguments")

    def key(self) -> bytes:
        if not self.positional:
            raise BadRequest("missing key")
        return self.positional[0]

    def seconds(self, index: int, what: str) -> float | None:
        """Positional ``index`` as non-negative seconds, or None when absent."""
        if len(self.positional) <= index:
            return None
        return parse_seconds(self.positional[index], what, self.max_seconds)

    def option_seconds(self, name: bytes) -> float | None:
        """A ``name=S`` option; it must be above zero (a 0 s lease is no lease)."""
        value = self.options.get(name)
        if value is None:
            return None
        seconds = parse_seconds(value, name.decode(), self.max_seconds)
        if seconds <= 0:
            raise BadRequest(f"{name.decode()} must be above 0")
        return seconds


def parse_number(token: bytes, what: str) -> float:
    """Decimal, non-negative, finite: ``2``, ``2.5``, ``.5``. No signs, exponents,
    ``inf`` or ``nan``; 400 digits are a float too large to be finite: refused."""
    if not _NUMBER.match(token):
        raise BadRequest(f"{what} must be a non-negative number")
    value = float(token)
    if value == math.inf:
        raise BadRequest(f"{what} is too large")
    return value


def parse_seconds(token: bytes, what: str, most: float) -> float:
    """A duration in seconds, at most ``most`` (``--max-ttl``): a deadline a day
    away is a lease; one a million years away is a session nobody will ever free."""
    value = parse_number(token, what)
    if value > most:
        raise BadRequest(f"{what} above --max-ttl ({most:g} s)")
    return value


TTL_OPTION = frozenset({b"ttl"})
NO_OPTIONS: frozenset[bytes] = frozenset()


def _wait_reply(
    conn: Connection, waiter: Waiter, wait: float, granted: bytes, refused: bytes
) -> Pending:
    return Pending(conn, waiter, wait, lambda: granted, lambda _blocked: refused)


def lock_args(rest: bytes, max_seconds: float) -> tuple[bytes, float, float | None]:
    """``lock K [WAIT] [ttl=S]``: key, seconds to wait (0: try once), lease."""
    args = Args(rest, TTL_OPTION, 2, max_seconds)
    return args.key(), args.seconds(1, "WAIT") or 0.0, args.option_seconds(b"ttl")


def cmd_lock(conn: Connection, rest: bytes, now: float) -> Reply:
    key, wait, ttl = lock_args(rest, conn.service.config.max_ttl)
    if not wait:
        return ACQUIRED if conn.engine.acquire(conn.session, key, now, ttl) else UNAVAILABLE
    try:
        waiter = conn.engine.wait_for(conn.session, key, now, ttl, timeout=wait)
    except QueueFull:
        log_refusal("--max-waiters", conn.peer)
        return TOO_MANY_WAITERS
    if waiter is None:
        return ACQUIRED
    return _wait_reply(conn, waiter, wait, ACQUIRED, UNAVAILABLE)


def cmd_unlock(conn: Connection, rest: bytes, now: float) -> Reply:
    key = Args(rest, NO_OPTIONS, 1).key()
    return UNLOCKED if conn.engine.release(conn.session, key, now) else NOT_LOCKED


def cmd_unlock_all(conn: Connection, rest: bytes, now: float) -> Reply:
    Args(rest, NO_OPTIONS, 0)
    conn.engine.release_all(conn.session, now)
    return b"200 OK\r\n"


def cmd_conn_id(conn: Connection, rest: bytes, now: float) -> Reply:
    args = Args(rest, NO_OPTIONS, 1)
    if not args.positional:
        return b"200 %s\r\n" % conn.session.id.encode()
    wanted = args.positional[0].decode("ascii", errors="replace")
    session = conn.engine.take_over(wanted, conn.session)
    if session is None:
        return b"403 cannot set conn id\r\n"
    conn.session = session
    return b"200 conn id set\r\n"


def cmd_set_timeout(conn: Connection, rest: bytes, now: float) -> Reply:
    args = Args(rest, NO_OPTIONS, 1)
    if not args.positional:
        raise BadRequest("missing MS")
    grace = parse_number(args.positional[0], "MS") / 1000
    if grace > conn.service.config.max_ttl:
        raise BadRequest(f"MS above --max-ttl ({conn.service.config.max_ttl:g} s)")
    conn.session.grace = grace
    return b"200 timeout set\r\n"


def cmd_stats(conn: Connection, rest: bytes, now: float) -> Reply:
    return render_stats(conn.service.snapshot(), len(conn.service.connections))


def cmd_quit(conn: Connection, rest: bytes, now: float) -> Reply:
    conn.closing = True
    return b"200 Bye\r\n"


def parse_limit(args: Args) -> int | None:
    value = args.options.get(b"limit")
    if value is None:
        return None
    digits = value.lstrip(b"0")
    if not value.isdigit() or not digits:
        raise BadRequest("limit must be a whole number above 0")
    # int() refuses more than 4,300 digits (reachable with a large --max-line), and
    # its ValueError would end the server; no holder count reaches 10**18 anyway.
    return int(digits) if len(digits) <= 18 else 10**18


SHARED_OPTIONS = frozenset({b"limit", b"ttl"})


def lock_shared_args(
    rest: bytes, max_seconds: float
) -> tuple[bytes, float, int | None, float | None]:
    """``lock_shared K [WAIT] [limit=N] [ttl=S]``: key, wait, limit, lease. Without a
    limit it never waits, so the wait is 0 then."""
    args = Args(rest, SHARED_OPTIONS, 2, max_seconds)
    key = args.key()
    wait = args.seconds(1, "WAIT") or 0.0
    limit = parse_limit(args)
    return key, wait if limit is not None else 0.0, limit, args.option_seconds(b"ttl")


def cmd_lock_shared(conn: Connection, rest: bytes, now: float) -> Reply:
    key, wait, limit, ttl = lock_shared_args(rest, conn.service.config.max_ttl)
    engine = conn.engine
    if not wait or limit is None:
        granted, count = engine.acquire_shared(conn.session, key, now, limit=limit, ttl=ttl)
        return b"%d %d\r\n" % (200 if granted else 409, count)
    try:
        result = engine.wait_shared(conn.session, key, now, limit=limit, ttl=ttl, timeout=wait)
    except QueueFull:
        log_refusal("--max-waiters", conn.peer)
        return TOO_MANY_WAITERS
    if isinstance(result, int):
        return b"200 %d\r\n" % result
    waiter = result
    return Pending(
        conn,
        waiter,
        wait,
        lambda: b"200 %d\r\n" % waiter.count,
        lambda _blocked: b"409 %d\r\n" % engine.shared_count(key),
    )


def cmd_unlock_shared(conn: Connection, rest: bytes, now: float) -> Reply:
    key = Args(rest, NO_OPTIONS, 1).key()
    count = conn.engine.release_shared(conn.session, key, now)
    return NOT_LOCKED if count is None else b"200 %d\r\n" % count


MLOCK_OPTIONS = frozenset({b"wait", b"ttl"})


def mlock_args(rest: bytes, max_seconds: float) -> tuple[list[bytes], float, float | None]:
    """``mlock K1 K2 ... [wait=S] [ttl=S]``: the distinct keys in order, wait, lease."""
    args = Args(rest, MLOCK_OPTIONS, 1 << 30, max_seconds)
    keys = list(dict.fromkeys(args.positional))
    if not keys:
        raise BadRequest("missing key")
    wait_option = args.options.get(b"wait")
    wait = parse_seconds(wait_option, "wait", max_seconds) if wait_option is not None else 0.0
    return keys, wait, args.option_seconds(b"ttl")


def cmd_mlock(conn: Connection, rest: bytes, now: float) -> Reply:
    keys, wait, ttl = mlock_args(rest, conn.service.config.max_ttl)
    if len(keys) > conn.service.config.max_keys:
        log_refusal("--max-keys", conn.peer)
        return TOO_MANY_KEYS
    try:
        result = conn.engine.request_many(
            conn.session, keys, now, ttl=ttl, wait=wait > 0, timeout=wait
        )
    except QueueFull:
        log_refusal("--max-waiters", conn.peer)
        return TOO_MANY_WAITERS
    if result is None:
        return ACQUIRED
    if isinstance(result, list):
        return unavailable_keys(result)
    if result.granted:
        return ACQUIRED
    return Pending(conn, result, wait, lambda: ACQUIRED, unavailable_keys)


def unavailable_keys(keys: list[bytes]) -> bytes:
    return b"409 Unavailable %s\r\n" % b" ".join(keys)


def renew_args(rest: bytes, max_seconds: float) -> tuple[bytes, float]:
    """``renew K ttl=S``: the key and the seconds (both backends parse it so)."""
    args = Args(rest, TTL_OPTION, 1, max_seconds)
    key = args.key()
    ttl = args.option_seconds(b"ttl")
    if ttl is None:
        raise BadRequest("missing ttl")
    return key, ttl


def cmd_renew(conn: Connection, rest: bytes, now: float) -> Reply:
    key, ttl = renew_args(rest, conn.service.config.max_ttl)
    return b"200 Renewed\r\n" if conn.engine.renew(conn.session, key, now, ttl) else NOT_LOCKED


def cmd_token(conn: Connection, rest: bytes, now: float) -> Reply:
    key = Args(rest, NO_OPTIONS, 1).key()
    hold = conn.session.exclusive.get(key)
    return NOT_LOCKED if hold is None else b"200 %d\r\n" % hold.token


def cmd_info(conn: Connection, rest: bytes, now: float) -> Reply:
    key = Args(rest, NO_OPTIONS, 1).key()
    engine = conn.engine
    hold = engine.exclusive.get(key)
    owner, ttl, token = b"-", b"-", b"-"
    if hold is not None:
        owner = hold.session.owner
        token = b"%d" % hold.token
        if hold.lease_deadline is not None:
            ttl = b"%.3f" % max(0.0, hold.lease_deadline - now)
    return b"200 key=%s exclusive=%s shared=%d waiting=%d ttl=%s token=%s\r\n" % (
        key,
        owner,
        engine.shared_count(key),
        engine.waiting_for(key),
        ttl,
        token,
    )


def cmd_ping(conn: Connection, rest: bytes, now: float) -> Reply:
    return b"200 PONG\r\n"


def cmd_auth(conn: Connection, rest: bytes, now: float) -> Reply:
    """A wrong token is logged with the peer and answered only after
    ``--auth-failure-delay``; then the connection closes."""
    token = rest.strip(b" \t")
    if conn.check_token(token):
        return b"200 OK\r\n"
    log_auth_failure(conn.peer)
    conn.closing = True
    return Delayed(b"403 Bad Token\r\n", conn.service.config.auth_failure_delay)


WORD_COMMANDS = {
    b"lock": cmd_lock,
    b"unlock": cmd_unlock,
    b"unlock_all": cmd_unlock_all,
    b"conn_id": cmd_conn_id,
    b"set_timeout": cmd_set_timeout,
    b"stats": cmd_stats,
    b"quit": cmd_quit,
    b"lock_shared": cmd_lock_shared,
    b"unlock_shared": cmd_unlock_shared,
    b"mlock": cmd_mlock,
    b"renew": cmd_renew,
    b"token": cmd_token,
    b"info": cmd_info,
    b"ping": cmd_ping,
    b"auth": cmd_auth,
}
