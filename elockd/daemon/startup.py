"""Start-up mistakes as one line for the operator, never a traceback.

A port in use, a missing certificate or an unresolvable host is a mistake in the
set-up, not a bug: the operator needs the flag, its value and the cause
(``--metrics-port 9998: address already in use``), and a 40-line traceback through
trio hides exactly that. The server raises :class:`StartupError` where it knows
which flag is to blame; the command line prints it and exits 2, as for any other
mistake in the settings (a port in use or a missing file is one too: the settings
name something this machine does not give).
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

#: Said after a lock port or metrics port that is taken.
LOCK_PORT_HINT = "another elockd? choose another --port"
METRICS_PORT_HINT = "another elockd? set --metrics-port 0 to turn metrics off"


#: A value (a path, a host, a TOML value) is shown in an error line up to this many
#: characters: enough to recognise it, and a 50 MB value does not become 50 MB of
#: stderr.
VALUE_SHOWN = 200
#: The longest error line printed, whatever it holds.
LINE_SHOWN = 300


class StartupError(Exception):
    """A set-up problem found at start-up, phrased ``--flag value: cause``."""


def _printable(text: str) -> str:
    """``text`` with every control or non-printing character escaped (``\\n``,
    ``\\x00``, ``\\u2028``), so that it stays one line and repaints no terminal."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def shown(value: object, limit: int = VALUE_SHOWN) -> str:
    """``value`` as an error line shows it: escaped, and cut to ``limit`` characters
    (``...`` and how many more said where it was cut)."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = str(value)
        except ValueError:  # an int of more digits than Python converts
            text = f"a {type(value).__name__} too large to show"
    escaped = _printable(text[: limit + 1])
    if len(text) <= limit and len(escaped) <= limit:
        return escaped
    return f"{escaped[:limit]}... ({len(text)} characters)"


def one_line(message: str) -> str:
    """The whole of an error line, made safe whatever went into it: one line of at
    most :data:`LINE_SHOWN` characters with its ``elockd: `` (room is kept for the
    ``... (N characters)`` of a cut)."""
    return shown(message, LINE_SHOWN - 40)


def os_cause(error: OSError) -> str:
    """What went wrong, in words (``address already in use``), without errno digits."""
    if isinstance(error, socket.gaierror):
        return f"cannot resolve the address ({error.strerror or error})"
    if error.errno == errno.EADDRNOTAVAIL:
        return "not an address of this machine"
    if error.strerror:
        return error.strerror[0].lower() + error.strerror[1:]
    return str(error) or type(error).__name__


def find(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """``error`` itself if it is a ``kind``, else the first ``kind`` inside it when it
    is an exception group (trio wraps errors raised in nurseries in groups)."""
    if isinstance(error, kind):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = find(inner, kind)
            if found is not None:
                return found
    return None


def _os_error_in(error: BaseException) -> OSError | None:
    found = find(error, OSError)
    return found if isinstance(found, OSError) else None


@contextmanager
def blame_address(
    host_flag: str, host: str, port_flag: str, port: int, hint: str
) -> Iterator[None]:
    """Turn a failure to listen on ``host:port`` into a :class:`StartupError` that
    names the flag at fault: the host when it cannot be resolved or is not ours, the
    port otherwise."""
    try:
        yield
    except (OSError, BaseExceptionGroup) as caught:
        error = _os_error_in(caught)
        if error is None:
            raise
        cause = os_cause(error)
        if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"{host_flag} {shown(host)}: {cause}") from caught
        if error.errno == errno.EADDRINUSE:
            cause += f" ({hint})"
        elif error.errno == errno.EACCES and 0 < port < 1024:
            cause += " (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
        raise StartupError(f"{port_flag} {port}: {cause}") from caught


@contextmanager
def blame_file(flag: str, path: str, what: str = "") -> Iterator[None]:
    """Turn a failure to read (or create) ``path`` into ``--flag PATH: cause``.
    ``what`` says what the file should have been when OpenSSL refuses its content
    (``not a PEM certificate``)."""
    try:
        yield
    except OSError as error:
        if isinstance(error, ssl.SSLError):
            cause = f"{what or 'refused by OpenSSL'} ({error.reason or error})"
        else:
            cause = os_cause(error)
        raise StartupError(f"{flag} {shown(path)}: {cause}") from error
