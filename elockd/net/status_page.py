"""The status page (``GET /status`` on the HTTP port): static files, read from the
package, served with headers that keep a browser from doing more with them than
showing the page.

Why it looks like this:

* The page holds no data. Its script opens a WebSocket session on ``/`` of the same
  port and ``watch``es there, so the lock table reaches the browser only through a
  session that passed ``auth`` when ``--auth-token-file`` is set. The files are
  therefore served to anyone who can reach the port, as ``/healthz`` is: there is
  nothing in them to protect, and a page that asked for a token before it could ask
  for a token would need a second login scheme.
* Plain HTML, one script and one stylesheet, read once with :mod:`importlib.resources`
  (they ship as package data): no build step, no CDN, nothing fetched elsewhere.
* Scripts and styles are separate files so that the Content-Security-Policy can
  forbid every inline script and style: even a key or owner that slipped into the
  markup could not run. The script writes data with ``textContent`` only.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

#: URL path -> (file in elockd/net/static, content type).
ASSETS = {
    "/status": ("status.html", b"text/html; charset=utf-8"),
    "/status/app.js": ("status.js", b"text/javascript; charset=utf-8"),
    "/status/app.css": ("status.css", b"text/css; charset=utf-8"),
}

#: A Host header we are willing to name in the policy: a host name, IPv4 or
#: bracketed IPv6 address, and a port. Anything else gets ``'self'`` alone.
SAFE_HOST = re.compile(rb"[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?")

Headers = list[tuple[bytes, bytes]]


@cache
def asset(path: str) -> bytes:
    """The bytes of the packaged file served at ``path`` (read once)."""
    name, _ = ASSETS[path]
    return files("elockd.net").joinpath("static", name).read_bytes()


def content_security_policy(host: bytes | None) -> bytes:
    """Only this origin's script, style and WebSocket; no frames, forms or plugins.

    ``connect-src 'self'`` covers ``ws://`` to the same host in CSP Level 3 browsers;
    the same host's ``ws:``/``wss:`` URLs are named too for older ones (``wss:`` when a
    TLS proxy fronts the port). A Host header that is not plainly a host is not echoed.
    """
    connect = b"'self'"
    if host is not None and SAFE_HOST.fullmatch(host):
        connect += b" ws://" + host + b" wss://" + host
    return (
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src "
        + connect
        + b"; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def status_response(path: str, host: bytes | None) -> tuple[bytes, bytes, Headers] | None:
    """(body, content type, extra headers) of the status page's file at ``path``, or
    None when ``path`` is not one of them."""
    if path not in ASSETS:
        return None
    headers = [
        (b"cache-control", b"no-cache"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
    ]
    if path == "/status":
        headers += [
            (b"content-security-policy", content_security_policy(host)),
            (b"x-frame-options", b"DENY"),
        ]
    return asset(path), ASSETS[path][1], headers
