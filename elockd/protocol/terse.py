"""The terse family: elockd/glockd's one-letter verbs, byte-compatible.

Each handler takes the connection, the rest of the line after the verb, and the
time; it asks the backend one question and formats the answer (now, or once it
comes: :func:`elockd.protocol.connection.answer`). The key is the rest of the line with its
outer blanks dropped and inner runs of blanks folded to one space, so ``g  a   b``
locks ``a b``. The texts come from the connection's reply style
(:mod:`elockd.protocol.replies`: ``--replies elockd`` or ``glockd``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elockd.backend.interface import Grant, Holders, KeyInfo
from elockd.protocol.connection import TERSE, Outcome, Reply, Streamed, answer

if TYPE_CHECKING:
    from elockd.protocol.connection import Connection


def terse_key(rest: bytes) -> bytes:
    """The key of a terse request: blanks trimmed, inner runs folded to one space."""
    if b" " not in rest and b"\t" not in rest:  # the common case, checked cheaply
        return rest
    return b" ".join(part for part in rest.replace(b"\t", b" ").split(b" ") if part)


def cmd_g(conn: Connection, rest: bytes, now: float) -> Reply:
    # g and r carry the load: terse_key's cheap test and answer() are inlined.
    key = terse_key(rest) if b" " in rest or b"\t" in rest else rest
    result = conn.backend.acquire(conn.session, key, now)
    if result is True:  # answered at once (in memory): no isinstance, no call
        return conn.replies.got(key)
    if result is False:
        return conn.replies.cannot_get(key)
    return Outcome(result, lambda granted: _got(conn, key, granted), TERSE, conn.peer)


def _got(conn: Connection, key: bytes, granted: bool) -> bytes:
    return conn.replies.got(key) if granted else conn.replies.cannot_get(key)


def cmd_r(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest) if b" " in rest or b"\t" in rest else rest
    result = conn.backend.release(conn.session, key, now)
    if result is True:
        return conn.replies.released(key)
    if result is False:
        return conn.replies.cannot_release(key)
    return Outcome(result, lambda freed: _released(conn, key, freed), TERSE, conn.peer)


def _released(conn: Connection, key: bytes, released: bool) -> bytes:
    return conn.replies.released(key) if released else conn.replies.cannot_release(key)


def cmd_i(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)
    replies = conn.replies

    def reply(found: KeyInfo) -> bytes:
        return replies.locked(key) if found.owner is not None else replies.not_locked(key)

    return answer(conn.backend.info(key, now), reply, TERSE, conn.peer)


def cmd_sg(conn: Connection, rest: bytes, now: float) -> Reply:
    # sg and sr get g's treatment: no answer() call, no closure unless the reply
    # comes later.
    key = terse_key(rest) if b" " in rest or b"\t" in rest else rest
    result = conn.backend.lock_shared(conn.session, key, now, limit=None, wait=0, ttl=None)
    if isinstance(result, Grant):
        return conn.replies.shared_got(result.count, key)
    replies = conn.replies
    return Outcome(result, lambda grant: replies.shared_got(grant.count, key), TERSE, conn.peer)


def cmd_sr(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest) if b" " in rest or b"\t" in rest else rest
    left = conn.backend.release_shared(conn.session, key, now)
    if left is None:
        return conn.replies.shared_cannot_release(key)
    if isinstance(left, int):
        return conn.replies.shared_released(key)
    replies = conn.replies

    def reply(left: int | None) -> bytes:
        if left is None:
            return replies.shared_cannot_release(key)
        return replies.shared_released(key)

    return Outcome(left, reply, TERSE, conn.peer)


def cmd_si(conn: Connection, rest: bytes, now: float) -> Reply:
    key = terse_key(rest)
    replies = conn.replies

    def reply(found: KeyInfo) -> bytes:
        count = found.shared
        return replies.shared_locked(count, key) if count else replies.shared_not_locked(key)

    return answer(conn.backend.info(key, now), reply, TERSE, conn.peer)


def cmd_q(conn: Connection, rest: bytes, now: float) -> Reply:
    return conn.replies.counters(conn.service.snapshot())


def _listing(conn: Connection, shared: bool, key: bytes | None) -> Reply:
    """``d``/``sd``: a ``K: OWNER`` line per hold, produced as it is sent (the
    backend's :meth:`~elockd.backend.interface.Backend.holders` is weakly consistent, as
    Redis's SCAN: a hold present for the whole dump is listed exactly once)."""
    replies = conn.replies

    def listing(rows: Holders) -> Streamed:
        return Streamed(replies.listing(b"%s: %s\r\n" % (k, owner) for k, owner, _ in rows))

    rows = conn.backend.holders(shared, key, ordered=replies.sorted_dump)
    return answer(rows, listing, TERSE, conn.peer)


def cmd_d(conn: Connection, rest: bytes, now: float) -> Reply:
    return _listing(conn, False, terse_key(rest) or None)


def cmd_sd(conn: Connection, rest: bytes, now: float) -> Reply:
    return _listing(conn, True, terse_key(rest) or None)


def cmd_dump(conn: Connection, rest: bytes, now: float) -> Reply:
    """``dump``: every exclusive hold; ``dump shared``: every shared one. Any other
    argument is ignored (docs/protocol.md)."""
    shared = terse_key(rest) == b"shared"
    replies = conn.replies
    rows = conn.backend.holders(shared, None, ordered=replies.sorted_dump)
    return answer(rows, lambda found: Streamed(replies.dump(found, shared)), TERSE, conn.peer)


def cmd_iam(conn: Connection, rest: bytes, now: float) -> Reply:
    """Name this connection's session; an empty name clears it (owner is IP:PORT).
    Naming again moves the connection to the end of `who`'s naming order."""
    name = terse_key(rest)
    named = conn.service.named
    named.pop(conn, None)
    if name:
        named[conn] = None
    return answer(
        conn.backend.rename(conn.session, name or None), lambda _: b"1 ok\r\n", TERSE, conn.peer
    )


def cmd_who(conn: Connection, rest: bytes, now: float) -> Reply:
    """Named connections in the order their names were set, streamed like a dump
    (from a snapshot of the connections, each read when its turn comes)."""
    wanted = terse_key(rest)
    named = conn.service.named
    lines = (
        b"%s: %s\r\n" % (other.peer, name)
        for other in list(named)
        if other in named
        and (name := other.session.name) is not None
        and (not wanted or name == wanted)
    )
    return Streamed(conn.replies.listing(lines))


def cmd_me(conn: Connection, rest: bytes, now: float) -> Reply:
    return b"1 %s %s\r\n" % (conn.peer, conn.session.owner)
