"""A line client for tests, and the handle of an in-process test server (the
``server`` and ``lock_server`` fixtures in conftest.py hand one out)."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from elockd.protocol.config import Config
from elockd.protocol.connection import Service


class LineClient:
    """A test client: send raw bytes, read ``\\r\\n``-terminated reply lines."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buffer = b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def line(self) -> bytes:
        """The next reply line, ``\\r\\n`` included."""
        while b"\r\n" not in self._buffer:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise EOFError(f"connection closed; partial {self._buffer!r}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        return line + b"\r\n"

    async def lines_until_end(self) -> list[bytes]:
        """Lines of a multi-line reply, up to and including ``END``."""
        lines = []
        while True:
            line = await self.line()
            lines.append(line)
            if line == b"END\r\n":
                return lines

    @property
    def peer(self) -> bytes:
        """``IP:PORT`` of this client, as the server names it."""
        host, port = self.stream.socket.getsockname()[:2]
        return b"%s:%d" % (host.encode(), port)

    async def reply(self, line: bytes) -> bytes:
        """Send one request line; its one-line reply, ``\r\n`` included."""
        await self.send(line + b"\n")
        return await self.line()

    async def listing(self, line: bytes) -> bytes:
        """Send one request line; its multi-line reply, up to and including END."""
        await self.send(line + b"\n")
        return b"".join(await self.lines_until_end())

    async def request(self, line: bytes) -> bytes:
        """Send one request line and return its one-line reply (without ``\\r\\n``)."""
        await self.send(line + b"\n")
        return (await self.line())[:-2]

    async def stats(self) -> dict[str, int]:
        await self.send(b"q\n")
        lines = await self.lines_until_end()
        values = {}
        for line in lines[:-1]:
            name, _, value = line[:-2].decode().partition(": ")
            values[name] = int(value)
        return values

    async def at_eof(self) -> bool:
        """True once the server has closed the connection (and sent nothing more)."""
        return self._buffer == b"" and await self.stream.receive_some(1) == b""

    async def aclose(self) -> None:
        await self.stream.aclose()


@dataclass
class RunningServer:
    port: int
    service: Service
    config: Config
    _clients: list[LineClient]

    async def connect(self) -> LineClient:
        client = LineClient(await trio.open_tcp_stream("127.0.0.1", self.port))
        self._clients.append(client)
        return client
