"""The one way the tests start a real ``python -m elockd`` process, for tests that
need one outside the test's own trio run (signals, the blocking client, elockctl,
the contrib scripts, hostile clients, cluster nodes).

A thread drains the server's stderr for as long as the process lives, so a server
that logs a lot can never block on a full pipe. A test that wants the log passes a
``log`` list; after the process has exited, :func:`drained` waits until every line
it wrote is in that list."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

#: What the ``spawn_server`` fixture hands a test: ``start(*args, log=None)``.
SpawnServer = Callable[..., tuple[subprocess.Popen[str], int]]

#: The drain thread of each started process, by pid.
_drains: dict[int, threading.Thread] = {}


def start_server(
    *args: str,
    log: list[str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    env: dict[str, str] | None = None,
    module: str = "elockd",
) -> tuple[subprocess.Popen[str], int]:
    """Start elockd on a free port; returns the process and the port.

    ``log``, when given, receives every line the server logs (from a thread, so a
    full pipe can never stall the server); ``preexec_fn`` runs in the child before
    it starts (to set resource limits, say); ``env``, when given, is the child's
    whole environment (a skewed clock, say); ``module`` is what ``python -m`` runs
    (a test's wrapper around elockd's main, say)."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", "--metrics-port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
        env=env,
    )
    assert process.stderr is not None
    stderr = process.stderr
    for line in stderr:
        if log is not None:
            log.append(line)
        if "listening on" in line:
            first = line.split("listening on ", 1)[1].split(",")[0]

            def drain() -> None:
                for later in stderr:
                    if log is not None:
                        log.append(later)

            thread = threading.Thread(target=drain, daemon=True)
            thread.start()
            _drains[process.pid] = thread
            return process, int(first.rsplit(":", 1)[1])
    raise RuntimeError(f"server did not start (exit {process.wait()})")


def drained(process: subprocess.Popen[str], timeout: float = 10) -> None:
    """Wait until the exited ``process``'s whole stderr is in its ``log``."""
    thread = _drains.get(process.pid)
    if thread is not None:
        thread.join(timeout)
        assert not thread.is_alive(), f"stderr of pid {process.pid} still open after {timeout} s"


def stop_server(process: subprocess.Popen[str]) -> None:
    """SIGKILL (if it still runs), reap, and close its pipe."""
    if process.poll() is None:
        process.kill()
    process.wait()
    thread = _drains.pop(process.pid, None)
    if thread is not None:
        thread.join(2)  # a child that kept the pipe open must not hold the test up
    if process.stderr:
        process.stderr.close()


def mutual_tls_flags(files: dict[str, str], *, auth: bool = False) -> list[str]:
    """elockd's flags for a mutual-TLS lock port from the ``tls_files`` fixture's
    PEM files, and its token with ``auth``."""
    flags = ["--tls-cert", files["cert"], "--tls-key", files["key"], "--tls-client-ca", files["ca"]]
    return [*flags, "--auth-token-file", files["token"]] if auth else flags
