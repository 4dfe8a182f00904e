"""The terse family: elockd/glockd's one-letter verbs, byte-compatible.

Each handler takes the connection, the rest of the line after the verb, and the
time, and returns reply bytes. The key is the rest of the line with its outer blanks
dropped and inner runs of blanks folded to one space, so ``g  a   b`` locks ``a b``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from elockd.protocol import Streamed
from elockd.stats import render_q

if TYPE_CHECKING:
    from elockd.locks import LockEngine
    from elockd.protocol import Connection, Handler
    from elockd.sessions import Hold

END = b"END\r\n"
#: A streamed reply goes out in pieces of about this many bytes: big enough that a
#: dump costs few sends, small enough that a client that does not read holds at most
#: this (plus the kernel's socket buffers) of the server's memory.
CHUNK_BYTES = 32 * 1024


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


def chunked(lines: Iterable[bytes]) -> Iterator[bytes]:
    """``lines`` then END, joined into pieces of about :data:`CHUNK_BYTES`."""
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        chunk.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            yield b"".join(chunk)
            chunk.clear()
            size = 0
    chunk.append(END)
    yield b"".join(chunk)


def stream_holds(keys: list[bytes], holds_of: Callable[[bytes], Iterable[Hold]]) -> Streamed:
    """``d``/``sd``: a ``K: OWNER`` line per hold, then END, produced as it is sent.

    Weakly consistent, as Redis's SCAN: ``keys`` is a snapshot of the table's keys
    (8 bytes each, not the reply), and each key's holders are read when its turn
    comes. A hold present for the whole dump is listed exactly once (its key is in
    the snapshot once); one taken or freed meanwhile may or may not be.
    """
    lines = (b"%s: %s\r\n" % (hold.key, hold.session.owner) for k in keys for hold in holds_of(k))
    return Streamed(chunked(lines))


def _dump_exclusive(engine: LockEngine, key: bytes | None) -> Streamed:
    return stream_holds(list(engine.exclusive) if key is None else [key], engine.exclusive_holds)


def _dump_shared(engine: LockEngine, key: bytes | None) -> Streamed:
    return stream_holds(list(engine.shared) if key is None else [key], engine.shared_holds)


def cmd_d(conn: Connection, rest: bytes, now: float) -> Streamed:
    return _dump_exclusive(conn.engine, terse_key(rest) or None)


def cmd_sd(conn: Connection, rest: bytes, now: float) -> Streamed:
    return _dump_shared(conn.engine, terse_key(rest) or None)


def cmd_dump(conn: Connection, rest: bytes, now: float) -> Streamed:
    """``dump`` is ``d`` of every key; ``dump shared`` is ``sd`` of every key. Any other
    argument is ignored (documented in docs/protocol.md)."""
    if terse_key(rest) == b"shared":
        return _dump_shared(conn.engine, None)
    return _dump_exclusive(conn.engine, None)


def cmd_iam(conn: Connection, rest: bytes, now: float) -> bytes:
    """Name this connection's session; an empty name clears it (owner is IP:PORT).
    Naming again moves the connection to the end of `who`'s naming order."""
    name = terse_key(rest)
    conn.session.name = name if name else None
    named = conn.service.named
    named.pop(conn, None)
    if name:
        named[conn] = None
    return b"1 ok\r\n"


def cmd_who(conn: Connection, rest: bytes, now: float) -> Streamed:
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
    return Streamed(chunked(lines))


def cmd_me(conn: Connection, rest: bytes, now: float) -> bytes:
    return b"1 %s %s\r\n" % (conn.peer, conn.session.owner)


TERSE_COMMANDS: dict[bytes, Handler] = {
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
