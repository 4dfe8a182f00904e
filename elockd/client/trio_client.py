"""The trio client: :class:`Client` and :class:`RateLimiter`.

The public calls (``lock``, ``info``, ``stats``…) are
:class:`~elockd.client.base.ClientBase`'s, written once in
:mod:`elockd.client.calls` for both clients; this shell only says how to run one
(:meth:`Client._method`: queue it, then await its replies). Three background tasks
per connection drive the sans-IO :class:`ClientCore`: a reader (replies to waiting
requests), a writer (drains the output buffer) and a timer (lease renewals and
reply deadlines). Caller tasks only queue requests and wait for their events, so
any number of tasks can share one client and their requests are pipelined on the
one connection.

Closing does not rely on those tasks: they run in the caller's nursery, so a cancel
scope around ``async with Client(...)`` kills them before ``aclose()`` runs. The
close stops them and writes the last requests (queued releases, ``unlock_all``,
``quit``) on the stream itself, shielded and bounded by :data:`CLOSE_TIMEOUT`.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any, ClassVar, Literal, TypeVar

import trio
from trio_websocket import HandshakeError

from elockd.client import core
from elockd.client.base import ClientBase, RateLimiterBase, describe
from elockd.client.core import Hold, Operation
from elockd.client.errors import ConnectFailed, ConnectionLost
from elockd.client.websocket_trio import TrioWebSocketStream

log = logging.getLogger("elockd.client")
T = TypeVar("T")
OnLost = Callable[[Hold], object] | None
#: Seconds (at most; never more than the reply timeout) that closing may spend
#: sending the last requests and waiting for the reply to ``quit``. Short, because
#: a close often runs because the caller was cancelled and wants to be gone.
CLOSE_TIMEOUT = 2.0


class Client(ClientBase):
    """An elockd connection for trio code.

    ::

        async with Client("127.0.0.1", 9999) as client:
            async with client.lock("nightly-backup", wait=10, ttl=30) as hold:
                await backup(fencing_token=hold.token)

    Settings (host, port or ``unix``, TLS, auth token, timeouts) and calls are
    those of :class:`~elockd.client.base.ClientBase`; await each call.
    """

    make_event = trio.Event
    is_async: ClassVar[Literal[True]] = True

    def _init_io(self) -> None:
        self._stream: trio.abc.Stream | None = None
        self._scopes: list[trio.CancelScope] = []
        self._tasks_done: list[trio.Event] = []
        self._closing = False
        # Bytes the writer took from the core and has not finished sending; and
        # whether a send_all was interrupted, which leaves the byte stream in an
        # unknown state (part of a line may be out), so nothing more may be written.
        self._unsent = b""
        self._send_broken = False
        self._send_ready = trio.Event()
        self._timer_changed = trio.Event()
        self._exit_stack: AsyncExitStack | None = None

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Client:
        stack = AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        try:
            await self.start(nursery)
        except BaseException:
            nursery.cancel_scope.cancel()
            await stack.aclose()
            raise
        self._exit_stack = stack
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            if self._exit_stack is not None:
                await self._exit_stack.__aexit__(kind, error, traceback)

    async def start(self, nursery: trio.Nursery) -> None:
        """Connect, run the background tasks in ``nursery``, authenticate. Use this
        instead of ``async with`` when the client must outlive the calling task."""
        self._stream = await self._connect_stream(nursery)
        for task in (self._reader, self._writer, self._timer):
            scope, done = trio.CancelScope(), trio.Event()
            self._scopes.append(scope)
            self._tasks_done.append(done)
            nursery.start_soon(self._guarded, task, scope, done)
        if self.auth_token is not None:
            line = core.auth_line(self.auth_token)
            try:
                await self._run(
                    self.core.simple(line, self._now(), core.parse_ok(b"200 OK")),
                    limit=self.connect_timeout,
                )
            except BaseException as error:
                await self.aclose(release=False)
                if isinstance(error, trio.TooSlowError):
                    raise ConnectFailed(
                        f"{self._where()}: no reply to 'auth' within {self.connect_timeout:g} s"
                    ) from error
                raise

    async def _connect_stream(self, nursery: trio.Nursery) -> trio.abc.Stream:
        """The connection, within the connect timeout; any failure as
        :class:`ConnectFailed` naming the server. (``elockctl watch`` opens its
        event stream with it too: the same doors, the same words.)"""
        try:
            with trio.fail_after(self.connect_timeout):
                return await self._open_stream(nursery)
        except trio.TooSlowError as error:
            raise ConnectFailed(
                f"cannot connect to {self._where()}: timed out after {self.connect_timeout:g} s"
            ) from error
        except (OSError, trio.BrokenResourceError, ssl.SSLError, HandshakeError) as error:
            raise ConnectFailed(f"cannot connect to {self._where()}: {describe(error)}") from error

    async def _open_stream(self, nursery: trio.Nursery) -> trio.abc.Stream:
        stream: trio.abc.Stream
        if self.websocket is not None:
            context = self.ssl_context
            if self.websocket.secure and context is None:
                context = ssl.create_default_context()
            return await TrioWebSocketStream.connect(nursery, self.websocket.url, context)
        if self.unix is not None:
            stream = await trio.open_unix_socket(self.unix)
        else:
            stream = await trio.open_tcp_stream(self.host, self.port)
        if self.ssl_context is not None:
            tls = trio.SSLStream(
                stream, self.ssl_context, server_hostname=self.server_hostname or self.host
            )
            try:
                await tls.do_handshake()
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            stream = tls
        return stream

    async def aclose(self, *, release: bool = True) -> None:
        """Close the connection. With ``release`` (the default) the server is first
        told to free everything this session holds, leases included; without it
        only plain holds are freed (by the disconnect) and leases stay for a
        :meth:`resume` until they run out.

        Safe to call from a cancelled scope: the background tasks may already be
        dead (they run in the caller's nursery), so this stops them and, shielded
        and within :data:`CLOSE_TIMEOUT`, writes what is still queued (say a
        cancelled block's ``unlock``) plus ``unlock_all``/``quit`` on the stream
        itself, then reads replies up to the one to ``quit``: the server runs one
        connection's requests in order, so by then it has run them all. If that
        takes longer, the connection is just closed (which frees plain holds).
        """
        if self._stream is None or self._closing:
            return
        self._closing = True
        stream = self._stream
        # Holds still open are over either way; say so before the server's EOF does.
        self.core.close_holds("the client was closed", self._now())
        with trio.move_on_after(min(CLOSE_TIMEOUT, self.core.reply_timeout)) as scope:
            scope.shield = True
            for task_scope in self._scopes:
                task_scope.cancel()
            for done in self._tasks_done:
                await done.wait()
            if self.core.error is None and self._send_broken:
                log.warning("closing %s: a send was interrupted, no goodbye", self._where())
            elif self.core.error is None:
                await self._say_goodbye(stream, release)
        if scope.cancelled_caught:
            log.warning("closing %s: no goodbye from the server in time", self._where())
        self.core.fail(ConnectionLost("the client was closed"), self._now())
        self._fire_lost()
        self._stream = None
        await trio.aclose_forcefully(stream)

    async def _say_goodbye(self, stream: trio.abc.Stream, release: bool) -> None:
        """With the background tasks stopped: send every queued request and the final
        ones, then read replies (they still complete waiting requests) until none is
        outstanding."""
        for line in [b"unlock_all", b"quit"] if release else [b"quit"]:
            self.core.submit(line, self._now())
        data, self._unsent = self._unsent + self.core.data_to_send(), b""
        try:
            await stream.send_all(data)
            while self.core.pending:
                received = await stream.receive_some(65536)
                if not received:
                    break
                self.core.receive(bytes(received), self._now())
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            log.debug("closing %s: %r", self._where(), error)

    # ------------------------------------------------------------ background tasks

    async def _guarded(
        self, task: Callable[[], Any], scope: trio.CancelScope, done: trio.Event
    ) -> None:
        """Run a background task; ``done`` tells :meth:`aclose` that it no longer
        touches the stream, however it ended (cancelled by the caller's scope too)."""
        try:
            with scope:
                try:
                    await task()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                    self._lose_connection(
                        ConnectionLost(f"connection to {self._where()}: {describe(error)}")
                    )
        finally:
            done.set()

    async def _reader(self) -> None:
        assert self._stream is not None
        while True:
            data = await self._stream.receive_some(65536)
            if not data:
                self._lose_connection(ConnectionLost(f"{self._where()} closed the connection"))
                return
            self.core.receive(bytes(data), self._now())
            self._after()

    async def _writer(self) -> None:
        assert self._stream is not None
        while True:
            self._unsent += self.core.data_to_send()
            if not self._unsent:
                self._send_ready = trio.Event()
                await self._send_ready.wait()
                continue
            # A cancel that is already due stops us here, before a byte is out, so
            # aclose can still send the whole buffer; past this point (no checkpoint
            # until the first write) an interrupted send_all may have sent part of it.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._send_broken = True
            await self._stream.send_all(self._unsent)
            self._unsent = b""
            self._send_broken = False

    async def _timer(self) -> None:
        while True:
            self._timer_changed = trio.Event()
            when = self.core.next_timer()
            with trio.move_on_at(math.inf if when is None else when):
                await self._timer_changed.wait()
            self.core.tick(self._now())
            self._after()
            if self.core.error is not None:
                await self._drop_stream()
                return

    def _lose_connection(self, error: ConnectionLost) -> None:
        self.core.fail(error, self._now())
        self._after()

    async def _drop_stream(self) -> None:
        """After a reply timeout: close the socket, so the server frees what it can."""
        if self._stream is not None:
            await trio.aclose_forcefully(self._stream)

    def _after(self) -> None:
        """After any change to the core: send what was queued, re-arm the timer,
        tell lost holds' owners."""
        self._send_ready.set()
        self._timer_changed.set()
        self._fire_lost()

    def _fire_lost(self) -> None:
        self._report_lost(self.core.take_lost())

    @staticmethod
    def _now() -> float:
        return trio.current_time()

    # ------------------------------------------------------------ running operations

    async def _run(self, op: Operation[T], limit: float | None = None) -> T:
        """Wait for an operation's replies. If this task is cancelled meanwhile, the
        operation's undo (a release) is queued before the cancellation goes on."""
        self._after()
        try:
            for request in op.requests:
                with trio.fail_after(limit if limit is not None else math.inf):
                    await request.event.wait()  # type: ignore[attr-defined]
        except BaseException:
            op.abandon(self._now())
            self._after()
            raise
        try:
            return op.finish()
        finally:
            self._after()

    @staticmethod
    def _method(build: Callable[..., Operation[Any]]) -> Callable[..., Any]:
        async def method(self: Client, *args: Any, **kwargs: Any) -> Any:
            return await self._run(build(self.core, self._now(), *args, **kwargs))

        return method

    @property
    def holds(self) -> list[Hold]:
        """Holds this client tracks now."""
        return list(dict.fromkeys(self.core.holds.values()))


class RateLimiter(RateLimiterBase):
    """A cap on the work done on ``key``, across every process and task that uses
    the same key and settings: a concurrency (``limit``: "at most N calls to this
    API in flight"), a rate (``rate=(COUNT, PERIOD)``: "at most COUNT calls per
    PERIOD seconds, ``burst`` at once"), or both; see
    :class:`~elockd.client.base.RateLimiterBase`.

    Each slot uses a connection of its own from a pool (a session holds a key once,
    and a wait holds up the requests behind it), so the tasks of one process count
    separately::

        async with RateLimiter("partner-api", 5, rate=(100, 60), wait=60) as limiter:
            async with limiter.slot():
                await call_partner_api()
    """

    def _init_pool(self) -> None:
        self._idle: list[Client] = []
        self._all: list[Client] = []
        self._nursery: trio.Nursery | None = None
        self._stack: AsyncExitStack | None = None

    async def __aenter__(self) -> RateLimiter:
        self._stack = AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # The clients' tasks live in this limiter's nursery, inside the caller's
        # cancel scope: after a cancel they are dead, and only Client.aclose (which
        # bounds itself and writes on the stream directly) still releases the
        # slots, leases included. All of them, at once, shielded: in a cancelled
        # scope a plain loop would stop at the first and leak the rest.
        try:
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as closing:
                    for client in list(self._all):
                        closing.start_soon(client.aclose)
        finally:
            self._all.clear()
            self._idle.clear()
            assert self._stack is not None
            await self._stack.aclose()

    @asynccontextmanager
    async def slot(self, on_lost: OnLost = None, *, cost: int = 1) -> AsyncIterator[Hold | None]:
        """Hold a slot for the block: wait for the rate turn (``rate``; the turn
        weighs ``cost``), then for one of the ``limit`` places, ``wait`` seconds at
        most in all. Yields the shared :class:`Hold` (None without ``limit``).
        Raises :class:`~elockd.client.errors.Throttled` when the rate gave no turn
        in time, :class:`~elockd.client.errors.Unavailable` when no place was
        free."""
        if self._nursery is None:
            raise RuntimeError("use 'async with RateLimiter(...)' first")
        client = self._idle.pop() if self._idle else None
        if client is None or client.core.error is not None:
            client = Client(**self.client_options)
            await client.start(self._nursery)
            self._all.append(client)
        started = trio.current_time()
        in_line = False  # a rate wait whose answer has not come: still in line
        try:
            if self.rate is not None:
                in_line = True
                result = await client.throttle(**self._turn(cost))
                in_line = False
                self._admitted(result)
            if self.limit is None:
                yield None
            else:
                wait = self._left(started, trio.current_time())
                async with client.shared(self.key, self.limit, wait, self.ttl, on_lost) as hold:
                    yield hold
        finally:
            if in_line and client.core.pending:
                # Given up while in the rate's line: only the connection's end
                # takes the wait off the server (and out of this connection's way).
                client.core.fail(ConnectionLost("a rate wait was given up"), client._now())
            # A cancelled or failed slot queued its release already: reusable.
            if client.core.error is None:
                self._idle.append(client)
            else:
                self._all.remove(client)
                await client.aclose()  # shielded and bounded itself
