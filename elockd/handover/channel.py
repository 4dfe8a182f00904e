"""The control socket's framing: JSON messages, with file descriptors riding along.

A message is a 4-byte big-endian length and a JSON object. The descriptors that
belong to a message are sent with its bytes (SCM_RIGHTS, at most
:data:`MAX_FDS_PER_MESSAGE` per message) and the message says how many it carries
(``"fds": N``). The kernel delivers descriptors with the bytes they were sent with,
in stream order, so the receiver keeps them in a queue and hands each message its
own.
"""

from __future__ import annotations

import array
import contextlib
import json
import socket
import struct
from collections import deque
from typing import Any

import trio

#: The kernel's own cap on descriptors in one message (SCM_MAX_FD).
MAX_FDS_PER_MESSAGE = 253
#: A message larger than this is refused: a peer cannot make us buffer more.
MAX_MESSAGE = 64 << 20
#: Send and receive buffer of the control connection (the kernel may cap it).
SOCKET_BUFFER = 4 << 20
_LENGTH = struct.Struct(">I")
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)


class ChannelError(Exception):
    """The peer broke the framing or went away (the message says which)."""


class Channel:
    """One end of a control connection (a connected ``AF_UNIX`` stream socket)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        # Big buffers: the state streams in large messages, and each full buffer
        # costs both processes a wake-up.
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        self.sock = sock
        self._buffer = bytearray()
        self._fds: deque[int] = deque()

    async def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        fds = fds or []
        if len(fds) > MAX_FDS_PER_MESSAGE:
            raise ValueError("too many descriptors for one message")
        payload = json.dumps({**message, "fds": len(fds)}, separators=(",", ":")).encode()
        data = memoryview(_LENGTH.pack(len(payload)) + payload)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while data:
            try:
                sent = self.sock.sendmsg([data], ancillary)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            except OSError as error:
                raise ChannelError(f"peer gone: {error.strerror}") from error
            ancillary = []  # the descriptors went with the first bytes
            data = data[sent:]

    async def receive(self) -> tuple[dict[str, Any], list[int]]:
        """The next message and its descriptors; :class:`ChannelError` at EOF."""
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._buffer)
                if length > MAX_MESSAGE:
                    raise ChannelError(f"message of {length} bytes")
                end = _LENGTH.size + length
                if len(self._buffer) >= end:
                    payload = bytes(self._buffer[_LENGTH.size : end])
                    del self._buffer[:end]
                    return self._decode(payload)
            await self._read()

    def _decode(self, payload: bytes) -> tuple[dict[str, Any], list[int]]:
        try:
            message = json.loads(payload)
        except ValueError as error:
            raise ChannelError("a message that is not JSON") from error
        if not isinstance(message, dict):
            raise ChannelError("a message that is not a JSON object")
        count = message.get("fds", 0)
        if not isinstance(count, int) or count > len(self._fds):
            raise ChannelError("a message without the descriptors it names")
        return message, [self._fds.popleft() for _ in range(count)]

    async def _read(self) -> None:
        while True:
            try:
                data, ancillary, _flags, _ = self.sock.recvmsg(
                    1 << 20, _FD_SPACE, socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            except OSError as error:
                raise ChannelError(f"peer gone: {error.strerror}") from error
            for level, kind, cdata in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                    self._fds.extend(fds)
            if not data:
                raise ChannelError("peer closed the control connection")
            self._buffer += data
            return

    def close(self) -> None:
        """Close the connection and any descriptor received but never claimed."""
        while self._fds:
            socket.close(self._fds.popleft())
        self.sock.close()
