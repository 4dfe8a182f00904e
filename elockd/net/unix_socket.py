"""Listening Unix sockets: the lock port's ``--unix`` and the hand-over's
``--control-socket``; and the names of the peers that connect to them.

A path is taken only from nobody: a socket file that still answers belongs to a
live server (another elockd, or this one's predecessor), and taking it over would
cut that server off from every new client and then, when the thief exits, unlink
the path under it. Only a stale socket file (nobody listens) is replaced. For the
same reason a server unlinks its path on exit only if the path is still the socket
it bound (:class:`OwnedPath`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from collections.abc import Iterable

log = logging.getLogger("elockd")

#: The longest path of a Unix socket in bytes: ``sockaddr_un.sun_path`` is 108 bytes
#: on Linux, its terminating NUL included; CPython refuses a longer one ("AF_UNIX
#: path too long"). tests/test_config_bounds.py checks it against bind() itself.
UNIX_PATH_MAX = 107
#: ``struct ucred`` of SO_PEERCRED: pid, uid, gid (each 32 bits on Linux).
_UCRED = struct.Struct("3i")


def refuse_if_live(path: str) -> None:
    """Raise EADDRINUSE ("another elockd listens on PATH") if something accepts
    connections at ``path``; return if nothing is there or the socket is stale.
    A listener whose backlog is full (EAGAIN) is live too."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return  # nothing there, or a socket file nobody listens on
        except BlockingIOError:
            pass  # a live listener with a full backlog
        except OSError as error:
            if error.errno in (errno.ENOTSOCK, errno.EPROTOTYPE, errno.ECONNREFUSED):
                return  # not a stream socket: left to the caller (it is refused there)
            raise
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"Another elockd listens on {path}")


class OwnedPath:
    """The identity (device, inode) of the socket file a server bound, so that on exit
    it unlinks the path only while the path still is that file: a successor, or
    another server started after someone removed ours, may listen there now."""

    __slots__ = ("identity", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.identity = _identity(path)

    def unlink(self) -> bool:
        """Remove the path if it is still ours; True when it was removed."""
        if self.identity is None or _identity(self.path) != self.identity:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return True


def _identity(path: str) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return (status.st_dev, status.st_ino) if stat.S_ISSOCK(status.st_mode) else None


def open_unix_socket(path: str, backlog: int, mode: int | None = None) -> socket.socket:
    """A listening, non-blocking Unix socket at ``path``, replacing a stale socket file
    (only: a live one is EADDRINUSE, anything else at the path an error). With
    ``mode`` the file gets exactly that mode, whatever the umask (created under a
    umask that never lets it be wider, then set)."""
    refuse_if_live(path)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o777 & ~mode) if mode is not None else None
    try:
        sock.bind(path)
        if mode is not None:
            os.chmod(path, mode)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    finally:
        if old_mask is not None:
            os.umask(old_mask)
    sock.setblocking(False)
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The connected peer's ``(pid, uid, gid)`` as the kernel saw them at connect."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


class UnixPeers:
    """Names for Unix-socket peers, which have no address: ``unix:1``, ``unix:2``...
    in the order they connect, as glockd r312 names them, so that ``me``, ``d``,
    ``who``, ``info`` and the logs tell them apart."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def skip_past(self, names: Iterable[bytes]) -> None:
        """Number on after the ``unix:N`` among ``names`` (the connections a
        successor took over), so that no two live peers share a name."""
        for name in names:
            prefix, _, number = name.partition(b":")
            if prefix == b"unix" and number.isdigit():
                self.last = max(self.last, int(number))

    def name(self, sock: socket.socket) -> bytes:
        """The next name; at debug level, logged with the peer's pid, uid and gid."""
        self.last += 1
        name = b"unix:%d" % self.last
        log_unix_peer(name, sock)
        return name


def log_unix_peer(name: bytes, sock: socket.socket) -> None:
    """``unix peer`` with ``peer``, ``pid``, ``uid``, ``gid`` (SO_PEERCRED), at debug
    level: the key from a ``unix:N`` in any other record to the process behind it."""
    if log.isEnabledFor(logging.DEBUG):
        pid, uid, gid = peer_credentials(sock)
        log.debug("unix peer", extra={"peer": name.decode(), "pid": pid, "uid": uid, "gid": gid})
