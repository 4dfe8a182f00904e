"""The blocking client: :class:`BlockingClient` and :class:`BlockingRateLimiter`.

The same API as the trio client, on plain sockets: both take their public calls
from :class:`~elockd.client.base.ClientBase` (written once, in
:mod:`elockd.client.calls`), and this shell only says how to run one
(:meth:`BlockingClient._method`: queue it, then wait). One background thread owns
the socket: it writes queued requests, reads replies into the sans-IO
:class:`ClientCore`, renews leases and enforces reply deadlines. Calling threads
queue requests under a lock and wait on a ``threading.Event``, so several threads
can share one client and their requests are pipelined. Owning the socket in one
thread also keeps TLS safe: an ``SSLSocket`` is never read and written at once.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from elockd.client import core
from elockd.client.base import ClientBase, RateLimiterBase, describe
from elockd.client.core import Hold, Operation
from elockd.client.errors import ConnectFailed, ConnectionLost, ElockError
from elockd.client.websocket import WebSocketAddress

if TYPE_CHECKING:
    from elockd.client.websocket_blocking import BlockingWebSocket

T = TypeVar("T")
OnLost = Callable[[Hold], object] | None
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class BlockingClient(ClientBase):
    """An elockd connection for ordinary (threaded) code.

    ::

        with BlockingClient("127.0.0.1", 9999) as client:
            with client.lock("nightly-backup", wait=10, ttl=30) as hold:
                backup(fencing_token=hold.token)

    Lease renewal runs in the client's I/O thread; ``on_lost`` callbacks run there
    too, so they must be quick and must not wait for this client.
    """

    make_event = threading.Event
    is_async: ClassVar[Literal[False]] = False

    def _init_io(self) -> None:
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._websocket: BlockingWebSocket | None = None  # over ws://: the framing

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> BlockingClient:
        self.connect()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def connect(self) -> None:
        """Connect, start the I/O thread, authenticate."""
        try:
            sock = self._open_socket()
        except (OSError, ssl.SSLError) as error:
            self._close_wakeup()
            raise ConnectFailed(f"cannot connect to {self._where()}: {describe(error)}") from error
        sock.setblocking(False)
        self._sock = sock
        self._thread = threading.Thread(
            target=self._io_loop, name=f"elockd-client {self._where()}", daemon=True
        )
        self._thread.start()
        if self.auth_token is not None:
            line = core.auth_line(self.auth_token)
            try:
                self._run(lambda now: self.core.simple(line, now, core.parse_ok(b"200 OK")))
            except BaseException:
                self.close(release=False)
                raise

    def _open_socket(self) -> socket.socket:
        sock: socket.socket
        if self.websocket is not None:
            return self._open_websocket(self.websocket)
        if self.unix is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(self.unix)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl_context is not None:
            try:  # the handshake runs under the connect timeout set above
                sock = self.ssl_context.wrap_socket(
                    sock, server_hostname=self.server_hostname or self.host
                )
            except BaseException:
                sock.close()
                raise
        return sock

    def _open_websocket(self, address: WebSocketAddress) -> socket.socket:
        """Connect to the server's HTTP port and upgrade to a WebSocket; from then on
        the I/O thread speaks through :attr:`_websocket` (wsproto)."""
        from elockd.client.websocket_blocking import BlockingWebSocket  # ws:// only

        sock = socket.create_connection((address.host, address.port), self.connect_timeout)
        try:
            if address.secure:
                context = self.ssl_context or ssl.create_default_context()
                sock = context.wrap_socket(sock, server_hostname=address.host)
            websocket = BlockingWebSocket(address)
            ahead = websocket.handshake(sock)
        except BaseException:
            sock.close()
            raise
        self._websocket = websocket
        if ahead:
            with self._lock:
                self.core.receive(ahead, self._now())
        return sock

    def close(self, *, release: bool = True) -> None:
        """Close the connection; with ``release`` first free everything the session
        holds, leases included (see the trio client's ``aclose``)."""
        if self._thread is None:
            return
        with self._lock:
            self.core.close_holds("the client was closed", self._now())
        if self.core.error is None:
            lines = [b"unlock_all", b"quit"] if release else [b"quit"]
            with contextlib.suppress(ElockError):
                for line in lines:
                    self._run(self._simple(line, core.parse_lines))
        with self._lock:
            self.core.fail(ConnectionLost("the client was closed"), self._now())
            self._stop = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(self.core.reply_timeout)
        self._thread = None
        self._fire_lost()

    def _close_wakeup(self) -> None:
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------ the I/O thread

    def _io_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        out = b""
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    data = self.core.data_to_send()
                    if self._websocket is not None:
                        data = self._websocket.encode(data)
                    out += data
                    when = self.core.next_timer()
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0)
                selector.modify(sock, events)
                timeout = None if when is None else max(0.0, when - self._now())
                for key, mask in selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(*_WOULD_BLOCK):
                            while self._wake_r.recv(4096):
                                pass
                    elif mask & selectors.EVENT_WRITE and out:
                        out = self._send(sock, out)
                if out:  # TLS may have room without the socket saying so
                    out = self._send(sock, out)
                self._receive(sock)
                with self._lock:
                    self.core.tick(self._now())
                    failed = self.core.error is not None
                self._fire_lost()
                if failed:
                    return
        except (OSError, ConnectionLost) as error:
            with self._lock:
                lost = error if isinstance(error, ConnectionLost) else None
                self.core.fail(
                    lost or ConnectionLost(f"connection to {self._where()}: {describe(error)}"),
                    self._now(),
                )
            self._fire_lost()
        finally:
            selector.close()
            sock.close()
            self._close_wakeup()

    @staticmethod
    def _send(sock: socket.socket, out: bytes) -> bytes:
        try:
            sent = sock.send(out)
        except _WOULD_BLOCK:
            return out
        return out[sent:]

    def _receive(self, sock: socket.socket) -> None:
        """Read everything available (kernel and TLS buffers) into the core."""
        while True:
            try:
                data = sock.recv(65536)
            except _WOULD_BLOCK:
                return
            if not data:
                raise ConnectionLost(f"{self._where()} closed the connection")
            if self._websocket is not None:
                try:
                    data = self._websocket.decode(data)
                except ConnectionError as closed:
                    raise ConnectionLost(f"{self._where()}: {closed}") from closed
            with self._lock:
                self.core.receive(data, self._now())

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _fire_lost(self) -> None:
        with self._lock:
            lost = self.core.take_lost()
        self._report_lost(lost)

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    # ------------------------------------------------------------ running operations

    def _simple(
        self, line: bytes, parse: Callable[[core.Request], T]
    ) -> Callable[[float], Operation[T]]:
        return lambda now: self.core.simple(line, now, parse)

    def _run(self, make: Callable[[float], Operation[T]]) -> T:
        """Queue an operation, wait for its replies, finish it. If the wait is
        interrupted (KeyboardInterrupt, an exception from a signal handler), the
        operation's undo is queued before the exception goes on."""
        if self._thread is None:
            raise ConnectionLost("the client is not connected")
        with self._lock:
            op = make(self._now())
        self._wake()
        try:
            for request in op.requests:
                event: threading.Event = request.event  # type: ignore[assignment]
                # The I/O thread fails the connection at the deadline; the extra
                # second only guards against that thread having died.
                if not event.wait(max(0.0, request.deadline - self._now()) + 1.0):
                    with self._lock:
                        stopped = ConnectionLost("the client's I/O thread stopped")
                        self.core.fail(stopped, self._now())
        except BaseException:
            with self._lock:
                op.abandon(self._now())
            self._wake()
            raise
        try:
            with self._lock:
                return op.finish()
        finally:
            self._wake()  # a new hold means a new renewal timer
            self._fire_lost()

    @staticmethod
    def _method(build: Callable[..., Operation[Any]]) -> Callable[..., Any]:
        def method(self: BlockingClient, *args: Any, **kwargs: Any) -> Any:
            return self._run(lambda now: build(self.core, now, *args, **kwargs))

        return method

    @property
    def holds(self) -> list[Hold]:
        """Holds this client tracks now."""
        with self._lock:
            return list(dict.fromkeys(self.core.holds.values()))


class BlockingRateLimiter(RateLimiterBase):
    """:class:`elockd.client.RateLimiter` for threads: a concurrency (``limit``), a
    rate (``rate=(COUNT, PERIOD)``, ``burst``) or both on ``key`` everywhere; each
    slot uses a pooled connection of its own.

    ::

        limiter = BlockingRateLimiter("partner-api", 5, rate=(100, 60), host="locks.internal")
        with limiter.slot():
            call_partner_api()
    """

    def _init_pool(self) -> None:
        self._idle: list[BlockingClient] = []
        self._pool_lock = threading.Lock()

    def __enter__(self) -> BlockingRateLimiter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        with self._pool_lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()

    @contextlib.contextmanager
    def slot(self, on_lost: OnLost = None, *, cost: int = 1) -> Iterator[Hold | None]:
        """Hold a slot for the block: the rate turn, then a place (see
        :meth:`elockd.client.RateLimiter.slot`)."""
        with self._pool_lock:
            client = self._idle.pop() if self._idle else None
        if client is None or client.core.error is not None:
            client = BlockingClient(**self.client_options)
            client.connect()
        started = time.monotonic()
        in_line = False  # a rate wait whose answer has not come: still in line
        try:
            if self.rate is not None:
                in_line = True
                result = client.throttle(**self._turn(cost))
                in_line = False
                self._admitted(result)
            if self.limit is None:
                yield None
            else:
                wait = self._left(started, time.monotonic())
                with client.shared(self.key, self.limit, wait, self.ttl, on_lost) as hold:
                    yield hold
        finally:
            with client._lock:
                if in_line and client.core.pending:
                    # Interrupted in the rate's line: only the connection's end
                    # takes the wait off the server.
                    client.core.fail(ConnectionLost("a rate wait was given up"), time.monotonic())
            if client.core.error is None:
                with self._pool_lock:
                    self._idle.append(client)
            else:
                client.close()
