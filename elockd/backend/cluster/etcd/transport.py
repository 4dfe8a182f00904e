"""HTTP/1.1 for etcd's JSON gateway: a small pool of keep-alive connections per
endpoint, framed by h11 on trio sockets (plain or TLS).

httpx's pool cost a node 1.5-2 ms of CPU per request (docs/performance.md); this
one does nothing a unary gateway call does not need. Any transport failure is a
:class:`Retry`: the caller (the etcd client) moves to the next endpoint.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import trio

_MAX_RESPONSE = 64 * 1024 * 1024  # a bigger reply body is refused: a broken peer, not etcd
_READ_SIZE = 65536


class Retry(Exception):
    """This attempt failed in a way another endpoint (or a later try) may not."""


@dataclass(frozen=True, slots=True)
class _Target:
    """Where an endpoint URL points: what to connect to and what to put in the request."""

    host: str
    port: int
    tls: bool
    authority: bytes  # the Host header
    base: str  # a path prefix of the endpoint URL, usually ""

    @classmethod
    def parse(cls, endpoint: str) -> _Target:
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {endpoint!r}")
        tls = url.scheme == "https"
        port = url.port or (443 if tls else 80)  # .port raises ValueError for a bad one
        authority = url.netloc.rpartition("@")[2].encode("idna")
        return cls(url.hostname, port, tls, authority, url.path.rstrip("/"))


# What a broken connection raises (OSError includes ssl.SSLError and connection resets).
_TRANSPORT_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


def _connect_failure(exc: OSError) -> str:
    """Why no connection could be opened, in words ("connection refused"), where
    trio says only "all attempts to connect to HOST:PORT failed"."""
    group = exc.__cause__
    causes = list(group.exceptions) if isinstance(group, BaseExceptionGroup) else [exc]
    reasons: list[str] = []
    for cause in causes:
        if isinstance(cause, socket.gaierror):
            reason = f"cannot resolve the host ({cause.strerror})"
        elif isinstance(cause, OSError) and cause.errno:
            reason = os.strerror(cause.errno).lower()
        else:
            reason = str(cause) or type(cause).__name__
        if reason not in reasons:
            reasons.append(reason)
    return "; ".join(reasons)


def _has_input(sock: trio.socket.SocketType) -> bool:
    """Whether an idle connection has something to read: the member closed it, or sent
    bytes nobody asked for. Either way it is no longer fit for a request."""
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class Connection:
    """One keep-alive HTTP/1.1 connection; h11 does all the framing."""

    __slots__ = ("closed", "content", "endpoint", "http", "socket", "status", "stream")

    def __init__(self, endpoint: str, stream: trio.abc.Stream, sock: trio.socket.SocketType):
        self.endpoint = endpoint
        self.stream = stream
        self.socket = sock  # the TCP socket under ``stream``, for _has_input and close
        self.http = h11.Connection(h11.CLIENT)
        self.closed = False
        #: The reply being read: its status and its body so far.
        self.status = 0
        self.content = bytearray()

    def close(self) -> None:
        # Synchronous, so a cancelled or failing task can do it without a checkpoint.
        self.closed = True
        self.socket.close()

    def reusable(self) -> bool:
        """After a complete exchange: whether both sides allow another request."""
        return self.http.our_state is h11.DONE and self.http.their_state is h11.DONE

    async def send_request(self, target: bytes, authority: bytes, payload: bytes) -> None:
        """POST ``payload``; its reply is :meth:`read_reply`'s. Raises h11, trio or
        OS errors."""
        http = self.http
        headers = [
            (b"Host", authority),
            (b"Content-Type", b"application/json"),
            (b"Content-Length", b"%d" % len(payload)),
        ]
        request = http.send(h11.Request(method=b"POST", target=target, headers=headers))
        body = http.send(h11.Data(data=payload))
        end = http.send(h11.EndOfMessage())
        self.status = 0
        self.content = bytearray()
        await self.stream.send_all(b"".join(part for part in (request, body, end) if part))

    async def read_reply(self) -> tuple[int, bytes]:
        """The reply's status and body. Raises Retry, h11, trio or OS errors. May be
        cancelled and called again: what was read so far is kept (h11's buffer, the
        status and the body so far), and a cancelled socket read reads nothing."""
        http = self.http
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                # bytes() of bytes is the same object; b"" tells h11 about EOF
                http.receive_data(bytes(await self.stream.receive_some(_READ_SIZE)))
            elif isinstance(event, h11.Response):
                self.status = event.status_code
                for name, value in event.headers:
                    if name == b"content-length" and int(value) > _MAX_RESPONSE:
                        raise Retry(f"{self.endpoint}: reply of {int(value)} bytes refused")
            elif isinstance(event, h11.Data):
                self.content += event.data
                if len(self.content) > _MAX_RESPONSE:
                    raise Retry(f"{self.endpoint}: reply over {_MAX_RESPONSE} bytes refused")
            elif isinstance(event, h11.EndOfMessage):
                return self.status, bytes(self.content)
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                raise Retry(f"{self.endpoint}: connection closed before the reply ended")
            # else an h11.InformationalResponse (1xx): the real one follows


class Transport:
    """Keep-alive HTTP/1.1 connections for unary calls, pooled per endpoint.

    A request takes an idle connection to its endpoint (the most recently used one)
    or opens a new one, and gives it back only after a complete exchange that both
    sides agree to continue (``start_next_cycle``). Any error, timeout or
    cancellation mid-request closes the connection instead: its state is unknown.
    At most ``limit`` connections are open, idle ones included. The caller's limiter
    bounds the calls in flight by the same number, so a request that finds the
    pool full finds an idle connection to another endpoint to close; only while a
    slow call has further attempts beside its first (:mod:`.attempts`) may more be
    open, closed or pooled as those attempts end.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._targets: dict[str, _Target] = {}
        self._idle: dict[str, list[Connection]] = {}
        self._open = 0  # idle, in use and being opened
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0  # connections ever opened (tests look at it)

    async def post(self, endpoint: str, path: str, payload: bytes) -> tuple[int, bytes]:
        """POST ``payload`` to ``{endpoint}/v3/{path}``; Retry on any transport failure."""
        return await self.finish(await self.send(endpoint, path, payload))

    async def finish(self, connection: Connection) -> tuple[int, bytes]:
        """:meth:`receive`, and if cancelled the connection is closed: its state is
        unknown."""
        try:
            return await self.receive(connection)
        except BaseException:
            self.discard(connection)
            raise

    async def send(self, endpoint: str, path: str, payload: bytes) -> Connection:
        """Send the request on an idle connection or a new one; its reply is
        :meth:`receive`'s. Retry on any transport failure; the connection is
        closed if the request was not sent whole."""
        target = self._targets.get(endpoint)
        if target is None:
            try:
                target = self._targets[endpoint] = _Target.parse(endpoint)
            except ValueError as exc:
                raise Retry(f"{endpoint}: {exc}") from exc
        connection = self._take_idle(endpoint)
        if connection is None:
            connection = await self._connect(endpoint, target)
        sent = False
        try:
            await connection.send_request(
                f"{target.base}/v3/{path}".encode(), target.authority, payload
            )
            sent = True
        except _TRANSPORT_ERRORS as exc:
            raise Retry(f"{endpoint}: {exc!r}") from exc
        finally:
            if not sent:
                self.discard(connection)
        return connection

    async def receive(self, connection: Connection) -> tuple[int, bytes]:
        """The reply to the request :meth:`send` sent on ``connection``; Retry on any
        transport failure (the connection is closed). Then the connection is kept
        for another request if both sides agree, else closed. Cancelled, it is left
        as it is: call this again to go on reading, or :meth:`discard` it."""
        try:
            reply = await connection.read_reply()
        except _TRANSPORT_ERRORS as exc:
            self.discard(connection)
            raise Retry(f"{connection.endpoint}: {exc!r}") from exc
        except Retry:
            self.discard(connection)  # an oversized or cut reply
            raise
        if connection.reusable() and not self._closed:
            connection.http.start_next_cycle()
            self._idle.setdefault(connection.endpoint, []).append(connection)
        else:
            self.discard(connection)
        return reply

    def discard(self, connection: Connection) -> None:
        """Close a connection (its exchange failed, or was cut short: its state is
        unknown); one closed already is left alone."""
        if not connection.closed:
            self._open -= 1
            connection.close()

    def _take_idle(self, endpoint: str) -> Connection | None:
        idle = self._idle.get(endpoint)
        while idle:
            connection = idle.pop()
            if not _has_input(connection.socket):
                return connection
            self.discard(connection)  # closed by the member while idle
        return None

    async def _connect(self, endpoint: str, target: _Target) -> Connection:
        if self._open >= self._limit:  # make room: idle connections to other endpoints
            for idle in self._idle.values():
                if idle:
                    self.discard(idle.pop(0))
                    break
        self._open += 1
        connected = False
        try:
            if target.tls:
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
                tls = await trio.open_ssl_over_tcp_stream(
                    target.host, target.port, ssl_context=self._ssl, https_compatible=True
                )
                connection = Connection(endpoint, tls, tls.transport_stream.socket)
            else:
                plain = await trio.open_tcp_stream(target.host, target.port)
                connection = Connection(endpoint, plain, plain.socket)
            connected = True
        except OSError as exc:
            raise Retry(f"{endpoint}: {_connect_failure(exc)}") from exc
        finally:
            if not connected:
                self._open -= 1
        self.opened += 1
        return connection

    def close(self) -> None:
        """Close the idle connections; one in use is closed when its request ends."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                self.discard(idle.pop())
