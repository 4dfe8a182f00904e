"""The pause of a hand-over (docs/upgrade.md), with many connections holding locks.

    python bench/handover.py --connections 10000 --locks 100

starts an elockd with ``--control-socket``, opens CONNECTIONS connections that take
LOCKS locks each (tests/support/crowd.py, in a process of its own), runs a probe doing
``g``/``r`` every 5 ms on a connection of its own, then starts ``elockd --take-over``
and waits until the old process has exited. With ``--stuck N``, N more clients
have sent ``d``/``q`` requests with a tiny receive buffer and read nothing, until
the server stopped reading them (docs/upgrade.md, "A client that does not read").
It prints the pause the probe saw (its
longest round trip), the pause the new process logged (from the old one's pausing
to its own first request served), the hand-over's wall time from starting the new
process, and checks that every lock is still held afterwards.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CROWD = ROOT / "tests" / "support" / "crowd.py"


def start(args: list[str], lines: list[str]) -> tuple[subprocess.Popen[str], int]:
    """elockd on a free port (the tests' own starter: it drains the log into ``lines``)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.server_process import start_server

    return start_server(*args, log=lines)


#: A stuck client's requests: ``d`` and ``q`` padded with blanks the server ignores.
STUCK_REQUESTS = b"d" + b" " * 3999 + b"\n" + b"q" + b" " * 3999 + b"\n"


def stuck_client(port: int) -> socket.socket:
    """A client with a tiny receive buffer that sends requests without reading a
    byte, until its sends have been blocked for 0.5 s: the server is then stuck
    in a send to it and reads it no more."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    blocked_since = None
    while True:
        try:
            sock.send(STUCK_REQUESTS)
            blocked_since = None
        except BlockingIOError:
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since > 0.5:
                return sock
            time.sleep(0.02)


class Probe(threading.Thread):
    """g/r round trips every 5 ms: (when it was sent, how long it took)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.samples: list[tuple[float, float]] = []
        self.running = True

    def run(self) -> None:
        buffer = b""
        while self.running:
            for verb in (b"g ", b"r "):
                sent = time.monotonic()
                self.sock.sendall(verb + b"probe\n")
                while b"\n" not in buffer:
                    buffer += self.sock.recv(4096)
                buffer = buffer[buffer.index(b"\n") + 1 :]
                self.samples.append((sent, time.monotonic() - sent))
            time.sleep(0.005)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--locks", type=int, default=1, help="locks per connection")
    parser.add_argument("--stuck", type=int, default=0, help="clients that never read")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        control = str(Path(scratch) / "control.sock")
        limits = [
            "--max-connections",
            str(options.connections + 100),
            "--max-holds",
            str(max(options.locks, 10_000)),
        ]
        old_lines: list[str] = []
        old, port = start(["--control-socket", control, *limits], old_lines)
        crowd = subprocess.Popen(
            [
                sys.executable,
                str(CROWD),
                str(port),
                str(options.connections),
                str(options.locks),
                "g c{c}-{n}\n",
                str(options.locks),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert crowd.stdout is not None
        if crowd.stdout.readline().strip() != "ready":
            raise SystemExit("the crowd did not get its locks")
        stuck = [stuck_client(port) for _ in range(options.stuck)]
        probe = Probe(port)
        probe.start()
        time.sleep(0.5)
        new_lines: list[str] = []
        began = time.monotonic()
        new: subprocess.Popen[str] | None = None
        try:
            new, _ = start(["--take-over", control, *limits], new_lines)
            status: int | str = old.wait(timeout=60)
        except RuntimeError:  # the new process exited: the hand-over failed
            status = "still serving: the hand-over failed"
        wall = time.monotonic() - began
        time.sleep(0.5)
        probe.running = False
        probe.join()
        check = socket.create_connection(("127.0.0.1", port))
        check.sendall(b"q\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            reply += check.recv(65536)
        locks = int(re.search(rb"\nlocks: (\d+)", reply)[1])  # type: ignore[index]
        crowd.kill()
        for sock in stuck:
            sock.close()
        for process in (old, new):
            if process is not None:
                process.kill()
                process.wait()
    logged = next((line.strip() for line in new_lines if "took over" in line), "(not logged)")
    worst_at, worst = max(probe.samples, key=lambda sample: sample[1])
    print(f"{options.connections} connections x {options.locks} locks, {options.stuck} stuck")
    print(f"old process exit status: {status}")
    print(f"probe: worst round trip {worst * 1000:.1f} ms over {len(probe.samples)}")
    print(f"new process: {logged.split('[info] ', 1)[-1]}")
    print(f"hand-over wall time from starting the new process: {wall:.2f} s")
    print(f"locks held after: {locks} (expected {options.connections * options.locks})")
    return 0 if status == 0 and locks == options.connections * options.locks else 1


if __name__ == "__main__":
    sys.exit(main())
