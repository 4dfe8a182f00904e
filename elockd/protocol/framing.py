"""Split a byte stream into request lines without ever buffering more than one line.

Sans-IO, after h11's receive buffer: bytes go in, complete lines come out, and a
hostile peer can neither grow the buffer past ``max_line`` nor make the work
quadratic. A line longer than ``max_line`` (not counting its ``\\n`` or a ``\\r``
before it) comes out as :data:`TOO_LONG` at the moment it is known to be too long;
the rest of it is then read and thrown away until its newline.
"""

from __future__ import annotations

from typing import Final

#: Marker yielded in place of an over-long line.
TOO_LONG: Final = None


class LineReader:
    """Turns received chunks into lines (``\\n`` removed, ``\\r`` kept)."""

    __slots__ = ("_discarding", "_partial", "max_line")

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        # The start of a line whose newline has not arrived. A bytearray, so a peer
        # that trickles one byte at a time costs amortised O(1) per byte.
        self._partial = bytearray()
        self._discarding = False  # inside an over-long line, waiting for its newline

    @property
    def buffered(self) -> int:
        """Bytes held back for an incomplete line (never above ``max_line + 1``)."""
        return len(self._partial)

    def unread(self) -> tuple[bytes, bool]:
        """What is held back (the start of a line) and whether it is the rest of an
        over-long line being dropped: a hand-over moves both (docs/upgrade.md)."""
        return bytes(self._partial), self._discarding

    def resume(self, partial: bytes, discarding: bool) -> None:
        """Go on where another reader stood (its :meth:`unread`)."""
        self._partial = bytearray(partial)
        self._discarding = discarding

    def _too_long(self, line: bytes | bytearray) -> bool:
        # The limit does not count a final "\r", so such a line may be one byte longer.
        size = len(line)
        return size > self.max_line and (size > self.max_line + 1 or line[-1] != 0x0D)

    def feed(self, data: bytes) -> list[bytes | None]:
        """Every line completed by ``data``, in order; TOO_LONG for over-long ones."""
        lines: list[bytes | None] = []
        if self._discarding or self._partial:
            newline = data.find(b"\n")
            if self._discarding:
                if newline < 0:
                    return lines
                self._discarding = False
            elif newline < 0:
                self._partial += data
                self._check_partial(lines)
                return lines
            else:
                self._partial += data[:newline]
                line = bytes(self._partial)
                self._partial = bytearray()
                lines.append(TOO_LONG if self._too_long(line) else line)
            data = data[newline + 1 :]
        parts = data.split(b"\n")
        tail = parts.pop()
        max_line = self.max_line
        for line in parts:
            lines.append(TOO_LONG if len(line) > max_line and self._too_long(line) else line)
        if tail:
            self._partial += tail
            self._check_partial(lines)
        return lines

    def _check_partial(self, lines: list[bytes | None]) -> None:
        # An incomplete line that is already too long is answered now and skipped;
        # one that ends in "\r" right at the limit may still be valid.
        if self._too_long(self._partial):
            self._partial = bytearray()
            self._discarding = True
            lines.append(TOO_LONG)
