"""Byte transports for a connection: the fast raw-socket path and a Stream path.

Why a raw path: trio's ``SocketStream`` costs about twice the per-request CPU of
waiting for readability and calling ``recv``/``send`` on the plain socket directly
(a minimal handler: ~40k vs ~75k requests/s, docs/performance.md), and at one request in flight per
connection that overhead decides whether we beat glockd. So TCP and Unix-socket
connections use :class:`SocketTransport`; TLS (and tests with memory streams) use
:class:`StreamTransport` over any ``trio.abc.Stream``. Both offer the same three
calls, and both keep data read while a request waits (see ``watch_for_close``).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import socket
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any, Protocol

import trio

from elockd.handover.pause import NEVER, STREAM_SEND_GRACE, Interrupted, Pause
from elockd.net.tcp_silence import lower_user_timeout, set_user_timeout, silent_for

RECEIVE_SIZE = 65536
#: After a late reply lowered the user timeout, how often :class:`Restorer` checks
#: whether the peer was heard since (then the whole bound applies again).
HEARD_RECHECK = 0.5
#: Connections :class:`Restorer` checks between two checkpoints.
RESTORE_SLICE = 256
#: While a request waits, bytes read ahead of it are kept up to this much; past it
#: we stop reading (the client is alive and pipelining; TCP pushes back on it).
READ_AHEAD_LIMIT = 1 << 20
#: Replies a connection may owe when a hand-over's pause finds its client not
#: reading: they move with it (docs/upgrade.md). A connection that would owe more
#: (a dump of a big table, made once the pause came) ends instead, as its send
#: timeout would end it: the same bound as what it may have sent ahead.
UNSENT_LIMIT = READ_AHEAD_LIMIT


class Transport(Protocol):
    #: Set by the connection's loop: while a read waits, the connection rests as
    #: ``rest`` (it counts as parked for a hand-over's ``pause``), and a read that
    #: ends while the pause lasts raises :class:`~elockd.handover.pause.Interrupted` instead
    #: of returning. What it rests as is the connection loop's business
    #: (:class:`elockd.handover.parked.Parked`): the transport only hands it to the pause.
    pause: Pause[Any]
    rest: Hashable | None

    async def receive(self) -> bytes:
        """The next chunk, or b"" once the peer is gone."""

    async def send(self, data: bytes) -> None:
        """Send ``data``; BrokenResourceError when the peer is gone or took nothing
        for ``--send-timeout``. During a hand-over's pause a send its client does
        not take stops at once (:meth:`~elockd.handover.pause.Pause.stall_scope`): a socket
        returns owing the rest, which moves with it; a stream ends."""

    async def send_stream(self, chunks: Iterable[bytes]) -> None:
        """Send a reply that grows with the tables, a chunk at a time: each chunk is
        made only once the one before went out (as one WebSocket message, in
        fragments)."""

    def replying_late(self) -> None:
        """The next send answers a request read a while ago (a grant after a wait): a
        peer that vanished meanwhile is to be given up on within the keepalive bound
        of when it was last heard from, not of this send (elockd/net/tcp_silence.py)."""

    async def watch_for_close(self) -> None:
        """Return when the peer closes; keep what it sends meanwhile for receive()."""

    async def receive_beside(self) -> bytes:
        """:meth:`receive` for a connection whose sends run in another task at the
        same time (a ``watch`` stream, :mod:`elockd.net.watching`): it sends nothing
        itself, so the two never wait on the socket together."""

    async def aclose(self) -> None: ...


class _ReadAhead:
    """What both transports share: data read while a request waited comes first."""

    __slots__ = ("_read_ahead", "pause", "rest")

    def __init__(self) -> None:
        self._read_ahead = b""
        self.pause = NEVER
        self.rest: Hashable | None = None

    @property
    def read_ahead(self) -> bytes:
        """Bytes read but not yet handed to the connection (they move with it)."""
        return self._read_ahead

    @read_ahead.setter
    def read_ahead(self, data: bytes) -> None:
        self._read_ahead = data

    async def _receive_raw(self) -> bytes:
        raise NotImplementedError

    async def send(self, data: bytes) -> None:
        raise NotImplementedError

    async def send_stream(self, chunks: Iterable[bytes]) -> None:
        """A chunk at a time, as the client reads (a client that does not read stops
        the dump, not the server); other connections run between chunks."""
        for chunk in chunks:
            if chunk:  # an empty listing in glockd's dialect is no reply at all
                await self.send(chunk)
            await trio.lowlevel.checkpoint()

    def replying_late(self) -> None:
        """Nothing to do where no TCP socket is reachable (TLS, memory streams)."""

    async def receive(self) -> bytes:
        if self._read_ahead:
            data, self._read_ahead = self._read_ahead, b""
            return data
        return await self._receive_raw()

    async def receive_beside(self) -> bytes:
        return await self.receive()  # a stream's reads send nothing

    async def watch_for_close(self) -> None:
        while len(self._read_ahead) < READ_AHEAD_LIMIT:
            data = await self._receive_raw()
            if not data:
                return
            self._read_ahead += data
        await rest_forever(self.pause, self.rest)


async def rest_forever(pause: Pause[Any], rest: Hashable | None) -> None:
    """Sleep until cancelled, counted as at rest for a hand-over meanwhile."""
    if rest is not None:
        pause.idle.add(rest)
    try:
        await trio.sleep_forever()
    finally:
        pause.idle.discard(rest)


#: Sockets a :class:`Closer` closes before it lets other tasks run.
CLOSE_SLICE = 128


class Closer:
    """Closes the sockets of ended connections a slice at a time.

    ``close()`` of a TCP socket costs the kernel's FIN work, about 8 µs: when 10,000
    connections drop together, their tasks all end in one scheduler batch, and
    closing every socket there would hold every other client up for 80 ms more.
    Handed here instead, they are closed :data:`CLOSE_SLICE` at a time with a
    checkpoint between slices (and all at once when the server stops)."""

    def __init__(self) -> None:
        self._pending: deque[socket.socket] = deque()
        self._work = trio.Event()

    def close_later(self, sock: socket.socket) -> None:
        self._pending.append(sock)
        self._work.set()

    async def run(self) -> None:
        try:
            while True:
                await self._work.wait()
                self._work = trio.Event()
                while self._pending:
                    for _ in range(min(CLOSE_SLICE, len(self._pending))):
                        self._pending.popleft().close()
                    await trio.lowlevel.checkpoint()
        finally:
            while self._pending:
                self._pending.popleft().close()


class SocketTransport(_ReadAhead):
    """A connected non-blocking stdlib socket, driven with trio's readiness waits.

    ``send_timeout`` bounds how long a send may make no progress: a client that
    stops reading its replies stops being read (we are stuck in send) and is dropped
    once no byte went out for this long, so its backlog cannot grow. The deadline
    moves whenever bytes go out, so a big reply read slowly but steadily is not cut.

    What a send could not send at once waits in :attr:`unsent`, and goes out before
    anything else. A hand-over's pause interrupts a send waiting for its client: the
    bytes stay in :attr:`unsent`, the connection parks owing them, and they move
    with it (or go out first once a failed hand-over resumes it).

    ``bound`` (seconds; 0 for none) is how long after its peer was last heard a TCP
    connection dies (``TCP_USER_TIMEOUT``, set by ``tune_accepted``): a late reply
    lowers it to what is left of that (:meth:`replying_late`), and the whole bound
    applies again once the peer is heard from. ``lowered`` says it is lowered now.
    """

    __slots__ = ("bound", "closer", "lowered", "lowered_at", "send_timeout", "sock", "unsent")

    def __init__(
        self,
        sock: socket.socket,
        send_timeout: float = math.inf,
        closer: Closer | None = None,
        bound: float = 0.0,
    ) -> None:
        super().__init__()
        sock.setblocking(False)
        self.sock = sock
        self.send_timeout = send_timeout
        self.closer = closer
        self.unsent = bytearray()
        self.bound = bound if sock.family in (socket.AF_INET, socket.AF_INET6) else 0.0
        self.lowered = False
        self.lowered_at = 0.0

    def replying_late(self) -> None:
        if not self.bound:
            return
        try:
            if lower_user_timeout(self.sock, self.bound) is None:
                return
        except OSError:
            return  # the connection is gone: the send will tell
        self.lowered_at = trio.current_time()
        self.lowered = True
        Restorer.of_this_run().watch(self, self.lowered_at + HEARD_RECHECK)

    def heard(self) -> None:
        """The peer was heard from since the late reply: the whole bound again."""
        self.lowered = False
        with contextlib.suppress(OSError):  # gone meanwhile: the next read tells
            set_user_timeout(self.sock, self.bound)

    def check_heard(self) -> bool:
        """Give the whole bound back if the peer was heard since the late reply (its
        ACK, say: a holder that stays silent then keeps the whole bound, not what was
        left of it). True while it is still to be checked again."""
        if not self.lowered:
            return False  # heard through a read meanwhile
        try:
            silence = silent_for(self.sock)
        except OSError:
            self.lowered = False  # closed: nothing left to restore
            return False
        if silence < trio.current_time() - self.lowered_at:
            self.heard()
            return False
        return True

    async def receive(self) -> bytes:
        """Yield to the other connections first, then try ``recv`` before arming epoll.

        This is the hot path. Right after we reply, the peer's next request is not
        here yet, so we let every other ready connection run (one checkpoint, which
        also keeps a pipelining client from starving the rest); by the time we are
        scheduled again it usually has arrived, and ``recv`` succeeds without the
        ``epoll_ctl`` + wake-up round trip that ``wait_readable`` costs on every call.
        Measured: +45% requests/s at one request in flight (docs/performance.md).
        """
        if self._read_ahead:
            data, self._read_ahead = self._read_ahead, b""
            return data
        if self.unsent:  # replies owed from before a hand-over's pause
            await self._flush()
        await trio.lowlevel.checkpoint()
        if self.pause.requested:
            raise Interrupted
        try:
            data = self.sock.recv(RECEIVE_SIZE)
        except BlockingIOError:
            return await self._receive_raw()
        except OSError:  # reset by peer and friends: the peer is gone
            return b""
        if self.lowered:
            self.heard()
        return data

    async def _receive_raw(self) -> bytes:
        if self.unsent:
            await self._flush()
            if self.unsent:
                # Paused while it still owes replies: it parks rather than rests in
                # the wait, so that a failed hand-over wakes it to send them.
                raise Interrupted
        return await self._wait_and_receive()

    async def receive_beside(self) -> bytes:
        """Never flushes what it owes: the stream's sender does (see the Protocol)."""
        if self._read_ahead:
            data, self._read_ahead = self._read_ahead, b""
            return data
        await trio.lowlevel.checkpoint()
        if self.pause.requested:
            raise Interrupted
        return await self._wait_and_receive()

    async def _wait_and_receive(self) -> bytes:
        sock, pause, rest = self.sock, self.pause, self.rest
        while True:
            if rest is not None:
                pause.idle.add(rest)
            try:
                await trio.lowlevel.wait_readable(sock)
            finally:
                pause.idle.discard(rest)
            if pause.requested:
                raise Interrupted
            try:
                data = sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                continue
            except OSError:  # reset by peer and friends: the peer is gone
                return b""
            if self.lowered:
                self.heard()
            return data

    async def send(self, data: bytes) -> None:
        if not self.unsent:
            # The common send: all of it at once, no buffer, no cancel scope.
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as error:
                raise trio.BrokenResourceError from error
            if sent == len(data):
                return
            self.unsent += memoryview(data)[sent:]
        else:
            self.unsent += data
        if self.pause.requested and len(self.unsent) > UNSENT_LIMIT:
            raise trio.BrokenResourceError("send timed out: peer not reading at a hand-over")
        await self._flush()

    async def _flush(self) -> None:
        """Send :attr:`unsent` until it is all out; return early, keeping the rest,
        when a hand-over's pause finds the client not reading. Cancelled, it keeps
        what is left too."""
        sock, unsent, pause = self.sock, self.unsent, self.pause
        deadline = math.inf
        while unsent:
            try:
                sent = sock.send(unsent)
            except BlockingIOError:
                if pause.requested:
                    return  # stuck at a hand-over: what is left moves with the connection
                if deadline == math.inf:
                    deadline = trio.current_time() + self.send_timeout
                with pause.stall_scope(deadline, 0.0):
                    await trio.lowlevel.wait_writable(sock)
                    continue
                if pause.requested:
                    return
                raise trio.BrokenResourceError("send timed out: peer not reading") from None
            except OSError as error:
                raise trio.BrokenResourceError from error
            del unsent[:sent]
            deadline = math.inf  # progress: the next stall gets a fresh deadline

    async def aclose(self) -> None:
        if self.closer is None:
            self.sock.close()
        else:
            self.closer.close_later(self.sock)


class Restorer:
    """One task per trio run (a system task, started on first use) that gives
    connections whose user timeout a late reply lowered the whole bound back once
    their peer was heard from, :data:`RESTORE_SLICE` at a time with a checkpoint
    between slices. One task, not a timer in each connection's read: 10,000 waits
    that time out together would otherwise all wake at once half a second later,
    each re-arming its epoll registration (a 100 ms stall for everyone else)."""

    _current: trio.lowlevel.RunVar[Restorer] = trio.lowlevel.RunVar("restorer")

    def __init__(self) -> None:
        self._due: list[tuple[float, int, SocketTransport]] = []
        self._order = 0  # ties in the heap never compare transports
        self._work = trio.Event()

    @classmethod
    def of_this_run(cls) -> Restorer:
        try:
            return cls._current.get()
        except LookupError:
            restorer = cls()
            cls._current.set(restorer)
            trio.lowlevel.spawn_system_task(restorer.run, name="elockd.net.transport.Restorer")
            return restorer

    def watch(self, transport: SocketTransport, at: float) -> None:
        """Check ``transport`` at ``at`` (and every :data:`HEARD_RECHECK` after, while
        its peer stays unheard: then the kernel gives it up within what was left)."""
        self._order += 1
        heapq.heappush(self._due, (at, self._order, transport))
        self._work.set()

    async def run(self) -> None:
        due = self._due
        while True:
            if not due:
                await self._work.wait()
                self._work = trio.Event()
                continue
            now = trio.current_time()
            if due[0][0] > now:
                with trio.move_on_at(due[0][0]):
                    await self._work.wait()  # an earlier one may come meanwhile
                self._work = trio.Event()
                continue
            for _ in range(RESTORE_SLICE):
                if not due or due[0][0] > now:
                    break
                _, _, transport = heapq.heappop(due)
                if transport.check_heard():
                    self.watch(transport, now + HEARD_RECHECK)
            await trio.lowlevel.checkpoint()


#: A Stream's send_all gives no sign of progress until it returns, so
#: :class:`StreamTransport` sends big replies in pieces of this size, each with its own
#: ``send_timeout``: a client reading steadily keeps its connection, a stalled one
#: does not.
STREAM_SEND_PIECE = 16384


class StreamTransport(_ReadAhead):
    """Any trio Stream: TLS, memory streams in tests."""

    __slots__ = ("send_timeout", "stream")

    def __init__(self, stream: trio.abc.Stream, send_timeout: float = math.inf) -> None:
        super().__init__()
        self.stream = stream
        self.send_timeout = send_timeout

    async def _receive_raw(self) -> bytes:
        pause, rest = self.pause, self.rest
        if rest is not None:
            pause.idle.add(rest)
        try:
            data = bytes(await self.stream.receive_some(RECEIVE_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        finally:
            pause.idle.discard(rest)
        if pause.requested:
            # What came stays for the next read (this connection cannot move, but
            # a failed hand-over serves it on).
            self._read_ahead += data
            raise Interrupted
        return data

    async def send(self, data: bytes) -> None:
        """Each piece within ``send_timeout``; once a hand-over's pause is requested,
        within :data:`~elockd.handover.pause.STREAM_SEND_GRACE` (a stream cannot say what of a
        piece went out, so a stuck one ends rather than move)."""
        view, pause = memoryview(data), self.pause
        for start in range(0, len(view), STREAM_SEND_PIECE):
            deadline = trio.current_time() + self.send_timeout
            with pause.stall_scope(deadline, STREAM_SEND_GRACE) as stalled:
                await self.stream.send_all(view[start : start + STREAM_SEND_PIECE])
            if stalled.cancelled_caught:
                raise trio.BrokenResourceError("send timed out: peer not reading")

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)
