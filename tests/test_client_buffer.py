"""The client's receive buffer does linear work, counted rather than timed.

A long reply arrives in many socket reads. Re-copying the buffer or searching it
from the start on every read makes reading it quadratic (a 1,000,000-line ``dump``
took 3.8 s); :class:`~elockd.client.receivebuffer.ReceiveBuffer` counts the bytes it
scans and copies, so these tests can bound the work by a constant times the bytes
received, whatever the machine's speed.
"""

from __future__ import annotations

import pytest

from elockd.client.core import ClientCore, parse_lines, parse_ok
from elockd.client.receivebuffer import ReceiveBuffer


class Flag:
    """The event a request sets when its reply is in: nobody waits on it here."""

    def set(self) -> None:
        pass


def dump_reply(lines: int) -> bytes:
    body = b"".join(b"key-%07d: 127.0.0.1:%d\r\n" % (i, 10000 + i % 50000) for i in range(lines))
    return body + b"END\r\n"


def feed(core: ClientCore, data: bytes, chunk: int) -> int:
    """Feed ``data`` in ``chunk``-byte reads; the number of reads."""
    reads = 0
    for at in range(0, len(data), chunk):
        core.receive(data[at : at + chunk], 0.0)
        reads += 1
    return reads


def received(core: ClientCore) -> ReceiveBuffer:
    return core._replies.buffer


@pytest.mark.parametrize(("lines", "chunk"), [(1_000_000, 65536), (5_000, 1)])
def test_a_long_reply_is_scanned_and_copied_a_bounded_number_of_times(
    lines: int, chunk: int
) -> None:
    """A million lines in 64 KiB reads, and a reply one byte per read (the worst case
    for a buffer that searches from the start: one search per byte)."""
    core = ClientCore(Flag)
    dump = core.simple(b"dump", 0.0, parse_lines)
    reply = dump_reply(lines)
    reads = feed(core, reply, chunk)
    assert core.error is None
    assert dump.finish()[-1] == b"key-%07d: 127.0.0.1:%d" % (lines - 1, 10000 + (lines - 1) % 50000)
    buffer = received(core)
    # Each read is searched from where the last search gave up, less the length of
    # the delimiter (b"\r\nEND\r\n": 7 bytes) it may have cut in two.
    assert buffer.scanned <= len(reply) + 7 * reads
    # In once, out once; the first line is also copied out when it is checked.
    assert buffer.copied <= 2 * len(reply) + 100
    assert len(buffer) == 0


def test_many_short_replies_cost_no_more_than_one_long_one() -> None:
    """Taking each reply from the front of the buffer must not copy what follows it."""
    core = ClientCore(Flag)
    pings = [core.simple(b"ping", 0.0, parse_ok(b"200 PONG")) for _ in range(20_000)]
    data = b"200 PONG\r\n" * len(pings)
    feed(core, data, 65536)
    for ping in pings:
        ping.finish()
    buffer = received(core)
    assert buffer.scanned == len(data)
    assert buffer.copied == 3 * len(data)  # in; each line peeked to check it, then taken


def test_a_delimiter_cut_between_two_reads_is_found() -> None:
    buffer = ReceiveBuffer()
    for piece in (b"k: v\r", b"\nEN", b"D\r", b"\n"):
        assert buffer.find(b"\r\nEND\r\n") == -1
        buffer += piece
    assert buffer.find(b"\r\nEND\r\n") == 4
    assert buffer.take(11) == b"k: v\r\nEND\r\n" and len(buffer) == 0
