"""WebSocket sessions on the HTTP port (glockd's interface, for browser dashboards
and scripts), served with wsproto straight on the socket.

A WebSocket connection to ``/`` of the HTTP port is a session like a TCP one: the
same per-connection loop (:func:`elockd.net.serving.serve_connection`) and the same
sans-IO :class:`~elockd.protocol.connection.Connection` serve it, with the same limits,
``auth``, idle timeout, counters and metrics, and its locks are freed when it
closes. Only the framing differs: each text or binary message is one request line
(no ``\\n`` needed), and each reply is one message of the type of its request.

Why wsproto on the socket and not hypercorn's ASGI (which served it until issue 24):
the TCP port's bounds cannot be kept through an ASGI queue. Tried as an attacker:

* hypercorn accepts permessage-deflate whenever it is offered (it is hard-coded), so
  a 61 KB frame inflated to 60 MiB before any message limit looked at it;
* its app queue (10 events) deadlocks with a client that stops reading: the app task
  blocks in ``send``, and the disconnect waits behind a full queue, so the session
  (and its locks) lived on after the client left;
* ASGI sends whole messages only, so a dump had to be built whole (hundreds of ms
  over 500,000 locks, with everyone waiting), and there is no hook for a send
  timeout counted as "no progress" or for keepalive on the socket.

So the HTTP port reads the first request head of each connection itself
(:mod:`elockd.net.http`): an upgrade comes here, anything else goes to hypercorn. This
module owns the socket as :class:`~elockd.net.transport.SocketTransport` does: no
extension is ever agreed; a message is capped (:func:`message_limit`); messages read
ahead while a request waits are capped in count and bytes; a send that makes no
progress for ``--send-timeout`` ends the session; a multi-line reply is one message
sent in fragments, each made only once the last went out; and ending a session
breaks its reference cycles, so that it is freed at once by its reference counts.

It counts against ``--max-connections`` (a connection over the limit is told ``0 Too
Many Connections`` and closed with 1013), not against ``--metrics-max-connections``.
When the lock port speaks TLS, upgrades are refused (403): the plain-HTTP port must
not bypass the encryption the operator asked for. So is an upgrade a browser makes
from a page of another site (its ``Origin`` is not this host: :func:`cross_site`).
"""

from __future__ import annotations

import codecs
import contextlib
import ipaddress
import math
import socket
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from urllib.parse import urlsplit

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from elockd.handover.pause import NEVER, STREAM_SEND_GRACE, Interrupted
from elockd.net.serving import ConnectionSlots, PausableService, peer_name, serve_connection
from elockd.net.transport import READ_AHEAD_LIMIT, RECEIVE_SIZE, Closer, rest_forever
from elockd.protocol.config import Config

TOO_MANY_CONNECTIONS = b"0 Too Many Connections\r\n"
#: Close codes (RFC 6455): the session ended, a message too big, "try again later".
NORMAL_CLOSURE = 1000
MESSAGE_TOO_BIG = 1009
TRY_AGAIN_LATER = 1013
#: While a request waits, at most this many messages are read ahead of it (and at
#: most :data:`~elockd.net.transport.READ_AHEAD_LIMIT` bytes of them): an empty message
#: is 0 bytes but still an object, so a count in bytes alone let a flood of them
#: grow without bound. Past either, the session is not read (TCP pushes back).
READ_AHEAD_MESSAGES = 1024
#: How long a session that ends may take to say so: our close frame out, the peer's
#: close (or its FIN) in. Its locks are freed before this starts.
CLOSE_LINGER = 2.0


def message_limit(max_line: int) -> int:
    """The largest WebSocket message taken in: enough for a request well over
    ``--max-line`` (it gets ``0 Line Too Long``, and the session goes on); a larger
    one closes the session (1009), so a message costs at most this much memory."""
    return max(1 << 20, 4 * max_line)


class WebSocketTransport:
    """The per-connection loop's :class:`~elockd.net.transport.Transport` over a WebSocket
    on a non-blocking socket: a message in is a line (a ``\\n`` is added), a reply out
    is a message of the type of the request it answers."""

    __slots__ = (
        "_ahead",
        "_ahead_bytes",
        "_decoder",
        "_events",
        "_flushing",
        "_gone",
        "_lingers",
        "_owed",
        "_partial",
        "_pending",
        "_text",
        "close_code",
        "closer",
        "max_message",
        "pause",
        "rest",
        "send_timeout",
        "sock",
        "ws",
    )

    def __init__(
        self,
        sock: socket.socket,
        ws: WSConnection,
        *,
        send_timeout: float = math.inf,
        max_message: int = 1 << 20,
        closer: Closer | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.ws = ws
        self.send_timeout = send_timeout
        self.max_message = max_message
        self.closer = closer
        self.pause = NEVER
        self.rest: Hashable | None = None
        #: The code our close frame will carry (1009 after a message too big...).
        self.close_code = NORMAL_CLOSURE
        self._events: Iterator[Event] = iter(())
        self._ahead: deque[tuple[bool, bytes]] = deque()  # (text?, data) read ahead
        self._ahead_bytes = 0
        self._partial = bytearray()  # the message being received, so far
        self._pending: deque[memoryview] = deque()  # bytes not yet sent
        self._text = True  # the type of the message being answered
        self._owed = False  # that message has had no reply message yet
        self._gone = False  # the peer is gone, or the session closed: no more I/O
        self._flushing = False  # a task is in _flush (see there)
        self._lingers = False  # closed, but the socket waits for the peer's close
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    # ------------------------------------------------------------------ receiving

    async def receive(self) -> bytes:
        if self._owed:
            # The last message got no reply (glockd's dialect answers some requests
            # with nothing): r312 sends an empty message, and glockd's own clients
            # wait for one message per request.
            await self._send_message(b"")
        if self._ahead:
            text, data = self._ahead.popleft()
            self._ahead_bytes -= len(data)
        else:
            got = await self._next_message()
            if got is None:
                return b""
            text, data = got
        self._text = text
        self._owed = True
        return data if data.endswith(b"\n") else data + b"\n"

    async def receive_beside(self) -> bytes:
        """:meth:`receive` while another task sends (a ``watch`` stream): it owes no
        reply message, and a pong it answers goes out with the sender's flush."""
        if self._ahead:
            _, data = self._ahead.popleft()
            self._ahead_bytes -= len(data)
        else:
            got = await self._next_message()
            if got is None:
                return b""
            _, data = got
        return data if data.endswith(b"\n") else data + b"\n"

    async def watch_for_close(self) -> None:
        """While a request waits: keep the messages that come, up to
        :data:`READ_AHEAD_MESSAGES` and :data:`~elockd.net.transport.READ_AHEAD_LIMIT`
        bytes, until the peer leaves."""
        while len(self._ahead) < READ_AHEAD_MESSAGES and self._ahead_bytes < READ_AHEAD_LIMIT:
            got = await self._next_message()
            if got is None:
                return
            self._ahead.append(got)
            self._ahead_bytes += len(got[1])
        await rest_forever(self.pause, self.rest)

    async def _next_message(self) -> tuple[bool, bytes] | None:
        """The next whole message as (text?, bytes), or None once the session is over
        (the peer left, closed, or broke the protocol or the message limit). Pings
        are answered on the way."""
        while self.is_open():
            for event in self._events:
                if isinstance(event, TextMessage | BytesMessage):
                    data = event.data
                    piece = data.encode() if isinstance(data, str) else data
                    if len(self._partial) + len(piece) > self.max_message:
                        self.close_code = MESSAGE_TOO_BIG
                        self._partial = bytearray()
                        return None
                    self._partial += piece
                    if event.message_finished:
                        message = bytes(self._partial)
                        self._partial = bytearray()
                        return isinstance(event, TextMessage), message
                elif isinstance(event, Ping):
                    self._pending.append(memoryview(self.ws.send(event.response())))
                    await self._flush()
                elif isinstance(event, CloseConnection):
                    if self.ws.state is ConnectionState.REMOTE_CLOSING:
                        # The peer closed: answer its close, and the session is over.
                        self._pending.append(memoryview(self.ws.send(event.response())))
                    else:  # wsproto found the peer broke the protocol (1002, 1007)
                        self.close_code = event.code
                    return None
            data = await self._receive_bytes()
            if not data:
                self._gone = True
                return None
            self.ws.receive_data(data)
            self._events = self.ws.events()
        return None

    async def _receive_bytes(self) -> bytes:
        """What the socket has (b"" once the peer is gone), counted as at rest for a
        hand-over while it waits, as :class:`~elockd.net.transport.SocketTransport` does."""
        sock, pause, rest = self.sock, self.pause, self.rest
        await trio.lowlevel.checkpoint()  # a flooding client does not starve the rest
        while True:
            if pause.requested:
                raise Interrupted
            try:
                return sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                pass
            except OSError:  # reset by peer and friends: the peer is gone
                return b""
            if rest is not None:
                pause.idle.add(rest)
            try:
                await trio.lowlevel.wait_readable(sock)
            finally:
                pause.idle.discard(rest)

    # -------------------------------------------------------------------- sending

    async def send(self, data: bytes) -> None:
        await self._send_message(data)

    async def send_stream(self, chunks: Iterable[bytes]) -> None:
        """A multi-line reply as one message, in fragments: each chunk is made only
        once the one before went out (a client that does not read stops the dump,
        not the server), and other connections run between chunks. One chunk is
        held back so that the last fragment can say it is the last."""
        self._check_open()
        self._owed = False
        held: bytes | None = None
        for chunk in chunks:
            if chunk:
                if held is not None:
                    await self._send_fragment(held, finished=False)
                held = chunk
            await trio.lowlevel.checkpoint()
        # An empty listing in glockd's dialect is an empty message (as r312 sends).
        await self._send_fragment(held or b"", finished=True)

    async def _send_message(self, data: bytes) -> None:
        self._check_open()
        self._owed = False
        await self._send_fragment(data, finished=True)

    def _check_open(self) -> None:
        if not self.is_open():
            raise trio.BrokenResourceError("the WebSocket was closed")

    def is_open(self) -> bool:
        """Whether messages still flow both ways (no close sent, received or due)."""
        return (
            not self._gone
            and self.ws.state is ConnectionState.OPEN
            and self.close_code == NORMAL_CLOSURE
        )

    async def _send_fragment(self, data: bytes, *, finished: bool) -> None:
        if self._text:
            # A text message must be UTF-8; bytes that are not (a binary key) show
            # replaced. The decoder keeps a character cut between two fragments.
            text = self._decoder.decode(data, final=finished)
            if finished:
                self._decoder.reset()
            frame = self.ws.send(TextMessage(text, message_finished=finished))
        else:
            frame = self.ws.send(BytesMessage(data, message_finished=finished))
        self._pending.append(memoryview(frame))
        await self._flush()

    async def _flush(self) -> None:
        """Send what is pending. ``--send-timeout`` bounds how long a send may make
        no progress (the deadline moves whenever bytes go out), and a hand-over's
        pause :data:`~elockd.handover.pause.STREAM_SEND_GRACE`. What went out is
        taken off at once, so a flush cancelled half-way leaves the rest for the
        next one and never a torn frame."""
        if self._flushing:
            # Another task is flushing (a watch stream's sender while its reader
            # answers a ping): it sends what was just queued, in order, whole.
            return
        self._flushing = True
        try:
            await self._flush_pending()
        finally:
            self._flushing = False

    async def _flush_pending(self) -> None:
        sock, pending = self.sock, self._pending
        deadline = math.inf
        while pending:
            view = pending[0]
            try:
                sent = sock.send(view)
            except BlockingIOError:
                if deadline == math.inf:
                    deadline = trio.current_time() + self.send_timeout
                # A hand-over's pause gives it STREAM_SEND_GRACE more: a WebSocket
                # does not move (docs/upgrade.md), and a client that does not read
                # must not hold everyone else frozen.
                with self.pause.stall_scope(deadline, STREAM_SEND_GRACE):
                    await trio.lowlevel.wait_writable(sock)
                    continue
                self._gone = True
                raise trio.BrokenResourceError("send timed out: peer not reading") from None
            except OSError as error:
                self._gone = True
                raise trio.BrokenResourceError from error
            deadline = math.inf
            if sent < len(view):
                pending[0] = view[sent:]
            else:
                pending.popleft()

    # -------------------------------------------------------------------- closing

    def replying_late(self) -> None:
        """Not lowered here (yet): on a WebSocket, a reply sent after its client's host
        vanished restarts the keepalive bound, as over TLS (docs/operations.md)."""

    async def aclose(self) -> None:
        """Send our close frame and a FIN (within :data:`CLOSE_LINGER`), and break
        every reference the session's objects hold to each other, so that they are
        freed at once. The socket stays open for :meth:`linger` when the peer may
        still answer; else it is closed here."""
        try:
            if not self._gone:
                with trio.move_on_after(CLOSE_LINGER):
                    if self.ws.state is ConnectionState.OPEN:
                        close = CloseConnection(self.close_code)
                        self._pending.append(memoryview(self.ws.send(close)))
                    await self._flush()
                    self.sock.shutdown(socket.SHUT_WR)
                    self._lingers = True
        except (trio.BrokenResourceError, OSError):
            pass
        finally:
            self._gone = True
            if not self._lingers:
                self._close_socket()
            self.rest = None
            self._events = iter(())
            self._ahead.clear()
            self._pending.clear()

    async def linger(self) -> None:
        """After :meth:`aclose`, once the session's slot is free: read (and drop)
        until the peer closes too, for :data:`CLOSE_LINGER` at most, then close.
        Closing with the peer's data unread would reset the connection, and the
        peer might lose our close frame (the code saying why)."""
        if not self._lingers:
            return
        sock = self.sock
        try:
            with trio.move_on_after(CLOSE_LINGER):
                while True:
                    await trio.lowlevel.wait_readable(sock)
                    try:
                        if not sock.recv(RECEIVE_SIZE):
                            break
                    except BlockingIOError:
                        continue
                    except OSError:
                        break
        finally:
            self._lingers = False
            self._close_socket()

    def _close_socket(self) -> None:
        if self.closer is None:
            self.sock.close()
        else:
            self.closer.close_later(self.sock)

    # ------------------------------------------------------------------ handshake

    async def accept(self) -> None:
        """Answer the upgrade: 101, with no extension (permessage-deflate is never
        agreed, whatever the client offers)."""
        await self._handshake(AcceptConnection())
        self._events = self.ws.events()  # frames sent right behind the request

    async def reject(self, status: int) -> None:
        """Answer the upgrade request with an HTTP error, and close."""
        with contextlib.suppress(LocalProtocolError, trio.BrokenResourceError):
            await self._handshake(RejectConnection(status_code=status))
        self._gone = True
        await self.aclose()

    async def _handshake(self, event: AcceptConnection | RejectConnection) -> None:
        self._pending.append(memoryview(self.ws.send(event)))
        await self._flush()


def cross_site(request: Request, allowed_hosts: frozenset[str]) -> bool:
    """Whether a browser opened this socket from a page of another site.

    A browser names the page's origin in ``Origin``, and any page on the web may
    open ``ws://127.0.0.1:9998/``: without this check a site the operator visits
    could take and free locks through the operator's browser (cross-site WebSocket
    hijacking). The origin must be this very host, and, against DNS rebinding (a
    site that points its own name at 127.0.0.1 sends matching headers), the host a
    name this port is known by: an IP address, ``localhost``, or one of
    ``allowed_hosts`` (``--metrics-host``, ``--http-allowed-hosts``). Clients that
    are not browsers send no ``Origin`` (or, as websocket-client does, this host's)
    and are not affected."""
    origin = next((v for k, v in request.extra_headers if k.lower() == b"origin"), None)
    if origin is None:
        return False
    host = request.host.lower()
    if urlsplit(origin.decode("latin-1")).netloc.lower() != host:
        return True
    name = (urlsplit("//" + host).hostname or "").rstrip(".")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name != "localhost" and name not in allowed_hosts
    return False


def allowed_hosts(config: Config) -> frozenset[str]:
    """The host names a browser may reach the WebSocket by (see :func:`cross_site`)."""
    names = {config.metrics_host.lower()}
    names.update(name for name in config.http_allowed_hosts.split(",") if name)
    return frozenset(names)


async def serve_websocket(
    service: PausableService,
    slots: ConnectionSlots,
    sock: socket.socket,
    head: bytes,
    closer: Closer | None = None,
) -> None:
    """One WebSocket session, from its upgrade request (``head``: the bytes read so
    far, the request head whole) to its end."""
    config = service.config
    ws = WSConnection(ConnectionType.SERVER)
    transport = WebSocketTransport(
        sock,
        ws,
        send_timeout=config.send_timeout,
        max_message=message_limit(config.max_line),
        closer=closer,
    )
    try:
        ws.receive_data(head)
        request = next((event for event in ws.events() if isinstance(event, Request)), None)
    except RemoteProtocolError as error:
        hint = error.event_hint
        await transport.reject(hint.status_code if isinstance(hint, RejectConnection) else 400)
        return
    if request is None:  # elockd.net.http sends only whole upgrade requests here
        await transport.reject(400)
        return
    refused = config.tls_cert or cross_site(request, allowed_hosts(config))
    if request.target.split("?", 1)[0] != "/" or refused:
        await transport.reject(403)
        return
    try:
        try:
            await transport.accept()
            if slots.used >= slots.limit:
                await transport.send(TOO_MANY_CONNECTIONS)
                transport.close_code = TRY_AGAIN_LATER
        except trio.BrokenResourceError:
            pass
        if not transport.is_open():
            await transport.aclose()
            return
        slots.used += 1
        try:
            address = sock.getpeername()
        except OSError:
            address = None
        await slots.run(serve_connection, service, transport, peer_name(address))
    finally:
        await transport.linger()  # the session's slot is free by now
