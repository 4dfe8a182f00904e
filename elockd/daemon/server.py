"""Trio glue: listeners, one nursery task per connection, the deadline timer, shutdown.

Nothing here decides anything about locks or replies: the accept loop starts one
task per connection running :func:`elockd.net.serving.serve_connection`, the HTTP port
(metrics and WebSocket sessions) runs beside it, and the :class:`DeadlineTimer`
runs the backend's deadlines.

Work a crowd can trigger at once (10,000 waits timing out together, 10,000
connections dropping with a million locks) is done by the engine in slices that the
:class:`DeadlineTimer` runs with a checkpoint between them, so other clients are
served in between (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import math
import os
import resource
import signal
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from functools import partial

import trio

from elockd.backend.interface import Backend
from elockd.backend.memory import MemoryBackend
from elockd.daemon.logs import log_start
from elockd.daemon.startup import (
    LOCK_PORT_HINT,
    METRICS_PORT_HINT,
    StartupError,
    blame_address,
    blame_file,
    shown,
)
from elockd.handover.exchange import (
    Giver,
    Listeners,
    TakenOver,
    TakeOverError,
    open_control_socket,
    take_over,
)
from elockd.net import accepting
from elockd.net.accepting import accept_pause
from elockd.net.listening import LISTEN_BACKLOG, open_tcp_sockets
from elockd.net.metrics import serve_metrics
from elockd.net.serving import (
    ConnectionSlots,
    PausableService,
    host_port,
    peer_name,
    serve_connection,
)
from elockd.net.tcp_silence import keepalive_bound, keepalive_settings, set_user_timeout
from elockd.net.transport import Closer, SocketTransport, StreamTransport
from elockd.net.unix_socket import OwnedPath, UnixPeers, open_unix_socket
from elockd.observe.logs import (
    log_auth_failure,
    log_kill,
    log_refusal,
    log_session_end,
    log_tls_failure,
)
from elockd.observe.tracing import trace_requests
from elockd.protocol.commands import COMMANDS
from elockd.protocol.config import Config
from elockd.systemd import sd_notify

log = logging.getLogger("elockd")

TOO_MANY_CONNECTIONS = b"0 Too Many Connections\r\n"
#: Connections the accept loop takes before it lets other tasks run. A burst of
#: 10,000 newcomers (a fleet restart) would otherwise be accepted, and their first
#: steps run, before any established client is served again: ~200 ms of silence.
#: Yielding every 64 costs one checkpoint per 64 connections.
ACCEPT_BATCH = 64
#: Deadlines (lease ends, grace ends, waits timing out) the timer runs before it lets
#: other tasks run: each timed-out wait wakes its connection's task, and trio runs
#: every task woken in one batch before it looks at the network again.
DEADLINE_SLICE = 256


class DeadlineTimer:
    """One task that runs the engine's lease and grace deadlines exactly on time.

    It sleeps until the engine's earliest deadline; the engine pokes it when a new
    deadline comes before that (or when ending sessions wait to be freed), so there
    is no polling and no scan. It runs due work in slices of :data:`DEADLINE_SLICE`
    with a checkpoint between them.
    """

    def __init__(self, engine: Backend) -> None:
        self.engine = engine
        self._changed = trio.Event()
        engine.books.on_new_deadline = self._poke

    def _poke(self) -> None:
        self._changed.set()

    async def run(self) -> None:
        while True:
            self._changed = trio.Event()
            deadline = self.engine.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._changed.wait()
            while self.engine.advance(trio.current_time(), DEADLINE_SLICE):
                await trio.lowlevel.checkpoint()


def tune_accepted(sock: socket.socket, keepalive: float = 0.0) -> None:
    """No Nagle delay, and TCP keepalive so that a client host that vanished (power
    cut, cable pulled: no FIN, no RST ever comes) is noticed within ``keepalive``
    seconds and its locks freed; TCP_USER_TIMEOUT bounds unacknowledged replies the
    same way. ``keepalive`` 0 leaves the operating system's defaults (hours)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if keepalive > 0:
        idle, interval, count = keepalive_settings(keepalive)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        # With keepalive on, Linux closes at the first probe after this much silence
        # (it overrides the probe count), so it is the same bound, not the whole of
        # ``keepalive``: a probe a second late would otherwise pass it.
        set_user_timeout(sock, keepalive_bound(keepalive))


class SpareDescriptor:
    """One file descriptor kept in reserve, so that a connection over the open-file
    limit can still be told why it is refused (libev and nginx keep one the same
    way): on EMFILE, give the spare back, accept, send ``0 Too Many Connections``,
    close, and take the spare again."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd: int | None = None
        self.take()

    def take(self) -> None:
        if self.fd is None:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = None  # still out of descriptors; the next refusal retries

    def release(self) -> bool:
        """Give the spare back; True when there was one."""
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True

    def close(self) -> None:
        self.release()

    def refuse_one(self, listener: socket.socket) -> bool:
        """Accept one pending connection on the spare descriptor and refuse it; True
        when one was refused (False: no spare, or nothing pending)."""
        if not self.release():
            self.take()
            return False
        try:
            sock, _ = listener.accept()
        except OSError:
            return False
        else:
            refuse(sock)  # closes it, so its descriptor is free for the spare again
            return True
        finally:
            self.take()


async def accept_loop(
    service: PausableService,
    listener: socket.socket,
    nursery: trio.Nursery,
    tls: ssl.SSLContext | None = None,
    slots: ConnectionSlots | None = None,
    spare: SpareDescriptor | None = None,
    closer: Closer | None = None,
    unix_peers: UnixPeers | None = None,
) -> None:
    """Accept every pending connection, one task each; refuse those over the limit.
    Listeners that share a limit share ``slots`` (and the ``spare`` descriptor).

    No error of accept() ends the loop (that would end the server and free every
    lock, :mod:`elockd.net.accepting`): an error of the one connection is skipped; out
    of descriptors, the connection is still accepted on the spare and told ``0 Too
    Many Connections``; anything else pauses the loop.

    A connection counts in ``connections`` (``q``, ``stats``, /metrics) from the
    moment it is accepted, not from when its task first runs: a client that connects
    and then asks ``q`` on another connection sees it counted. Unix peers are named
    ``unix:1``, ``unix:2``... (``unix_peers``), as glockd names them.

    At most :data:`ACCEPT_BATCH` connections are accepted before the loop yields, so
    that established connections are served between batches of a burst."""
    if slots is None:
        slots = ConnectionSlots(service.config.max_connections)
    if unix_peers is None:
        unix_peers = UnixPeers()
    send_timeout = service.config.send_timeout
    keepalive = service.config.keepalive
    counters = service.counters
    unix = listener.family == socket.AF_UNIX
    # Late replies lower TCP_USER_TIMEOUT to what is left of this (elockd/net/tcp_silence.py).
    bound = keepalive_bound(keepalive)
    while True:
        await trio.lowlevel.wait_readable(listener)
        accepted = 0
        while True:
            if accepted >= ACCEPT_BATCH:
                # Established connections (and the tasks just started) run before
                # the next batch: a burst of newcomers cannot starve existing clients.
                await trio.lowlevel.checkpoint()
                accepted = 0
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                break
            except OSError as error:
                out_of_files = error.errno in (errno.EMFILE, errno.ENFILE)
                if out_of_files and spare is not None and spare.refuse_one(listener):
                    accepting.accept_warning(
                        "accept: out of file descriptors (%s); connections over the "
                        "limit are refused with '0 Too Many Connections'",
                        os.strerror(error.errno or 0),
                    )
                    continue
                pause = accept_pause(error, "accept")
                if pause:
                    await trio.sleep(pause)
                    break
                continue
            accepted += 1
            if slots.used >= slots.limit:
                log_refusal("--max-connections")
                refuse(sock)
                continue
            try:
                tune_accepted(sock, keepalive)
                peer = unix_peers.name(sock) if unix else peer_name(address)
            except OSError as error:  # the peer is already gone: its error, not ours
                sock.close()
                accept_pause(error, "accept")
                continue
            slots.used += 1
            counters.connections += 1
            if tls is None:
                transport = SocketTransport(sock, send_timeout, closer, bound)
                nursery.start_soon(
                    slots.run, serve_connection, service, transport, peer, None, True
                )
            else:
                nursery.start_soon(slots.run, serve_tls, service, sock, tls, peer)


def refuse(sock: socket.socket) -> None:
    """Tell a connection over a limit why (``0 Too Many Connections``), then close it."""
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        sock.send(TOO_MANY_CONNECTIONS)
    sock.close()


async def serve_stream(
    service: PausableService, stream: trio.abc.Stream, peer: bytes, *, counted: bool = False
) -> None:
    """Serve a connection given as a trio Stream (TLS, tests); ``counted``: the accept
    loop counted it already."""
    transport = StreamTransport(stream, service.config.send_timeout)
    await serve_connection(service, transport, peer, counted=counted)


async def serve_tls(
    service: PausableService, sock: socket.socket, context: ssl.SSLContext, peer: bytes
) -> None:
    """Complete the TLS handshake within ``--handshake-timeout``, then serve."""
    stream = trio.SSLStream(
        trio.SocketStream(trio.socket.from_stdlib_socket(sock)), context, server_side=True
    )
    handshaken = False
    with trio.move_on_after(service.config.handshake_timeout):
        try:
            await stream.do_handshake()
            handshaken = True
        except trio.BrokenResourceError as error:
            log_tls_failure(peer, error.__cause__ or error)
    if handshaken:  # outside the timeout: it bounds the handshake, not the session
        await serve_stream(service, stream, peer, counted=True)
    else:
        service.counters.connections -= 1  # counted at accept; no session came of it
        await trio.aclose_forcefully(stream)


def tls_context(config: Config) -> ssl.SSLContext | None:
    """The lock port's TLS settings; with a client CA, client certificates are required.
    A file that is missing, unreadable or not PEM is named in a :class:`StartupError`."""
    if not config.tls_cert:
        return None
    files = {
        "--tls-cert": config.tls_cert,
        "--tls-key": config.tls_key,
        "--tls-client-ca": config.tls_client_ca,
    }
    for flag, path in files.items():
        if path:  # OpenSSL's own errors do not say which file is missing
            with blame_file(flag, path), open(path, "rb") as file:
                content = file.read()
            if flag == "--tls-cert" and not config.tls_key and b"PRIVATE KEY-----" not in content:
                # The key may share the certificate's file; else OpenSSL says "PEM lib".
                raise StartupError(
                    f"--tls-cert {shown(path)}: needs --tls-key (no private key in this file)"
                )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    pair = config.tls_cert + (f" / --tls-key {config.tls_key}" if config.tls_key else "")
    with blame_file("--tls-cert", pair, "not a PEM certificate with its private key"):
        context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        with blame_file("--tls-client-ca", config.tls_client_ca, "not a PEM CA certificate"):
            context.load_verify_locations(config.tls_client_ca)
    return context


def read_auth_token(path: str, flag: str = "--auth-token-file") -> bytes:
    """The shared secret of ``auth``: the file's content without surrounding blanks."""
    with blame_file(flag, path), open(path, "rb") as file:
        token = file.read().strip()
    if not token:
        raise StartupError(f"{flag} {path}: empty (the token is its content)")
    return token


def read_tokens(config: Config) -> tuple[bytes | None, bytes | None]:
    """The lock token (``--auth-token-file``) and the operators' token
    (``--admin-token-file``), each None when its flag is not given. The same token
    for both is refused: every client would be an operator, able to ``kill``."""
    token = read_auth_token(config.auth_token_file) if config.auth_token_file else None
    admin = (
        read_auth_token(config.admin_token_file, "--admin-token-file")
        if config.admin_token_file
        else None
    )
    if admin is not None and admin == token:
        raise StartupError(
            f"--admin-token-file {config.admin_token_file}: the same token as "
            f"--auth-token-file {config.auth_token_file} (every client could kill)"
        )
    return token, admin


def raise_open_file_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit: each connection is a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def make_service(config: Config) -> PausableService:
    """The backend and service the server runs: in memory, or a cluster node."""
    token, admin = read_tokens(config)
    backend: Backend = make_cluster_backend(config) if config.etcd else make_memory_backend(config)
    backend.books.on_session_end = log_session_end
    service = PausableService(config, backend, COMMANDS, token, admin)
    service.reports.refusal = log_refusal
    service.reports.auth_failure = log_auth_failure
    service.reports.kill = log_kill
    if log.isEnabledFor(logging.DEBUG):  # the plain command table costs nothing
        trace_requests(service)
    return service


def make_memory_backend(config: Config) -> MemoryBackend:
    """Every lock in this process. Fencing tokens are seeded from the wall clock in
    nanoseconds, so they keep increasing across restarts as long as the clock does
    not step back and fewer than 10^9 tokens a second are issued."""
    return MemoryBackend(
        first_token=time.time_ns(),
        max_waiters=config.max_waiters,
        max_holds=config.max_holds,
        max_sessions=config.max_sessions,
        max_throttles=config.max_throttles,
    )


MAX_CLUSTER_KEYS = 64


def make_cluster_backend(config: Config) -> Backend:
    """A node of a cluster: locks live in etcd (docs/cluster.md)."""
    from elockd.backend.cluster.etcd.client import EtcdClient
    from elockd.backend.cluster.space import ClusterLockSpace

    assert config.etcd
    if config.max_keys > MAX_CLUSTER_KEYS:
        # One mlock is one etcd txn: a put and a count per key, and etcd's default
        # --max-txn-ops is 128.
        raise StartupError(
            f"--max-keys {config.max_keys}: above {MAX_CLUSTER_KEYS} does not fit one etcd txn"
        )
    endpoints = [url.strip() for url in config.etcd.split(",") if url.strip()]
    client = EtcdClient(
        endpoints, deadline=config.etcd_timeout, max_concurrent=config.etcd_in_flight
    )
    return ClusterLockSpace(
        client,
        config.etcd_prefix.encode(),
        session_ttl=config.session_ttl,
        max_waiters=config.max_waiters,
        max_holds=config.max_holds,
        max_throttles=config.max_throttles,
        throttle_line_grace=config.throttle_line_grace,
    )


class Work:
    """What a hand-over stops while the tables are copied and restarts if it fails:
    the accept loops and the deadline timer. They run in a nursery of their own, so
    stopping them leaves the connections (in the server's nursery) untouched."""

    def __init__(self, start: Callable[[trio.Nursery], None]) -> None:
        self._start = start
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()
        self._restart = trio.Event()

    async def run(self) -> None:
        while True:
            self._stopped = trio.Event()
            try:
                async with trio.open_nursery() as inner:
                    self._scope = inner.cancel_scope
                    self._start(inner)
            finally:
                self._stopped.set()
            await self._restart.wait()
            self._restart = trio.Event()

    async def stop(self) -> None:
        self._scope.cancel()
        await self._stopped.wait()

    def restart(self) -> None:
        self._restart.set()


def open_listeners(config: Config, tls: ssl.SSLContext | None) -> Listeners:
    """The lock port (every address of ``--host``), ``--unix`` (mode ``--unix-mode``,
    whatever the umask) and the control socket, bound and listening; a failure
    names its flag, and leaves nothing bound behind."""
    with blame_address("--host", config.host, "--port", config.port, LOCK_PORT_HINT):
        tcp = open_tcp_sockets(config.host, config.port)
    listeners = Listeners(lock=[(sock, "tls" if tls else "tcp") for sock in tcp])
    try:
        if config.unix:
            with blame_file("--unix", config.unix):
                mode = int(config.unix_mode, 8)
                sock = open_unix_socket(config.unix, LISTEN_BACKLOG, mode)
            listeners.lock.append((sock, "unix"))
        if config.control_socket:
            with blame_file("--control-socket", config.control_socket):
                listeners.control = open_control_socket(config.control_socket)
    except StartupError:
        for path in unix_paths(listeners):
            path.unlink()
        for sock, _ in listeners.lock:
            sock.close()
        raise
    return listeners


def unix_paths(listeners: Listeners) -> list[OwnedPath]:
    """The socket files of the Unix listeners (``--unix``, the control socket) as
    they are now: this server's to unlink at exit, while they stay what it bound."""
    socks = [sock for sock, kind in listeners.lock if kind == "unix"]
    if listeners.control is not None:
        socks.append(listeners.control)
    names = [sock.getsockname() for sock in socks if sock.family == socket.AF_UNIX]
    return [OwnedPath(name) for name in names if isinstance(name, str) and name]


async def serve(
    config: Config,
    service: PausableService | None = None,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int] | str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen and serve until cancelled. Cancellation closes every connection, whose
    holds are then freed and counted like any disconnect.

    With ``--take-over PATH`` the listeners, connections and tables come from the
    process at PATH instead (docs/upgrade.md); with ``--control-socket`` this
    process can hand them on the same way, after which it returns."""
    service = service or make_service(config)
    tls = tls_context(config)
    closer = Closer()
    taken: TakenOver | None = None
    if config.take_over:
        try:
            taken = await take_over(config.take_over, service, closer)
        except TakeOverError as error:
            raise StartupError(str(error)) from None
        listeners = taken.listeners
    else:
        listeners = open_listeners(config, tls)
    owned = unix_paths(listeners)
    unix_peers = UnixPeers()
    if taken is not None:  # new Unix peers are numbered on after the ones taken over
        unix_peers.skip_past(parked.peer for parked in taken.connections)
    addresses: list[tuple[str, int] | str] = [sock.getsockname() for sock, _ in listeners.lock]
    files = raise_open_file_limit()
    if files < config.max_connections + 64:
        log.warning(
            "open file limit %d is below --max-connections %d + 64 for listeners and logs",
            files,
            config.max_connections,
        )
    timer = DeadlineTimer(service.backend)
    spare = SpareDescriptor()
    handed_over = False
    try:
        async with trio.open_nursery() as nursery:
            background = service.backend.background()
            if background is not None:
                await nursery.start(background)
            nursery.start_soon(closer.run)
            # One limit for every listener, WebSocket sessions on the HTTP port too.
            slots = ConnectionSlots(config.max_connections)

            def start_work(inner: trio.Nursery) -> None:
                inner.start_soon(timer.run)
                for listener, kind in listeners.lock:
                    # TLS protects the TCP port; the Unix socket is guarded by file modes.
                    inner.start_soon(
                        accept_loop,
                        service,
                        listener,
                        nursery,
                        tls if kind == "tls" else None,
                        slots,
                        spare,
                        closer,
                        unix_peers,
                    )

            work = Work(start_work)
            nursery.start_soon(work.run)
            http_address: str | None = None
            # Taking over, the HTTP port is the predecessor's (or none, as it had).
            if listeners.http is not None if taken is not None else config.metrics_port:
                # In this nursery, so the scrape reads the tables in this trio run.
                with blame_address(
                    "--metrics-host",
                    config.metrics_host,
                    "--metrics-port",
                    config.metrics_port,
                    METRICS_PORT_HINT,
                ):
                    host, port = await nursery.start(
                        partial(
                            serve_metrics,
                            sock=listeners.http,
                            tune=partial(tune_accepted, keepalive=config.keepalive),
                        ),
                        service,
                        config.metrics_host,
                        config.metrics_port,
                        slots,
                    )
                http_address = describe((host, port))
            if taken is not None:
                for parked in taken.connections:
                    slots.used += 1
                    nursery.start_soon(
                        slots.run, serve_connection, service, parked.transport, parked.peer, parked
                    )
                sd_notify(f"MAINPID={os.getpid()}", "READY=1")
                await taken.finish()
            else:
                sd_notify("READY=1")
            # Only now, when nothing can fail any more: a start-up failure is one line.
            log_start(config)
            if http_address is not None:
                log.info("elockd metrics on http://%s/metrics", http_address)
                if not tls:
                    log.info("elockd WebSocket sessions on ws://%s/", http_address)
            log.info("elockd listening on %s", ", ".join(describe(a) for a in addresses))
            task_status.started(addresses)
            if listeners.control is not None:
                giver = Giver(service, listeners, work.stop, work.restart, config.handover_timeout)
                await giver.serve()
                # Every connection and the tables are the successor's now.
                handed_over = True
                service.pause.hand_over()
                nursery.cancel_scope.cancel()
    finally:
        spare.close()
        for listener, _ in listeners.lock:
            listener.close()
        for other in (listeners.http, listeners.control):
            if other is not None:
                other.close()
        if not handed_over:  # else the successor listens at these paths now
            for path in owned:
                path.unlink()  # only if it still is the socket this server bound


def describe(address: tuple[str, int] | str) -> str:
    """A listening address for the log: ``HOST:PORT`` (:func:`host_port`) or ``unix:PATH``."""
    return f"unix:{address}" if isinstance(address, str) else host_port(address[0], address[1])


#: CPython's default (700, 10, 10) promotes a steady trickle of short-lived holds into
#: the oldest generation, and a full collection then scans every live object: about
#: 0.35 us each, 366 ms with a million locks held, with every client waiting. Young
#: collections every 50,000 allocations (a few ms each) let a hold that lives a few
#: milliseconds die before it is ever promoted; with a million locks established,
#: no full collection ran at all. The middle generation is collected every 2 young
#: collections, so it never holds more than about 100,000 objects (at most 80 ms):
#: at 20 it grew to a million as 10,000 connections queued, and one collection
#: stalled everyone for 270-320 ms. The oldest generation's 1,000 keeps full
#: collections as rare as before (docs/performance.md).
GC_THRESHOLDS = (50_000, 2, 1000)


def tune_garbage_collector() -> None:
    """Set :data:`GC_THRESHOLDS` for this process (the server owns it)."""
    gc.set_threshold(*GC_THRESHOLDS)


async def run_until_signal(
    config: Config, signals: Sequence[int] = (), started: Callable[[], None] | None = None
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly. The signals are obeyed
    from the first moment, also while start-up waits (for etcd). ``started`` is
    called once every listener is open."""
    tune_garbage_collector()
    wanted = signals or (signal.SIGINT, signal.SIGTERM)
    with trio.open_signal_receiver(*wanted) as received:
        async with trio.open_nursery() as nursery:

            async def stop_at_signal() -> None:
                async for signum in received:
                    log.info("%s received: closing every connection", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            async def serve_until_done(
                task_status: trio.TaskStatus[list[tuple[str, int] | str]],
            ) -> None:
                await serve(config, task_status=task_status)
                nursery.cancel_scope.cancel()  # handed over to a successor: exit

            nursery.start_soon(stop_at_signal)
            await nursery.start(serve_until_done)
            if started is not None:
                started()
