"""A scraper in a tight loop (tests/test_hostile.py): GET /metrics as fast as the
server answers, on new connections, for SECONDS seconds.

Run as ``python tests/support/scraper.py PORT SECONDS``.
"""

from __future__ import annotations

import sys
import time
import urllib.request


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            reply.read()


if __name__ == "__main__":
    main()
