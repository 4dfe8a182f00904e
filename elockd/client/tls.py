"""TLS settings for the clients, from the files an operator has at hand."""

from __future__ import annotations

import ssl


def tls_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client context that verifies the server against ``ca_file`` (the system's
    CAs when None) and, for mutual TLS, presents ``cert_file``/``key_file``."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    elif key_file:
        raise ValueError("a TLS key needs its certificate")
    return context
