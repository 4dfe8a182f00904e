"""How long the client takes to read a large multi-line reply, without a network.

A ``dump`` of N held locks (one ``KEY: OWNER`` line each, then ``END``) is fed
through the sans-IO :class:`~elockd.client.core.ClientCore` in chunks of the size
the clients read from their sockets (64 KiB), as the reader task or the I/O thread
would. Only parsing is timed: building the reply comes first.

    .venv/bin/python bench/client_parse.py                 # 1,000,000 lines
    .venv/bin/python bench/client_parse.py --lines 100000 --chunk 1024
"""

from __future__ import annotations

import argparse
import threading
import time

from elockd.client.core import ClientCore, parse_lines


def dump_reply(lines: int) -> bytes:
    """``dump``'s reply for ``lines`` exclusive holds, each by its own address."""
    body = b"".join(
        b"key-%07d: 127.0.0.1:%d\r\n" % (index, 10000 + index % 50000) for index in range(lines)
    )
    return body + b"END\r\n"


def parse_seconds(reply: bytes, chunk: int) -> float:
    """Seconds to feed ``reply`` in ``chunk``-byte pieces and read its lines."""
    core = ClientCore(threading.Event)
    op = core.simple(b"dump", 0.0, parse_lines)
    start = time.perf_counter()
    for at in range(0, len(reply), chunk):
        core.receive(reply[at : at + chunk], 0.0)
    lines = op.finish()
    seconds = time.perf_counter() - start
    assert core.error is None, core.error
    assert len(lines) == reply.count(b"\r\n") - 1
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines in the reply")
    parser.add_argument("--chunk", type=int, default=65536, help="bytes per receive")
    parser.add_argument("--runs", type=int, default=3, help="runs; the best is printed")
    args = parser.parse_args()
    reply = dump_reply(args.lines)
    best = min(parse_seconds(reply, args.chunk) for _ in range(args.runs))
    print(
        f"{args.lines:,} lines, {len(reply):,} bytes in {args.chunk:,}-byte chunks: "
        f"{best:.3f} s (best of {args.runs})"
    )


if __name__ == "__main__":
    main()
