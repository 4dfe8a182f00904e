"""A silent TCP peer is given up on a fixed time after it was last heard from,
whether or not a reply to it was in flight when it went silent.

Linux notices a peer that vanished (no FIN, no RST ever comes) in one of two ways:

* nothing unacknowledged: keepalive probes, counted from the last segment the peer
  sent (an answer to a probe counts). ``TCP_USER_TIMEOUT`` replaces the probe
  count: the connection dies at the first probe after that much silence.
* data unacknowledged: keepalive stops probing, and the connection dies once the
  oldest unacknowledged data has waited ``TCP_USER_TIMEOUT`` since it was *sent*.

A reply that answers a request just read is sent right after the peer was heard, so
both count from about the same moment. A late reply does not: a grant after a wait,
sent into the void 20 s after the waiter's host vanished, restarted the whole bound
then (a key freed 44.5 s after the cut at ``--keepalive 30``). So before a late reply,
:func:`lower_user_timeout` sets ``TCP_USER_TIMEOUT`` to what is left of the bound
since the peer was last heard (Linux's ``TCP_INFO``, the clock keepalive runs on),
never under :data:`LATE_REPLY_FLOOR`; once the peer is heard again the whole bound
applies again (:func:`set_user_timeout`). Linux 4.19 and later also cut the
retransmission timer at the user timeout, so the connection dies on time, not at
the next retransmission.

Plain socket calls, no trio: the lock port uses them (elockd/net/transport.py), and any
other TCP port can.
"""

from __future__ import annotations

import socket
import struct

#: A late reply is given at least this long to be acknowledged, however long the
#: peer was silent: a couple of retransmissions (200 ms apart at first), and the
#: ``+ 1 s`` of the bound in docs/operations.md.
LATE_REPLY_FLOOR = 1.0
#: A reply sent this long after its request was read is late. Below it the bound
#: runs from the send, less than this after the peer was heard: the same ``+ 1 s``.
LATE_REPLY = 1.0
#: ``tcpi_last_data_recv`` and ``tcpi_last_ack_recv`` (milliseconds ago) in Linux's
#: ``struct tcp_info``, stable since 2.6.
_LAST_RECEIVED = struct.Struct("=II")
_LAST_RECEIVED_OFFSET = 52
_TCP_INFO_SIZE = _LAST_RECEIVED_OFFSET + _LAST_RECEIVED.size


def keepalive_settings(seconds: float) -> tuple[int, int, int]:
    """TCP_KEEPIDLE, TCP_KEEPINTVL and TCP_KEEPCNT that notice a vanished peer well
    within ``seconds``: half of it idle, then probes a tenth of it apart until 80%
    of it has passed (30 s: idle 15 s, then 3 probes 3 s apart: dead at 24 s). The
    kernel counts whole seconds, so very small values round up to 1 s steps."""
    idle = max(1, int(seconds * 0.5))
    interval = max(1, int(seconds * 0.1))
    count = max(1, int((seconds * 0.8 - idle) // interval))
    return idle, interval, count


def keepalive_bound(seconds: float) -> int:
    """Seconds of silence after which :func:`keepalive_settings` give a peer up:
    at most 0.8 x ``seconds`` from 5 up (24 at 30), never more than ``seconds`` from 2 up.
    0 for ``seconds`` 0: no bound of ours (the operating system's keepalive)."""
    if seconds <= 0:
        return 0
    idle, interval, count = keepalive_settings(seconds)
    return idle + interval * count


def silent_for(sock: socket.socket) -> float:
    """Seconds since the peer's last segment arrived, data or bare ACK: the silence
    that Linux's keepalive counts."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    data, ack = _LAST_RECEIVED.unpack_from(info, _LAST_RECEIVED_OFFSET)
    return float(min(data, ack)) / 1000


def set_user_timeout(sock: socket.socket, seconds: float) -> None:
    """How long sent data may stay unacknowledged (and, with keepalive on, how long
    the peer may stay silent) before the connection is dropped."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(seconds * 1000)))


def lower_user_timeout(sock: socket.socket, bound: float) -> float | None:
    """Before a late reply on ``sock``: let data sent now stay unacknowledged only
    until ``bound`` seconds after the peer was last heard from (at least
    :data:`LATE_REPLY_FLOOR` from now). The timeout set, or None when the peer was
    heard less than :data:`LATE_REPLY` ago (the bound from the send is then as
    good). Restore it with :func:`set_user_timeout` once the peer is heard again."""
    silence = silent_for(sock)
    if silence < LATE_REPLY:
        return None  # heard just now: the bound from the send is the same, + < 1 s
    left = max(LATE_REPLY_FLOOR, bound - silence)
    set_user_timeout(sock, left)
    return left
