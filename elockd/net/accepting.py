"""What every accept loop (the lock port's TCP and Unix listeners, the HTTP port) does
when ``accept()`` fails: the failure is one connection's or the system's for a
moment, never a reason to end the server, which would free every lock.

* An errno of :data:`IGNORABLE_ACCEPT_ERRNOS` is about the one connection being
  accepted (a firewall said no, the peer reset or its network went away first); the
  loop simply takes the next. It is trio's ``SocketListener`` list, which follows
  Linux's accept(2) ("should treat them like EAGAIN by retrying") and the BSDs.
* An errno of :data:`CAPACITY_ERRNOS` says the process or the system is out of
  descriptors, memory or buffers right now: the loop pauses :data:`ACCEPT_PAUSE`
  and goes on (trio's ``serve_listeners`` does the same).
* Anything else is unexpected, and is logged as an error; the loop still pauses
  and goes on rather than take the locks of every connected client down with it.

Either kind is logged at most once per 10 s with a count (:data:`accept_warning`),
however often it happens.
"""

from __future__ import annotations

import errno
import logging
import os

from elockd.observe.logthrottle import LogThrottle

log = logging.getLogger("elockd")

#: trio's ``_ignorable_accept_errno_names`` (trio/_highlevel_socket.py): errors of the
#: connection being accepted, not of the listener. tests/test_accept.py checks this
#: stays the set the installed trio ignores.
_IGNORABLE_NAMES = (
    "EPERM",  # Linux, when a firewall rule denies the connection
    "ECONNABORTED",  # the peer gave up before the accept (BSDs)
    "EPROTO",
    "ENETDOWN",
    "ENOPROTOOPT",
    "EHOSTDOWN",
    "ENONET",
    "EHOSTUNREACH",
    "EOPNOTSUPP",
    "ENETUNREACH",
    "ENOSR",
    "ESOCKTNOSUPPORT",
    "EPROTONOSUPPORT",
    "ETIMEDOUT",
    "ECONNRESET",
)
IGNORABLE_ACCEPT_ERRNOS = frozenset(
    getattr(errno, name) for name in _IGNORABLE_NAMES if hasattr(errno, name)
)
#: "Out of a resource now", not "this listener is broken": trio.serve_listeners' set.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: How long an accept loop pauses after a capacity (or unexpected) error.
ACCEPT_PAUSE = 0.1
#: One line per 10 s, with a count, however often accept() fails (every listener).
accept_warning = LogThrottle(log, logging.WARNING)
accept_error = LogThrottle(log, logging.ERROR)


def errno_name(error: OSError) -> str:
    """``ENETDOWN (Network is down)``; the exception's own words for no errno."""
    code = error.errno
    if code is None:
        return str(error) or type(error).__name__
    return f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"


def accept_pause(error: OSError, listener: str) -> float:
    """How long the accept loop of ``listener`` (``"accept"``, ``"HTTP accept"``)
    waits before it accepts again after ``error``: 0 for an error of the one
    connection, :data:`ACCEPT_PAUSE` otherwise (logged, rate-limited)."""
    if error.errno in IGNORABLE_ACCEPT_ERRNOS:
        return 0.0
    if error.errno in CAPACITY_ERRNOS:
        accept_warning("%s: %s; pausing %.1f s", listener, errno_name(error), ACCEPT_PAUSE)
    else:
        accept_error(
            "%s: unexpected %s; pausing %.1f s, serving on",
            listener,
            errno_name(error),
            ACCEPT_PAUSE,
        )
    return ACCEPT_PAUSE
