"""The two reply styles of the terse family, ``--replies elockd`` and ``--replies glockd``.

elockd's one-line replies are fixed lines; glockd's name the key. The multi-line
replies differ more: elockd ends each with ``END``, and glockd r312 (the Go
descendant of elockd, whose clients read a listing until 100 ms of silence) sends
no ``END``, nothing at all for an unknown verb or a listing that matches nothing,
``dump`` as Go's print of a map, and only its own counters in ``q``. Both classes
answer the same questions, so the command handlers never branch on the style: the
dialect is a reply style, not a second set of handlers.

Multi-line replies come back as an iterator of chunks, produced as they are sent
(a dump over a million holds is never built whole).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

#: A holder as a dump lists it: (key, owner, address). The owner is the session's
#: ``iam`` name, else its address; the address is the connection's ``IP:PORT``.
HolderRow = tuple[bytes, bytes, bytes]

END = b"END\r\n"
#: A streamed reply goes out in pieces of about this many bytes: big enough that a
#: dump costs few sends, small enough that a client that does not read holds at most
#: this (plus the kernel's socket buffers) of the server's memory.
CHUNK_BYTES = 32 * 1024


def chunked(pieces: Iterable[bytes], end: bytes = END) -> Iterator[bytes]:
    """``pieces`` then ``end``, joined into chunks of about :data:`CHUNK_BYTES`
    (an empty listing without an end is one empty chunk: nothing is sent). An empty
    piece sends the chunk so far at once, empty or not: the producer read a while
    without output (``ls older=``), and other connections get their turn."""
    chunk: list[bytes] = []
    size = 0
    for piece in pieces:
        chunk.append(piece)
        size += len(piece)
        if size >= CHUNK_BYTES or not piece:
            yield b"".join(chunk)
            chunk.clear()
            size = 0
    chunk.append(end)
    yield b"".join(chunk)


#: The counters glockd r312's ``q`` prints (and ``command_iam``/``me``/``who`` once
#: used); elockd's ``q`` prints these and its own extras.
GLOCKD_COUNTERS = frozenset(
    "command_d command_dump command_g command_i command_q command_r command_sd command_sg "
    "command_si command_sr connections invalid_commands locks orphans shared_locks "
    "shared_orphans".split()
)
GLOCKD_COUNTERS_ONCE_USED = frozenset({"command_iam", "command_me", "command_who"})


class TerseReplies(Protocol):
    """What the terse family's handlers (and the dispatcher) ask a reply style."""

    #: Whether ``d``, ``sd`` and ``dump`` list keys in byte order (the backend then
    #: sorts them; unsorted, a dump lists them in the order the table keeps).
    sorted_dump: bool
    #: What ends ``d``, ``sd`` and ``who`` (``END``, or nothing): also closes one
    #: that a cluster node's deadline gate cut midway, after the refusal.
    listing_end: bytes

    def unknown_verb(self, verb: bytes) -> bytes: ...
    def listing(self, lines: Iterable[bytes]) -> Iterator[bytes]:
        """``d``, ``sd`` (``K: OWNER`` lines) and ``who`` (``IP:PORT: NAME``)."""

    def dump(self, holders: Iterable[HolderRow], shared: bool) -> Iterator[bytes]:
        """``dump`` (``shared``: ``dump shared``): every key."""

    def counters(self, values: dict[str, int]) -> bytes:
        """``q``: sorted ``name: value`` lines."""

    def got(self, key: bytes) -> bytes: ...
    def cannot_get(self, key: bytes) -> bytes: ...
    def released(self, key: bytes) -> bytes: ...
    def cannot_release(self, key: bytes) -> bytes: ...
    def locked(self, key: bytes) -> bytes: ...
    def not_locked(self, key: bytes) -> bytes: ...
    def shared_got(self, count: int, key: bytes) -> bytes: ...
    def shared_released(self, key: bytes) -> bytes: ...
    def shared_cannot_release(self, key: bytes) -> bytes: ...
    def shared_locked(self, count: int, key: bytes) -> bytes: ...
    def shared_not_locked(self, key: bytes) -> bytes: ...


class ElockdReplies:
    """The default: short fixed texts; lockd clients read the leading integer."""

    sorted_dump = False
    listing_end = END

    def unknown_verb(self, verb: bytes) -> bytes:
        return b"0 Invalid Command: %s\r\n" % verb

    def listing(self, lines: Iterable[bytes]) -> Iterator[bytes]:
        return chunked(lines)

    def dump(self, holders: Iterable[HolderRow], shared: bool) -> Iterator[bytes]:
        """``dump`` is ``d`` of every key, ``dump shared`` is ``sd``."""
        return chunked(b"%s: %s\r\n" % (key, owner) for key, owner, _ in holders)

    def counters(self, values: dict[str, int]) -> bytes:
        lines = [f"{name}: {value}\r\n" for name, value in values.items()]
        lines.append("END\r\n")
        return "".join(lines).encode("ascii")

    def got(self, key: bytes) -> bytes:
        return b"1 Got Lock\r\n"

    def cannot_get(self, key: bytes) -> bytes:
        return b"0 Cannot Get Lock\r\n"

    def released(self, key: bytes) -> bytes:
        return b"1 Released Lock\r\n"

    def cannot_release(self, key: bytes) -> bytes:
        return b"0 Cannot Release Lock\r\n"

    def locked(self, key: bytes) -> bytes:
        return b"1 Locked\r\n"

    def not_locked(self, key: bytes) -> bytes:
        return b"0 Not Locked\r\n"

    def shared_got(self, count: int, key: bytes) -> bytes:
        return b"%d Got Lock\r\n" % count

    def shared_released(self, key: bytes) -> bytes:
        return b"1 Released Lock\r\n"

    def shared_cannot_release(self, key: bytes) -> bytes:
        return b"0 Cannot Release Lock\r\n"

    def shared_locked(self, count: int, key: bytes) -> bytes:
        return b"%d Locked\r\n" % count

    def shared_not_locked(self, key: bytes) -> bytes:
        return b"0 Not Locked\r\n"


class GlockdReplies:
    """glockd r312 on the wire: texts that repeat the key, no ``END``, silence for
    what matches nothing, ``dump`` as Go prints a map."""

    sorted_dump = True
    listing_end = b""

    def unknown_verb(self, verb: bytes) -> bytes:
        return b""  # r312 answers nothing: its clients expect no reply at all

    def listing(self, lines: Iterable[bytes]) -> Iterator[bytes]:
        return chunked(lines, b"")

    def dump(self, holders: Iterable[HolderRow], shared: bool) -> Iterator[bytes]:
        """``map[K1:OWNER1 K2:OWNER2]`` (shared: ``map[K1:[OWNER OWNER] K2:[OWNER]]``),
        keys sorted, each owner the holder's ``IP:PORT`` (names are not applied), as
        Go prints a ``map[string]string`` (``map[string][]string``)."""
        return chunked(_go_map(holders, shared), b"]\r\n")

    def counters(self, values: dict[str, int]) -> bytes:
        lines = [
            f"{name}: {value}\r\n"
            for name, value in values.items()
            if name in GLOCKD_COUNTERS or (name in GLOCKD_COUNTERS_ONCE_USED and value)
        ]
        return "".join(lines).encode("ascii")

    def got(self, key: bytes) -> bytes:
        return b"1 Lock Get Success: %s\r\n" % key

    def cannot_get(self, key: bytes) -> bytes:
        return b"0 Lock Get Failure: %s\r\n" % key

    def released(self, key: bytes) -> bytes:
        return b"1 Lock Release Success: %s\r\n" % key

    def cannot_release(self, key: bytes) -> bytes:
        return b"0 Lock Release Failure: %s\r\n" % key

    def locked(self, key: bytes) -> bytes:
        return b"1 Lock Is Locked: %s\r\n" % key

    def not_locked(self, key: bytes) -> bytes:
        return b"0 Lock Not Locked: %s\r\n" % key

    def shared_got(self, count: int, key: bytes) -> bytes:
        return b"%d Shared Lock Get Success: %s\r\n" % (count, key)

    def shared_released(self, key: bytes) -> bytes:
        return b"1 Shared Lock Release Success: %s\r\n" % key

    def shared_cannot_release(self, key: bytes) -> bytes:
        return b"0 Shared Lock Release Failure: %s\r\n" % key

    def shared_locked(self, count: int, key: bytes) -> bytes:
        return b"%d Shared Lock Is Locked: %s\r\n" % (count, key)

    def shared_not_locked(self, key: bytes) -> bytes:
        return b"0 Shared Lock Not Locked: %s\r\n" % key


STYLES: dict[str, TerseReplies] = {"elockd": ElockdReplies(), "glockd": GlockdReplies()}


def _go_map(holders: Iterable[HolderRow], shared: bool) -> Iterator[bytes]:
    """The pieces of Go's ``map[...]`` print of sorted holder rows, without the
    closing ``]``. Shared holders of one key (consecutive rows) share one entry."""
    yield b"map["
    current: bytes | None = None
    for key, _, address in holders:
        if not shared:
            yield b"%s%s:%s" % (b"" if current is None else b" ", key, address)
            current = key
        elif key == current:
            yield b" " + address
        else:
            yield b"%s%s:[%s" % (b"" if current is None else b"] ", key, address)
            current = key
    if shared and current is not None:
        yield b"]"
