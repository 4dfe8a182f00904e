"""What the operating system (and etcd) accept, checked before the server starts.

A setting that passes here must not fail later: a value the kernel refuses only at
the first connection (``setsockopt(TCP_KEEPIDLE)``) would end the server with every
lock in it, and a hand-over successor with the same settings would take every lock
over and then do the same. So each bound is the one the receiving end enforces,
derived below from where it comes from, and tests/test_config_bounds.py checks
the kernel's against the kernel itself. Each check raises ValueError with what is
expected; :mod:`elockd.daemon.main` names the flag, variable or key.
"""

from __future__ import annotations

import os
import sys

from elockd.daemon.startup import shown
from elockd.net.unix_socket import UNIX_PATH_MAX

#: TCP and UDP port numbers are 16 bits.
MAX_PORT = 65535
#: Counts and sizes (connections, bytes of a line, keys, holds) are compared with
#: lengths Python keeps in a C ``Py_ssize_t``: none can usefully be larger.
MAX_COUNT = sys.maxsize
#: The longest lease etcd grants (``MaxLeaseTTL`` in etcd's lessor: 9,000,000,000 s,
#: about 285 years). A cluster node hands etcd durations (``--session-ttl``, and
#: grace times in milliseconds), so no duration may be longer; nothing else needs to.
MAX_LEASE_TTL = 9_000_000_000
MAX_SECONDS = MAX_LEASE_TTL
#: Linux's ``MAX_TCP_KEEPIDLE`` (include/net/tcp.h): TCP_KEEPIDLE above it is EINVAL.
MAX_TCP_KEEPIDLE = 32767
#: Linux's ``MAX_TCP_KEEPINTVL`` and ``MAX_TCP_KEEPCNT``.
MAX_TCP_KEEPINTVL = 32767
MAX_TCP_KEEPCNT = 127
#: The longest ``--keepalive``: :func:`elockd.daemon.server.keepalive_settings` idles for half
#: of it in whole seconds, so the largest value whose half still rounds down to
#: MAX_TCP_KEEPIDLE. Its interval (a tenth) and probe count (3) are within theirs,
#: and TCP_USER_TIMEOUT (under 80% of it, in ms) within a C int.
MAX_KEEPALIVE = 2 * MAX_TCP_KEEPIDLE + 1


def check_text(text: str, what: str) -> str:
    """``text`` unless it holds a NUL (the C library would cut it there, silently) or
    characters that are not Unicode (bytes the locale could not decode)."""
    if "\0" in text:
        raise ValueError(f"{what} without NUL characters, not '{shown(text)}'")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} in UTF-8, not '{shown(text)}'") from None
    return text


def check_path(text: str) -> str:
    """A file name: no NUL, and bytes the file system takes (``os.fsencode``)."""
    if "\0" in text:
        raise ValueError(f"a file name without NUL characters, not '{shown(text)}'")
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        raise ValueError(f"a file name, not '{shown(text)}'") from None
    return text


def check_unix_path(text: str) -> str:
    """A Unix socket's path: a file name of at most :data:`UNIX_PATH_MAX` bytes."""
    check_path(text)
    size = len(os.fsencode(text))
    if size > UNIX_PATH_MAX:
        raise ValueError(
            f"a socket path of at most {UNIX_PATH_MAX} bytes (the kernel's limit), "
            f"not {size} bytes: '{shown(text)}'"
        )
    return text


def check_host(text: str) -> str:
    """A host name or address as ``getaddrinfo`` will be given it: Python encodes a
    host with the IDNA codec first (labels of 1-63 characters), and C cuts it at a
    NUL. Whether the name resolves is found out at start."""
    if "\0" in text:
        raise ValueError(f"a host name or address without NUL characters, not '{shown(text)}'")
    if not text.strip():
        raise ValueError("a host name or address, not an empty one")
    try:
        text.encode("idna")
    except UnicodeError as error:
        cause = error.__cause__ or error.__context__ or error
        raise ValueError(f"a host name or address, not '{shown(text)}' ({shown(cause)})") from None
    return text
