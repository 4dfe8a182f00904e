"""Listening Unix sockets: the lock port's ``--unix`` and the hand-over's
``--control-socket``."""

from __future__ import annotations

import contextlib
import os
import socket
import stat


def open_unix_socket(path: str, backlog: int, mode: int | None = None) -> socket.socket:
    """A listening, non-blocking Unix socket at ``path``, replacing a stale socket file
    (only: anything else at the path is an error). With ``mode`` the file is created
    with it (under a umask, so it is never wider for a moment)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o777 & ~mode) if mode is not None else None
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        if old_mask is not None:
            os.umask(old_mask)
    if mode is not None:
        os.chmod(path, mode)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
