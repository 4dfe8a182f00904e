"""The byte stream from the server cut into replies, read strictly.

:class:`ReplyReader` sits between the :class:`~elockd.client.receivebuffer.ReceiveBuffer`
(bytes) and the :class:`~elockd.client.core.ClientCore` (requests): given whether the
reply at the head is one line or a block up to ``END``, it hands out its lines once
they are all in. Anything that is no reply of the protocol raises
:class:`ProtocolError` instead of being read as an answer.
"""

from __future__ import annotations

import re

from elockd.client.errors import ConnectionLost, ProtocolError
from elockd.client.receivebuffer import ReceiveBuffer

#: A multi-line request answered with one of these got a one-line refusal instead.
ONE_LINE_REFUSALS = frozenset(
    {
        b"0 Auth Required",
        b"0 Line Too Long",
        b"403 Auth Required",
        b"0 Backend Unavailable",
        b"409 Backend Unavailable",
        b"0 Too Many Connections",
    }
)
#: Every one-line reply of both families starts with its integer and a blank.
ONE_LINE_REPLY = re.compile(rb"\d+ ")
DIGITS = tuple(b"%d" % digit for digit in range(10))
#: The line that ends a multi-line reply, and how it stands after the one before it.
_END = b"END\r\n"
_AFTER_A_LINE = b"\r\n" + _END


def printable(data: bytes) -> str:
    """Bytes from the wire as text for a message: UTF-8 where it decodes, the rest
    and anything unprintable escaped (``\\n``, ``\\xff``), never Python's ``b'…'``."""
    text = data.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def quoted(data: bytes) -> str:
    """:func:`printable` in single quotes: keys and reply lines in messages."""
    return f"'{printable(data)}'"


#: The first line of an ``ls`` block: a row (``K exclusive=…``), or the line that
#: says ``limit=`` cut the listing (``… more``).
LS_FIRST_LINE = re.compile(rb"\S+ exclusive=|.* more\Z")


def opens_block(first: bytes) -> bool:
    """Whether ``first`` can start a multi-line reply: ``END`` (nothing listed), a
    ``name: value`` line (``q d sd who``), ``200 STATS``, or an ``ls`` line."""
    return (
        first == b"END"
        or b": " in first
        or first == b"200 STATS"
        or LS_FIRST_LINE.match(first) is not None
    )


#: What a cluster node's deadline gate answers in place of a reply about holds.
GATE_REFUSALS = frozenset({b"0 Backend Unavailable", b"409 Backend Unavailable"})


def is_refusal(line: bytes) -> bool:
    """A one-line refusal that stands in for a multi-line reply."""
    return line in ONE_LINE_REFUSALS or line.startswith(b"400 ")


def cut_with(lines: list[bytes]) -> bytes | None:
    """The refusal that cut a multi-line reply midway, or None: a cluster node that
    stopped vouching for its holds while it listed them (its deadline gate) sends
    the refusal as the last line before ``END``, so the rows before it are not the
    whole table. Only the gate's exact lines count: a row never equals one (it has
    a key and an owner), though a terse key may begin like any refusal."""
    if len(lines) >= 2 and lines[-1] == b"END" and lines[-2] in GATE_REFUSALS:
        return lines[-2]
    return None


class ReplyReader:
    """Replies out of received bytes, one at a time, in order.

    A reply's first line is checked once, when it is complete; a block is then
    searched for its ``END`` line as more bytes come, never from the start again.
    """

    def __init__(self) -> None:
        self.buffer = ReceiveBuffer()
        self._in_block = False  # the head reply's first line opened a block

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def take_reply(self, multiline: bool) -> list[bytes] | None:
        """The next reply's lines (without ``\\r\\n``), None until it is complete.
        ``multiline``: the request it answers is one of the block verbs."""
        if not self._in_block:
            cut = self.buffer.find(b"\n")
            if cut < 0:
                if self._cannot_start_a_reply(multiline):
                    raise self.foreign()
                return None
            line = self.buffer.peek(cut + 1)
            if not line.endswith(b"\r\n"):
                raise self.foreign()  # elockd ends every line in \r\n
            first = line[:-2]
            if not multiline or is_refusal(first):
                if not ONE_LINE_REPLY.match(first):
                    raise self.foreign()
                self.buffer.take(cut + 1)
                return [first]
            if not opens_block(first):
                raise self.foreign()
            self._in_block = True
        return self._take_block()

    def _cannot_start_a_reply(self, multiline: bool) -> bool:
        """Bytes no line of ours can start with, told before a line end comes (a
        peer that sent them may never send one): a TLS record's header (an alert
        from a TLS port), or, where a one-line reply is due, anything but a digit."""
        buffer = self.buffer
        if buffer.startswith(b"\x15\x03") or buffer.startswith(b"\x16\x03"):
            return True
        if multiline or not buffer:
            return False
        return not any(buffer.startswith(digit) for digit in DIGITS)

    def _take_block(self) -> list[bytes] | None:
        """A multi-line reply, up to its ``END`` line."""
        if self.buffer.startswith(_END):
            stop = len(_END)
        else:
            at = self.buffer.find(_AFTER_A_LINE)
            if at < 0:
                return None
            stop = at + len(_AFTER_A_LINE)
        self._in_block = False
        return self.buffer.take(stop)[:-2].split(b"\r\n")

    def foreign(self) -> ProtocolError:
        """The peer is not elockd: the error names the start of what it sent (its
        first line, such as ``HTTP/1.1 400 Bad Request``; ``data`` has more)."""
        data = self.buffer.peek(80)
        first = data.split(b"\n", 1)[0].rstrip()
        return ProtocolError(f"not an elockd reply: {quoted(first)}", data)

    def unasked(self) -> ConnectionLost:
        """Bytes nobody asked for: elockd's refusal of the connection itself (``0 Too
        Many Connections``, sent on accept), else a foreign peer's greeting."""
        start = self.buffer.peek(len(self.buffer))
        if ONE_LINE_REPLY.match(start):
            line = start.partition(b"\r\n")[0]
            return ConnectionLost(f"the server said {quoted(line)} before any request")
        return self.foreign()
