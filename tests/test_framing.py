"""The line reader: lines out of arbitrary chunking, bounded memory for long lines."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elockd.protocol.framing import TOO_LONG, LineReader


def feed_all(reader: LineReader, chunks: list[bytes]) -> list[bytes | None]:
    out: list[bytes | None] = []
    for chunk in chunks:
        out += reader.feed(chunk)
    return out


def test_complete_lines_in_one_chunk() -> None:
    assert LineReader(10).feed(b"g a\nr a\n") == [b"g a", b"r a"]


def test_partial_line_waits_for_its_newline() -> None:
    reader = LineReader(10)
    assert reader.feed(b"g a") == []
    assert reader.buffered == 3
    assert reader.feed(b"b\nsg") == [b"g ab"]
    assert reader.feed(b" x\n") == [b"sg x"]


def test_carriage_return_is_kept_for_the_parser() -> None:
    assert LineReader(10).feed(b"g a\r\n") == [b"g a\r"]


def test_line_at_the_limit_is_accepted_with_or_without_cr() -> None:
    reader = LineReader(5)
    assert reader.feed(b"12345\n12345\r\n") == [b"12345", b"12345\r"]


def test_line_over_the_limit_is_replaced_by_marker() -> None:
    reader = LineReader(5)
    assert reader.feed(b"123456\nok\n") == [TOO_LONG, b"ok"]


def test_cr_does_not_excuse_a_longer_line() -> None:
    assert LineReader(5).feed(b"123456\r\n") == [TOO_LONG]


def test_long_partial_line_is_answered_at_once_and_then_discarded() -> None:
    reader = LineReader(5)
    assert reader.feed(b"123456") == [TOO_LONG]
    assert reader.buffered == 0
    assert reader.feed(b"x" * 100_000) == []
    assert reader.buffered == 0
    assert reader.feed(b"tail\ng a\n") == [b"g a"]


def test_partial_ending_in_cr_at_the_limit_may_still_be_valid() -> None:
    reader = LineReader(5)
    assert reader.feed(b"12345\r") == []
    assert reader.feed(b"\n") == [b"12345\r"]
    assert reader.feed(b"12345\r") == []
    assert reader.feed(b"x\n") == [TOO_LONG]


def test_one_byte_at_a_time_buffer_stays_bounded() -> None:
    reader = LineReader(16)
    seen = []
    for byte in b"g key\n" + b"y" * 1000 + b"\ni k\n":
        seen += reader.feed(bytes([byte]))
        assert reader.buffered <= 17
    assert seen == [b"g key", TOO_LONG, b"i k"]


@given(
    lines=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30),
)
def test_any_chunking_gives_the_same_lines(lines: list[bytes], cuts: list[int]) -> None:
    """However the stream is split, the reader returns the same lines in order."""
    stream = b"".join(line + b"\n" for line in lines)
    points = sorted({min(c, len(stream)) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    expected = [
        line if len(line) <= 8 or (len(line) == 9 and line.endswith(b"\r")) else TOO_LONG
        for line in lines
    ]
    assert feed_all(LineReader(8), [c for c in chunks if c]) == expected
