"""The terse family: elockd/glockd's one-letter verbs, byte-compatible.

Each handler takes the connection, the rest of the line after the verb, and the
time, and returns reply bytes. The key is the rest of the line with its outer blanks
dropped and inner runs of blanks folded to one space, so ``g  a   b`` locks ``a b``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elockd.stats import render_q

if TYPE_CHECKING:
    from collections.abc import Iterable

    from elockd.protocol import Connection
    from elockd.sessions import Hold

END = b"END\r\n"


def terse_key(rest: bytes) -> bytes:
    """The key of a terse request: blanks trimmed, inner runs folded to one space."""
    if b" " not in rest and b"\t" not in rest:  # the common case, checked cheaply
        return rest
    return b" ".join(part for part in rest.replace(b"\t", b" ").split(b" ") if part)


def cmd_g(conn: Connection, rest: bytes, now: float) -> bytes:
    # terse_key's cheap test inlined in g and r, the two requests that carry the load.
    key = terse_key(rest) if b" " in rest or b"\t" in rest else rest
    if conn.engine.acquire(conn.session, key, now):
        return conn.replies.got(key)
    return conn.replies.cannot_get(key)


def cmd_r(conn: Connection, rest: bytes, now: float) -> bytes:
    key = terse_key(rest) if b" " in rest or b"\t" in rest else rest
    if conn.engine.release(conn.session, key, now):
        return conn.replies.released(key)
    return conn.replies.cannot_release(key)


def cmd_i(conn: Connection, rest: bytes, now: float) -> bytes:
    key = terse_key(rest)
    if key in conn.engine.exclusive:
        return conn.replies.locked(key)
    return conn.replies.not_locked(key)


def cmd_sg(conn: Connection, rest: bytes, now: float) -> bytes:
    key = terse_key(rest)
    _, count = conn.engine.acquire_shared(conn.session, key, now)
    return conn.replies.shared_got(count, key)


def cmd_sr(conn: Connection, rest: bytes, now: float) -> bytes:
    key = terse_key(rest)
    if conn.engine.release_shared(conn.session, key, now) is None:
        return conn.replies.shared_cannot_release(key)
    return conn.replies.shared_released(key)


def cmd_si(conn: Connection, rest: bytes, now: float) -> bytes:
    key = terse_key(rest)
    count = conn.engine.shared_count(key)
    if count:
        return conn.replies.shared_locked(count, key)
    return conn.replies.shared_not_locked(key)


def cmd_q(conn: Connection, rest: bytes, now: float) -> bytes:
    return render_q(conn.service.snapshot())


def render_holds(holds: Iterable[Hold]) -> bytes:
    """``d``/``sd``: a ``K: OWNER`` line per hold, then END."""
    return render_pairs((hold.key, hold.session.owner) for hold in holds)


def render_pairs(pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
    """``K: OWNER`` lines for (key, owner) pairs, then END."""
    lines = [b"%s: %s\r\n" % pair for pair in pairs]
    lines.append(END)
    return b"".join(lines)


def cmd_d(conn: Connection, rest: bytes, now: float) -> bytes:
    key = terse_key(rest)
    return render_holds(conn.engine.exclusive_holds(key if key else None))


def cmd_sd(conn: Connection, rest: bytes, now: float) -> bytes:
    key = terse_key(rest)
    return render_holds(conn.engine.shared_holds(key if key else None))


def cmd_dump(conn: Connection, rest: bytes, now: float) -> bytes:
    """``dump`` is ``d`` of every key; ``dump shared`` is ``sd`` of every key. Any other
    argument is ignored (documented in docs/protocol-notes.md)."""
    if terse_key(rest) == b"shared":
        return render_holds(conn.engine.shared_holds())
    return render_holds(conn.engine.exclusive_holds())


def cmd_iam(conn: Connection, rest: bytes, now: float) -> bytes:
    """Name this connection's session; an empty name clears it (owner is IP:PORT)."""
    name = terse_key(rest)
    conn.session.name = name if name else None
    return b"1 ok\r\n"


def cmd_who(conn: Connection, rest: bytes, now: float) -> bytes:
    wanted = terse_key(rest)
    lines = [
        b"%s: %s\r\n" % (other.peer, other.session.name)
        for other in conn.service.connections
        if other.session.name is not None and (not wanted or other.session.name == wanted)
    ]
    lines.append(END)
    return b"".join(lines)


def cmd_me(conn: Connection, rest: bytes, now: float) -> bytes:
    return b"1 %s %s\r\n" % (conn.peer, conn.session.owner)


TERSE_COMMANDS = {
    b"g": cmd_g,
    b"r": cmd_r,
    b"i": cmd_i,
    b"sg": cmd_sg,
    b"sr": cmd_sr,
    b"si": cmd_si,
    b"q": cmd_q,
    b"d": cmd_d,
    b"sd": cmd_sd,
    b"dump": cmd_dump,
    b"iam": cmd_iam,
    b"who": cmd_who,
    b"me": cmd_me,
}
