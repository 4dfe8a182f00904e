"""systemd's readiness protocol: one datagram to ``$NOTIFY_SOCKET`` (sd_notify(3)).

No library: the protocol is a single ``sendto``. ``READY=1`` when the server
listens; after a hand-over the successor also sends ``MAINPID=`` so that systemd
follows it as the unit's main process (the unit needs ``NotifyAccess=all``, since
the successor is not the process systemd started).

It lives beside the layers, not in ``daemon/``: the server (daemon/server.py) sends
``READY=1`` and elockctl's ``upgrade`` (ctl/upgrade.py) relays a successor's
``MAINPID=``, and ``ctl/`` may not import ``daemon/``. Standard library only.
"""

from __future__ import annotations

import os
import socket


def sd_notify(*assignments: str) -> bool:
    """Send ``KEY=VALUE`` lines to systemd; False when not run by systemd (or the
    socket is gone: readiness is advice, never a reason to fail)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    return send_notification(address, "\n".join(assignments).encode())


def send_notification(address: str, message: bytes) -> bool:
    """One datagram to a notify socket (``@name``: an abstract socket); False when it
    could not be sent."""
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError:
        return False
    return True
