"""Bytes received from the server and not yet read as replies, kept as h11 keeps them.

A reply can be long (``dump`` of a million locks is 30 MB) and arrives in socket
reads of 64 KiB. Adding each chunk to an immutable ``bytes`` copies everything
before it, and searching for the end of the reply from the start each time scans it
again: quadratic work, seconds for one ``dump``. Like h11's ``_receivebuffer.py``
this keeps a ``bytearray`` (appending and cutting from the front are amortised O(1)
per byte in CPython) and, for each delimiter, where the last unsuccessful search
stopped, so the next one goes on from there. Every byte is copied in once, scanned
about once per delimiter, and copied out once.

``scanned`` and ``copied`` count that work, so a test can check that it stays linear
in the bytes received without timing anything.
"""

from __future__ import annotations


class ReceiveBuffer:
    """Received bytes, appended with ``+=`` and taken from the front."""

    def __init__(self) -> None:
        self._data = bytearray()
        # Per delimiter: no match starts before this offset (reset by take()).
        self._searched: dict[bytes, int] = {}
        #: Bytes looked at by find(), in total.
        self.scanned = 0
        #: Bytes copied in by += and out by take() and peek(), in total.
        self.copied = 0

    def __iadd__(self, data: bytes) -> ReceiveBuffer:
        self._data += data
        self.copied += len(data)
        return self

    def __len__(self) -> int:
        return len(self._data)

    def find(self, delimiter: bytes) -> int:
        """Where the first ``delimiter`` starts, or -1 while there is none.

        Goes on from where the last search for the same delimiter gave up, less the
        delimiter's length (a delimiter may straddle two chunks)."""
        start = self._searched.get(delimiter, 0)
        at = self._data.find(delimiter, start)
        if at < 0:
            self.scanned += len(self._data) - start
            self._searched[delimiter] = max(0, len(self._data) - len(delimiter) + 1)
        else:
            self.scanned += at + len(delimiter) - start
            self._searched[delimiter] = at
        return at

    def startswith(self, prefix: bytes) -> bool:
        return self._data.startswith(prefix)

    def peek(self, count: int) -> bytes:
        """The first ``count`` bytes (fewer if there are fewer), left in place."""
        with memoryview(self._data) as view, view[:count] as head:
            self.copied += len(head)
            return bytes(head)

    def take(self, count: int) -> bytes:
        """Remove and return the first ``count`` bytes."""
        data = self.peek(count)
        del self._data[:count]
        self._searched.clear()
        return data
