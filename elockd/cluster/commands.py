"""The verbs a cluster node answers through etcd.

Every verb that reads or changes the lock tables is replaced here; the others
(``iam``, ``me``, ``who``, ``set_timeout``, ``ping``, ``auth``, ``quit``) are the
in-memory server's own. Arguments are parsed before any I/O, with the same parsers
and the same ``400`` replies as the in-memory verbs, so a bad request still changes
nothing; then the handler returns a :class:`~elockd.protocol.Deferred` that the
server awaits. Replies are byte-for-byte those of the in-memory server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from elockd.cluster.layout import EXCLUSIVE, SHARED, parse_entry_value
from elockd.cluster.space import ClusterLockSpace, ClusterSession
from elockd.commands import COMMANDS
from elockd.locks import QueueFull
from elockd.logs import log_refusal
from elockd.protocol import Deferred, Streamed
from elockd.terse import chunked, terse_key
from elockd.word import (
    ACQUIRED,
    NO_OPTIONS,
    NOT_LOCKED,
    TOO_MANY_KEYS,
    TOO_MANY_WAITERS,
    UNAVAILABLE,
    UNLOCKED,
    Args,
    lock_args,
    lock_shared_args,
    mlock_args,
    renew_args,
    unavailable_keys,
)

if TYPE_CHECKING:
    from elockd.protocol import Connection, Handler, Reply


def _space(conn: Connection) -> ClusterLockSpace:
    backend = conn.service.backend
    assert isinstance(backend, ClusterLockSpace)
    return backend


def _session(conn: Connection) -> ClusterSession:
    session = conn.session
    assert isinstance(session, ClusterSession)
    session.abort = conn.abort  # a lost session ends this connection
    return session


def _terse(run: Callable[[], Awaitable[bytes | Streamed]]) -> Deferred:
    return Deferred(run, word=False)


def _word(run: Callable[[], Awaitable[bytes]], *, waits: bool = False) -> Deferred:
    async def guarded() -> bytes:
        try:
            return await run()
        except QueueFull:
            log_refusal("--max-waiters")
            return TOO_MANY_WAITERS

    return Deferred(guarded, word=True, waits=waits)


# ------------------------------------------------------------------ terse family


def cmd_g(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)

    async def run() -> bytes:
        grant = await _space(conn).acquire(
            _session(conn), EXCLUSIVE, [key], limit=1, ttl=None, wait=0
        )
        return conn.replies.got(key) if grant.granted else conn.replies.cannot_get(key)

    return _terse(run)


def cmd_r(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)

    async def run() -> bytes:
        freed = await _space(conn).release(_session(conn), EXCLUSIVE, key)
        return conn.replies.released(key) if freed.granted else conn.replies.cannot_release(key)

    return _terse(run)


def cmd_i(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)

    async def run() -> bytes:
        held = next(await _space(conn).holders(EXCLUSIVE, key), None)
        return conn.replies.locked(key) if held else conn.replies.not_locked(key)

    return _terse(run)


def cmd_sg(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)

    async def run() -> bytes:
        grant = await _space(conn).acquire(_session(conn), SHARED, [key], limit=0, ttl=None, wait=0)
        return conn.replies.shared_got(grant.count, key)

    return _terse(run)


def cmd_sr(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)

    async def run() -> bytes:
        freed = await _space(conn).release(_session(conn), SHARED, key)
        if not freed.granted:
            return conn.replies.shared_cannot_release(key)
        return conn.replies.shared_released(key)

    return _terse(run)


def cmd_si(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)

    async def run() -> bytes:
        count = sum(1 for _ in await _space(conn).holders(SHARED, key))
        if count:
            return conn.replies.shared_locked(count, key)
        return conn.replies.shared_not_locked(key)

    return _terse(run)


def _dump(conn: Connection, kind: bytes, key: bytes | None) -> Deferred:
    async def run() -> Streamed:
        pairs = await _space(conn).holders(kind, key)
        return Streamed(chunked(b"%s: %s\r\n" % pair for pair in pairs))

    return _terse(run)


def cmd_d(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)
    return _dump(conn, EXCLUSIVE, key or None)


def cmd_sd(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)
    return _dump(conn, SHARED, key or None)


def cmd_dump(conn: Connection, rest: bytes, now: float) -> Reply:
    return _dump(conn, SHARED if terse_key(rest) == b"shared" else EXCLUSIVE, None)


# ------------------------------------------------------------------- word family


def cmd_lock(conn: Connection, rest: bytes, now: float) -> Reply:
    key, wait, ttl = lock_args(rest, conn.service.config.max_ttl)

    async def run() -> bytes:
        grant = await _space(conn).acquire(
            _session(conn), EXCLUSIVE, [key], limit=1, ttl=ttl, wait=wait
        )
        return ACQUIRED if grant.granted else UNAVAILABLE

    return _word(run, waits=wait > 0)


def cmd_unlock(conn: Connection, rest: bytes, now: float) -> Reply:
    key = Args(rest, NO_OPTIONS, 1).key()

    async def run() -> bytes:
        freed = await _space(conn).release(_session(conn), EXCLUSIVE, key)
        return UNLOCKED if freed.granted else NOT_LOCKED

    return _word(run)


def cmd_unlock_all(conn: Connection, rest: bytes, now: float) -> Reply:
    Args(rest, NO_OPTIONS, 0)

    async def run() -> bytes:
        await _space(conn).release_all(_session(conn))
        return b"200 OK\r\n"

    return _word(run)


def cmd_conn_id(conn: Connection, rest: bytes, now: float) -> Reply:
    args = Args(rest, NO_OPTIONS, 1)
    if not args.positional:
        return b"200 %s\r\n" % conn.session.id.encode()
    wanted = args.positional[0].decode("ascii", errors="replace")

    async def run() -> bytes:
        session = await _space(conn).take_over(wanted, _session(conn))
        if session is None:
            return b"403 cannot set conn id\r\n"
        conn.session = session
        session.abort = conn.abort
        return b"200 conn id set\r\n"

    return _word(run)


def cmd_lock_shared(conn: Connection, rest: bytes, now: float) -> Reply:
    key, wait, limit, ttl = lock_shared_args(rest, conn.service.config.max_ttl)

    async def run() -> bytes:
        grant = await _space(conn).acquire(
            _session(conn), SHARED, [key], limit=limit or 0, ttl=ttl, wait=wait
        )
        return b"%d %d\r\n" % (200 if grant.granted else 409, grant.count)

    return _word(run, waits=wait > 0)


def cmd_unlock_shared(conn: Connection, rest: bytes, now: float) -> Reply:
    key = Args(rest, NO_OPTIONS, 1).key()

    async def run() -> bytes:
        freed = await _space(conn).release(_session(conn), SHARED, key)
        return b"200 %d\r\n" % freed.count if freed.granted else NOT_LOCKED

    return _word(run)


def cmd_mlock(conn: Connection, rest: bytes, now: float) -> Reply:
    keys, wait, ttl = mlock_args(rest, conn.service.config.max_ttl)
    if len(keys) > conn.service.config.max_keys:
        log_refusal("--max-keys", conn.peer)
        return TOO_MANY_KEYS

    async def run() -> bytes:
        grant = await _space(conn).acquire(
            _session(conn), EXCLUSIVE, keys, limit=1, ttl=ttl, wait=wait
        )
        return ACQUIRED if grant.granted else unavailable_keys(grant.blocked)

    return _word(run, waits=wait > 0)


def cmd_renew(conn: Connection, rest: bytes, now: float) -> Reply:
    key, ttl = renew_args(rest, conn.service.config.max_ttl)
    renewed = _space(conn).renew(conn.session, key, ttl)
    return b"200 Renewed\r\n" if renewed else NOT_LOCKED


def cmd_info(conn: Connection, rest: bytes, now: float) -> Reply:
    key = Args(rest, NO_OPTIONS, 1).key()

    async def run() -> bytes:
        space = _space(conn)
        head, shared, waiting = await space.describe(key)
        owner, ttl, token = b"-", b"-", b"-"
        if head is not None:
            owner = parse_entry_value(head.value).owner
            token = b"%d" % (space.token_floor + head.create_revision)
            local = space.local_hold(head.lease, key)
            if local is not None and local.lease_deadline is not None:
                ttl = b"%.3f" % max(0.0, local.lease_deadline - trio.current_time())
        return b"200 key=%s exclusive=%s shared=%d waiting=%d ttl=%s token=%s\r\n" % (
            key,
            owner,
            shared,
            waiting,
            ttl,
            token,
        )

    return _word(run)


CLUSTER_COMMANDS: dict[bytes, Handler] = {
    **COMMANDS,
    b"g": cmd_g,
    b"r": cmd_r,
    b"i": cmd_i,
    b"sg": cmd_sg,
    b"sr": cmd_sr,
    b"si": cmd_si,
    b"d": cmd_d,
    b"sd": cmd_sd,
    b"dump": cmd_dump,
    b"lock": cmd_lock,
    b"unlock": cmd_unlock,
    b"unlock_all": cmd_unlock_all,
    b"conn_id": cmd_conn_id,
    b"lock_shared": cmd_lock_shared,
    b"unlock_shared": cmd_unlock_shared,
    b"mlock": cmd_mlock,
    b"renew": cmd_renew,
    b"info": cmd_info,
}
