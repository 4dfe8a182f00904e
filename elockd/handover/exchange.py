"""The hand-over itself: the old process gives, the new one takes (docs/upgrade.md).

The conversation on the control socket, after the successor connects:

1. new -> old ``hello``: the state versions it reads.
2. old: pauses every connection at a request boundary (:mod:`elockd.handover.pause`), stops
   accepting and stops its deadline timer (a cluster node also freezes its etcd
   work and waits for what is under way), so the tables stand still.
3. old -> new ``header`` with the listening sockets, then the state records
   (:mod:`elockd.handover.state`, with the backend's own tables from its
   ``dump``), each
   connection with its socket, then ``end``.
4. new: rebuilds everything without serving yet, then -> old ``ready``.
5. old -> new ``go`` (it will never serve again) or ``aborted`` (it serves on).
   The old process decides once: ``go`` only if ``ready`` came in time.
6. new: serves; tells systemd it is the main process now; -> old ``done``.
7. old: exits 0.

Anything else (the successor dies, refuses the version, is too slow) and the old
process resumes every connection as if nothing had happened, and logs why. The
state is never served by both: the new process serves only after ``go`` (or after
``ready`` if the old one vanished, which then never serves again either).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from elockd.handover.channel import MAX_FDS_PER_MESSAGE, Channel, ChannelError
from elockd.handover.parked import Parked
from elockd.handover.records import FORMAT, READABLE, VERSION, ConnectionState
from elockd.handover.state import Restorer, StateError, dump_state
from elockd.net.serving import PausableService
from elockd.net.tcp_silence import keepalive_bound
from elockd.net.transport import Closer, SocketTransport
from elockd.net.unix_socket import open_unix_socket
from elockd.protocol.connection import Service

log = logging.getLogger("elockd")

#: How long a connected successor may take to say hello.
HELLO_TIMEOUT = 5.0
#: How long the old process waits for ``done`` after ``go`` before it exits anyway.
DONE_TIMEOUT = 2.0


class TakeOverError(Exception):
    """A hand-over that could not start, phrased ``--take-over PATH: cause``: the
    daemon reports it as a start-up error (one line, exit 2)."""


class HandOverFailed(Exception):
    """Why a hand-over did not happen (the old process logs it and serves on)."""


@dataclass
class Listeners:
    """The listening sockets a server has, as a hand-over moves them. ``lock`` pairs
    each lock-port socket with its kind: ``tcp``, ``tls`` or ``unix``."""

    lock: list[tuple[socket.socket, str]] = field(default_factory=list)
    http: socket.socket | None = None
    control: socket.socket | None = None


def open_control_socket(path: str) -> socket.socket:
    """The control socket at ``path``, mode 0600: whoever can connect can take every
    lock."""
    return open_unix_socket(path, backlog=4, mode=0o600)


# --------------------------------------------------------------------- the giver


@dataclass
class Giver:
    """What the old process hands over, and how it stops and restarts its own work
    (accepting, the deadline timer) around the attempt."""

    service: PausableService
    listeners: Listeners
    stop_work: Callable[[], Awaitable[None]]
    restart_work: Callable[[], None]
    timeout: float

    async def serve(self) -> None:
        """Wait for successors on the control socket; return once one took over."""
        control = self.listeners.control
        assert control is not None
        while True:
            await trio.lowlevel.wait_readable(control)
            try:
                sock, _ = control.accept()
            except BlockingIOError:
                continue
            channel = Channel(sock)
            try:
                if await self.attempt(channel):
                    return
            finally:
                channel.close()

    async def attempt(self, channel: Channel) -> bool:
        """One hand-over; True when the successor has everything."""
        pause = self.service.pause
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                hello, _ = await channel.receive()
        except (ChannelError, trio.TooSlowError) as error:
            log.warning("hand-over: no hello from the successor (%s); serving on", error)
            return False
        versions = hello.get("versions")
        if hello.get("format") != FORMAT or not isinstance(versions, list):
            log.warning("hand-over refused: the successor is not an elockd")
            return False
        if VERSION not in versions:
            log.warning(
                "hand-over refused: the successor reads state versions %s, this is %d",
                versions,
                VERSION,
            )
            await _try_send(channel, {"t": "refused", "why": f"state version {VERSION}"})
            return False
        started = time.monotonic()
        backend = self.service.backend
        await self.stop_work()
        backend.freeze()
        pause.request()
        committed = False
        pause_ms = 0.0
        try:
            resting = await self._wait_for_rest()
            # A successor that stops reading must not keep every client paused.
            with trio.fail_after(self.timeout):
                await backend.settle()
                await self._send_state(channel, started, resting)
                reply, _ = await channel.receive()
            if reply.get("t") != "ready":
                raise HandOverFailed(f"the successor said {reply.get('why') or reply.get('t')}")
            committed = True  # from here on, the state is the successor's
            backend.hand_off()
            await _try_send(channel, {"t": "go"})
            pause_ms = (time.monotonic() - started) * 1000  # the successor serves now
            with trio.move_on_after(DONE_TIMEOUT):
                await channel.receive()  # "done", or EOF: either way we are finished
        except Exception as error:  # whatever went wrong, the clients must not stay paused
            if committed:
                log.warning("hand-over: the successor went quiet after go (%s)", error)
            else:
                why = "no answer in time" if isinstance(error, trio.TooSlowError) else str(error)
                log.warning("hand-over failed: %s; serving on", why or type(error).__name__)
                await _try_send(channel, {"t": "aborted", "why": why})
                backend.thaw()
                pause.resume()
                self.restart_work()
                return False
        log.info("handed over to the successor after a %.0f ms pause; exiting", pause_ms)
        return True

    async def _wait_for_rest(self) -> list[Parked]:
        """Until every connection with a session has parked (or ended): then every
        connection at rest, taken at that instant. A connection at rest can do
        nothing observable until the decision, so this list stays the state to
        hand over, also while one of them moves from its wait to parked (and is,
        for a moment, in neither list of the pause)."""
        service, pause = self.service, self.service.pause
        with trio.move_on_after(self.timeout):
            while True:
                resting = pause.resting()
                conns = {id(p.conn) for p in resting if p.conn is not None}
                if all(id(conn) in conns for conn in service.connections):
                    return resting
                await pause.wait_for_change(0.01)
        busy = len(service.connections) - len(pause.resting())
        raise HandOverFailed(f"{busy} connections did not reach a request boundary")

    async def _send_state(self, channel: Channel, started: float, resting: list[Parked]) -> None:
        listeners = self.listeners
        kinds = [kind for _, kind in listeners.lock]
        fds = [sock.fileno() for sock, _ in listeners.lock]
        if listeners.http is not None:
            kinds.append("http")
            fds.append(listeners.http.fileno())
        if listeners.control is not None:
            kinds.append("control")
            fds.append(listeners.control.fileno())
        await channel.send(
            {
                "t": "header",
                "format": FORMAT,
                "version": VERSION,
                "pid": os.getpid(),
                "paused_at": started,
                "dumped_at": time.monotonic(),
                "listeners": kinds,
                "backend": self.service.backend.kind,
            },
            fds[:MAX_FDS_PER_MESSAGE],
        )
        connections: list[ConnectionState] = []
        movable = 0
        for parked in resting:
            if isinstance(parked.transport, SocketTransport):
                connections.append(ConnectionState(parked, movable))
                movable += 1
            else:  # TLS or WebSocket: its byte stream cannot move (docs/upgrade.md)
                connections.append(ConnectionState(parked, None))
        now = trio.current_time()
        sent = 0
        for record in dump_state(self.service, connections, now):
            fds = []
            if record["t"] == "connections":
                # Their rows come in the list's order; each movable one brings its socket.
                for state in connections[sent : sent + len(record["rows"])]:
                    if state.fd is not None:
                        transport = state.parked.transport
                        assert isinstance(transport, SocketTransport)
                        fds.append(transport.sock.fileno())
                sent += len(record["rows"])
            await channel.send(record, fds)


async def _try_send(channel: Channel, message: dict[str, Any]) -> None:
    """Send if the peer still listens: a message it will not read changes nothing."""
    with contextlib.suppress(ChannelError):
        await channel.send(message)


# --------------------------------------------------------------------- the taker


@dataclass
class TakenOver:
    """What a successor received: listeners and connections to serve, and how to
    tell the old process it may go."""

    listeners: Listeners
    connections: list[Parked]
    channel: Channel
    old_pid: int
    paused_at: float
    sessions: int
    holds: int

    async def finish(self) -> None:
        """Serving now: tell the old process it may exit, and log the pause."""
        await _try_send(self.channel, {"t": "done"})
        self.channel.close()
        pause_ms = (time.monotonic() - self.paused_at) * 1000
        log.info(
            "took over from pid %d: %d connections, %d sessions, %d holds; pause %.0f ms",
            self.old_pid,
            len(self.connections),
            self.sessions,
            self.holds,
            pause_ms,
        )


async def take_over(path: str, service: Service, closer: Closer) -> TakenOver:
    """Connect to the old process at ``path`` and take everything it has; the
    caller serves it, then calls :meth:`TakenOver.finish`. A
    :class:`TakeOverError` names what went wrong."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as error:
        sock.close()
        raise TakeOverError(
            f"--take-over {path}: {error.strerror.lower() if error.strerror else error}"
        ) from None
    channel = Channel(sock)
    try:
        return await _receive_everything(path, channel, service, closer)
    except BaseException:
        channel.close()
        raise


async def _receive_everything(
    path: str, channel: Channel, service: Service, closer: Closer
) -> TakenOver:
    await channel.send({"t": "hello", "format": FORMAT, "versions": list(READABLE)})
    try:
        header, fds = await channel.receive()
        if header.get("t") == "refused":
            raise TakeOverError(f"--take-over {path}: refused: {header.get('why')}")
        if header.get("t") == "aborted":
            raise TakeOverError(f"--take-over {path}: the old process aborted: {header.get('why')}")
        if header.get("t") != "header" or header.get("format") != FORMAT:
            raise TakeOverError(f"--take-over {path}: not an elockd control socket")
        if header.get("version") not in READABLE:
            for fd in fds:
                os.close(fd)
            await _try_send(
                channel, {"t": "refused", "why": f"unknown version {header.get('version')}"}
            )
            raise TakeOverError(
                f"--take-over {path}: state version {header.get('version')} is unknown "
                f"(this elockd reads versions {', '.join(map(str, READABLE))}); "
                "the old process serves on"
            )
        listeners = _listeners(header["listeners"], fds, service)
        theirs, ours = header.get("backend", "memory"), service.backend.kind
        if theirs != ours:
            how = {"etcd": "with --etcd", "memory": "without --etcd"}
            raise StateError(
                f"the old process runs {how.get(theirs, theirs)}, this one {how[ours]}"
            )
        elapsed = time.monotonic() - float(header["dumped_at"])
        restorer = Restorer(service, trio.current_time() - elapsed)
        transports: dict[int, SocketTransport] = {}
        send_timeout = service.config.send_timeout
        bound = keepalive_bound(service.config.keepalive)
        while not restorer.ended:
            record, fds = await channel.receive()
            if record.get("t") == "aborted":
                raise TakeOverError(
                    f"--take-over {path}: the old process aborted: {record.get('why')}"
                )
            if record.get("t") == "connections":
                movable = [row["fd"] for row in record["rows"] if row["fd"] is not None]
                if len(movable) != len(fds):
                    raise StateError("connections and descriptors do not match")
                for place, fd in zip(movable, fds, strict=True):
                    sock = socket.socket(fileno=fd)
                    # A user timeout the old process lowered for a late reply stays
                    # so until this one replies late there again (it is only stricter).
                    transports[place] = SocketTransport(sock, send_timeout, closer, bound)
            restorer.feed(record)
        connections = restorer.connections(dict(transports))
    except (ChannelError, StateError, KeyError, TypeError, ValueError) as error:
        await _try_send(channel, {"t": "refused", "why": str(error)})
        raise TakeOverError(f"--take-over {path}: {error}") from None
    await channel.send({"t": "ready"})
    try:
        decision, _ = await channel.receive()
    except ChannelError:
        decision = {"t": "go"}  # the old process is gone after ready: it never serves again
    if decision.get("t") != "go":
        raise TakeOverError(f"--take-over {path}: the old process aborted: {decision.get('why')}")
    sessions, holds = restorer.counts()
    return TakenOver(
        listeners,
        connections,
        channel,
        int(header["pid"]),
        float(header["paused_at"]),
        sessions=sessions,
        holds=holds,
    )


def _listeners(kinds: list[str], fds: list[int], service: Service) -> Listeners:
    if len(kinds) != len(fds):
        raise StateError("listeners and descriptors do not match")
    listeners = Listeners()
    for kind, fd in zip(kinds, fds, strict=True):
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        if kind == "http":
            listeners.http = sock
        elif kind == "control":
            listeners.control = sock
        elif kind in ("tcp", "unix", "tls"):
            if kind == "tls" and not service.config.tls_cert:
                raise StateError("the lock port is TLS and this process has no --tls-cert")
            listeners.lock.append((sock, kind))
        else:
            raise StateError(f"unknown listener kind {kind!r}")
    return listeners
