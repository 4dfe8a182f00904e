"""Wrong doors: what elockctl adds to a failure when it was sent to the wrong port.

A new user's first mistakes are the port and TLS: ``--port`` pointed at elockd's
HTTP port, plain TCP to a TLS port, TLS to a plain one, no client certificate for
a server that wants one. Each ends in a failure whose bare words ("not an elockd
reply", "closed the connection") do not say what to change; :func:`hint` reads
the failure (and, for a silent close, asks the port once more) and names the flag.

The client's first request starts with a blank (see ``ClientCore``), which an
HTTP server or a TLS port refuses at once, so these failures come at once too.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

from elockd.client import ConnectionLost, ProtocolError

#: The first bytes of a TLS record: an alert (21) or a handshake (22), version 3.x.
TLS_RECORDS = (b"\x15\x03", b"\x16\x03")
#: OpenSSL's reasons when the peer answered a TLS handshake with something else.
NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST")
#: OpenSSL's reasons for a server's alert about a client certificate.
CERTIFICATE_WANTED = ("CERTIFICATE_REQUIRED", "PEER_DID_NOT_RETURN_A_CERTIFICATE")

HTTP_PORT = (
    " (an HTTP port, such as elockd's metrics/WebSocket port: give the lock port "
    "with --port, or --url ws://HOST:PORT/ for a WebSocket session there)"
)
TLS_PORT = " (the port speaks TLS: add --tls, and --tls-ca PEM unless a system CA signed it)"
NO_TLS = " (the port does not speak TLS: leave out the --tls options, or check --port)"
CERTIFICATE = " (the server wants a client certificate: --tls-cert PEM --tls-key PEM)"
MAYBE_CERTIFICATE = (
    " (it ended the TLS session before any reply, as a server that wants a client "
    "certificate does: --tls-cert PEM --tls-key PEM)"
)


def hint(error: BaseException, options: dict[str, Any], client_cert: bool) -> str:
    """Words to add to the one-line message of ``error``, or ``""``."""
    if isinstance(error, ProtocolError):
        if error.data.startswith(b"HTTP/"):
            return HTTP_PORT
        if error.data[:2] in TLS_RECORDS:
            return TLS_PORT
        return " (is it an elockd port?)"
    if not isinstance(error, ConnectionLost) or options.get("unix") or options.get("url"):
        return ""
    text = f"{error} {error.__cause__ or ''}"
    closed = any(word in text for word in ("closed the connection", "EOF", "reset by peer"))
    if options.get("ssl_context") is None:
        if closed and speaks_tls(options["host"], options["port"], options["connect_timeout"]):
            return TLS_PORT
        return ""
    if any(reason in text for reason in CERTIFICATE_WANTED):
        return CERTIFICATE
    if any(reason in text for reason in NOT_TLS):
        return NO_TLS
    if closed and not client_cert:
        return MAYBE_CERTIFICATE
    return ""


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether a TLS handshake with ``host:port`` completes (nothing verified: the
    question is only whether TLS is spoken there)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=min(timeout, 3.0)) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False
