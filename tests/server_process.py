"""A real ``python -m elockd`` process for tests that need one outside the test's
own trio run (the blocking client, elockctl, the contrib scripts)."""

from __future__ import annotations

import subprocess
import sys
import threading


def start_server(*args: str) -> tuple[subprocess.Popen[str], int]:
    """Start elockd on a free port; returns the process and the port."""
    process = subprocess.Popen(
        [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    for line in process.stderr:
        if "listening on" in line:
            first = line.split("listening on ", 1)[1].split(",")[0]
            # Keep reading its log, so a full pipe can never stall the server.
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, int(first.rsplit(":", 1)[1])
    raise RuntimeError(f"server did not start (exit {process.wait()})")


def stop_server(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
    if process.stderr:
        process.stderr.close()
