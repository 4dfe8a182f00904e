"""Logs an attacker cannot use: text logs escape whatever a client sent, secrets are
absent at every level, and a client that churns sessions gets a bounded number of
log lines a second, with a count of the rest.

The secrets and the churn are tried on a real ``python -m elockd``, whose whole
stderr is what an operator (or the journal) receives."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elockd.daemon.logs import configure_logging
from elockd.daemon.server import make_service, serve
from elockd.engine.sessions import Session
from elockd.observe import logs
from elockd.observe.logs import SESSION_END_BURST, escape
from elockd.observe.logthrottle import LogThrottle
from elockd.protocol.config import Config
from tests.support.line_client import LineClient
from tests.support.polling import eventually

# ---------------------------------------------------------------- hostile text

#: What a terminal acts on: C0 and C1 controls (ESC, CSI, NEL, VT, FF, DEL, ...),
#: formats (bidi overrides, zero-width joiners, tag characters), and the line and
#: paragraph separators.
HOSTILE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")
ESCAPE_SEQUENCES = (
    "\x1b[31;1m",  # SGR: red bold
    "\x1b[2J\x1b[H",  # clear the screen, cursor home
    "\x1b]0;owned\x07",  # OSC: set the window title
    "\x1b]8;;https://example.invalid\x1b\\link\x1b]8;;\x1b\\",  # OSC 8 hyperlink
    "\x1bP+q544e\x1b\\",  # DCS: terminfo query
    "\x9b6n",  # C1 CSI: report the cursor position
    "\r2026-01-01T00:00:00Z [info] elockd stopped",  # a forged line
    "\u202eevil\u202c",  # right-to-left override
)
hostile_text = (
    st.lists(
        st.one_of(
            st.characters(categories=HOSTILE_CATEGORIES),
            st.sampled_from(ESCAPE_SEQUENCES),
            st.text(max_size=4),
        ),
        min_size=1,
        max_size=12,
    )
    .map("".join)
    .filter(lambda text: not text.isprintable())
)


def non_printing(text: str) -> set[str]:
    return {char for char in text if not char.isprintable()}


def unescape(text: str) -> str:
    named = {"t": "\t", "n": "\n", "r": "\r"}
    return re.sub(
        r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[tnr])",
        lambda m: named.get(m[1]) or chr(int(m[1][1:], 16)),
        text,
    )


@given(text=hostile_text)
def test_escape_leaves_only_printable_text(text: str) -> None:
    escaped = escape(text)
    assert escaped.isprintable()
    assert len(escaped) > len(text)
    if "\\" not in text:  # else a backslash the client sent reads as an escape
        assert unescape(escaped) == text  # nothing lost, only written out


def test_escape_writes_python_escapes() -> None:
    assert escape("plain name-7 ü 名前") == "plain name-7 ü 名前"
    assert escape("\x1b[31mred") == "\\x1b[31mred"
    assert escape("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert escape("\x85\x7f\x0b\x0c") == "\\x85\\x7f\\x0b\\x0c"
    assert escape("\u2028\u2029\u202e\u200b") == "\\u2028\\u2029\\u202e\\u200b"
    assert escape("\U000e0041") == "\\U000e0041"  # a tag character


@pytest.fixture
def saved_logging() -> Iterator[None]:
    """The test points the real handler and formatter at a string
    (:func:`configure_logging`); pytest's logging comes back afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.captureWarnings(False)


def logged_as(log_format: str, text: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """What the log says, in ``log_format``, when ``text`` is put everywhere a
    client can put it: an ``iam`` name, a request's arguments, a message built with
    ``%s``, a field, a field's name, an exception's message."""
    stream = io.StringIO()
    configure_logging("debug", log_format, stream)
    monkeypatch.setattr(logs, "_session_end_log", LogThrottle(logs.log, logging.INFO, burst=10**9))
    session = Session("0" * 32, b"127.0.0.1:4242")
    session.name = text.encode()
    logs.log_session_end(session, 1, 0, "disconnected")
    logs.log.info("TLS handshake with %s failed: %s", "127.0.0.1:1", text)
    logs.log.debug("request", extra={"verb": "g", "arguments": text, "list": [text]})
    logs.log.warning("odd field", extra={text: 1})
    try:
        raise ValueError(text)
    except ValueError:
        logs.log.exception("crash %s", text)
    return stream.getvalue()


@pytest.mark.usefixtures("saved_logging")
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=hostile_text)
def test_text_logs_escape_every_control_and_non_printing_character_json_encodes_it(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = logged_as("text", text, monkeypatch)
    assert not non_printing(output) - {"\n"}, output
    lines = output.split("\n")
    assert lines.pop() == ""
    records = [line for line in lines if not line.startswith("    ")]
    # One line per record; a traceback's lines follow its record, each indented.
    assert len(records) == 5, output
    assert all(re.match(r"\d{4}-\d\d-\d\dT", line) for line in records), output
    assert "Traceback (most recent call last):" in output

    # JSON: every character outside printable ASCII is a JSON escape, and the
    # pipeline gets the client's text back exactly.
    output = logged_as("json", text, monkeypatch)
    assert output.isascii() and not non_printing(output) - {"\n"}
    found = [json.loads(line) for line in output.splitlines()]
    assert len(found) == 5
    assert found[0]["client_name"] == logs.shown(text.encode())
    assert found[1]["event"].endswith(text)
    assert found[2]["arguments"] == text
    assert text in found[3]
    assert text in found[4]["exception"]


# ---------------------------------------------------------------- secrets


def random_secret(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def windows(secret: str, width: int = 8) -> list[str]:
    """Every ``width``-character piece of ``secret``: a cut or partial copy (an
    id's first 8 characters) counts as a leak too."""
    return [secret[i : i + width] for i in range(len(secret) - width + 1)]


def leaked(secret: str, text: str) -> list[str]:
    return [piece for piece in windows(secret) if piece in text]


def test_a_session_repr_hides_its_id() -> None:
    """A repr lands in tracebacks and in any record given the object."""
    session_id = random_secret("")
    assert not leaked(session_id, repr(Session(session_id, b"127.0.0.1:1")))


async def test_request_traces_redact_auth_and_conn_id(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    token = random_secret("tok-")
    (tmp_path / "token").write_text(token + "\n")
    config = Config(port=0, metrics_port=0, auth_token_file=str(tmp_path / "token"))
    config = replace(config, auth_failure_delay=0.01, grace=30.0)
    addresses = await nursery.start(serve, config, make_service(config))
    port = int(addresses[0][1])
    client = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    assert await client.request(b"auth " + token.encode()) == b"200 OK"
    assert await client.request(b"auth " + token.encode()) == b"200 OK"  # traced now
    session_id = (await client.request(b"conn_id"))[4:].decode()
    assert len(session_id) == 32
    assert await client.request(b"g k") == b"1 Got Lock"
    await client.aclose()
    thief = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
    assert await thief.request(b"auth " + token.encode()) == b"200 OK"

    async def taken() -> bool:
        return await thief.request(b"conn_id " + session_id.encode()) == b"200 conn id set"

    await eventually(taken)
    guess = random_secret("")
    assert await thief.request(b"conn_id " + guess.encode()) == b"403 cannot set conn id"
    assert await thief.request(b"auth " + guess.encode()) == b"403 Bad Token"
    await thief.aclose()
    traced = [r for r in caplog.records if r.name == "elockd.requests"]
    shown = {(r.verb, r.arguments, r.reply) for r in traced}  # type: ignore[attr-defined]
    assert ("auth", "***", "200 ***") in shown
    assert ("conn_id", "", "200 ***") in shown
    assert ("conn_id", "***", "200 ***") in shown
    everything = "\n".join(str(vars(record)) for record in caplog.records)
    for secret in (token, session_id, guess):
        assert not leaked(secret, everything)


def listening_port(pid: int) -> int | None:
    """The TCP port process ``pid`` listens on (its only listener), from /proc: at
    ``--log-level warning`` the server does not log it."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    return int(fields[1].rsplit(":", 1)[1], 16)
    return None


class Process:
    """``python -m elockd`` with every byte of its stderr kept."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0", *args],
            stderr=subprocess.PIPE,
        )
        self.stderr = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 20
        port = None
        while port is None:
            assert self.process.poll() is None, self.text()
            assert time.monotonic() < deadline, "no listening socket"
            port = listening_port(self.process.pid)
            time.sleep(0.02)
        self.port = port

    def _read(self) -> None:
        assert self.process.stderr is not None
        while chunk := self.process.stderr.read1(65536):
            self.stderr += chunk

    def text(self) -> str:
        return self.stderr.decode(errors="backslashreplace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=10)


class Client:
    """A blocking line client for the server process."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buffer = b""

    def request(self, line: bytes) -> bytes:
        self.sock.sendall(line + b"\n")
        while b"\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(self.buffer)
            self.buffer += chunk
        reply, _, self.buffer = self.buffer.partition(b"\r\n")
        return reply

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    ("level", "log_format"),
    [("debug", "text"), ("debug", "json"), ("info", "text"), ("warning", "text")],
)
def test_no_secret_reaches_the_log_at_any_level(
    level: str, log_format: str, tmp_path: Path
) -> None:
    token = random_secret("tok-")
    admin_like = random_secret("adm-")  # a valid token of another door, sent here
    guess = random_secret("")  # a session id someone guesses
    (tmp_path / "token").write_text(token + "\n")
    server = Process(
        *("--auth-token-file", str(tmp_path / "token"), "--auth-failure-delay", "0.01"),
        *("--log-level", level, "--log-format", log_format),
    )
    try:
        auth = b"auth " + token.encode()
        wrong = Client(server.port)
        assert wrong.request(b"auth " + admin_like.encode()) == b"403 Bad Token"
        wrong.close()
        holder = Client(server.port)
        assert holder.request(auth) == b"200 OK"
        assert holder.request(auth) == b"200 OK"  # repeated: a traced request
        assert holder.request(b"auth  " + token.encode() + b"  ") == b"200 OK"
        session_id = holder.request(b"conn_id")[4:].decode()
        assert holder.request(b"set_timeout 30000") == b"200 timeout set"
        assert holder.request(b"lock job") == b"200 Acquired"
        holder.close()
        thief = Client(server.port)
        assert thief.request(auth) == b"200 OK"
        deadline = time.monotonic() + 10
        while thief.request(b"conn_id " + session_id.encode()) != b"200 conn id set":
            assert time.monotonic() < deadline
        assert thief.request(b"conn_id") == b"200 " + session_id.encode()
        assert thief.request(b"conn_id " + guess.encode()) == b"403 cannot set conn id"
        assert thief.request(b"auth " + admin_like.encode()) == b"403 Bad Token"
        thief.close()
        again = Client(server.port)
        assert again.request(b"auth " + token.encode() + b"x") == b"403 Bad Token"
        again.close()
    finally:
        server.stop()
    text = server.text()
    for secret in (token, admin_like, session_id, guess):
        assert not leaked(secret, text), (secret, text)
    assert "auth failed" in text  # the log was there to leak into
    if level == "debug":
        assert "conn_id" in text and "***" in text


# ---------------------------------------------------------------- churn


async def test_session_end_lines_are_rate_limited_with_a_count(
    nursery: trio.Nursery, saved_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One client churns 150 sessions that hold a lock, with 4 KiB names. The
    throttle's clock moves 0.02 s per session (3 s in all): at most the burst
    lines per second get through, the sessions not logged are counted on later
    lines, and the log stays within a few KiB per second."""
    stream = io.StringIO()
    configure_logging("info", "text", stream)
    ticks = iter(range(10**6))
    throttle = LogThrottle(
        logs.log, logging.INFO, 1.0, burst=SESSION_END_BURST, clock=lambda: next(ticks) * 0.02
    )
    monkeypatch.setattr(logs, "_session_end_log", throttle)
    config = Config(port=0, metrics_port=0)
    addresses = await nursery.start(serve, config, make_service(config))
    port = int(addresses[0][1])
    stream.seek(0)
    stream.truncate()
    sessions = 150
    name = b"\x1b[2J" + b"n" * 4084
    for index in range(sessions):
        client = LineClient(await trio.open_tcp_stream("127.0.0.1", port))
        await client.send(b"iam " + name + b"\ng k%d\n" % index)
        assert await client.line() == b"1 ok\r\n"
        assert await client.line() == b"1 Got Lock\r\n"
        await client.aclose()

    def lines() -> list[str]:
        return [line for line in stream.getvalue().splitlines() if "session ended" in line]

    def counted() -> bool:
        held = sum(int(n) for line in lines() for n in re.findall(r"held_back=(\d+)", line))
        return len(lines()) + held + throttle.held_back == sessions

    await eventually(counted)
    seconds = sessions * 0.02
    logged = lines()
    assert len(logged) <= SESSION_END_BURST * (seconds + 1)
    assert len(logged) < sessions / 3
    assert any("held_back=" in line for line in logged)
    assert not non_printing(stream.getvalue()) - {"\n"}
    assert all(len(line) < 600 for line in logged)  # the name is cut at 200 characters
    assert len(stream.getvalue().encode()) / seconds < SESSION_END_BURST * 600


def test_a_throttle_with_a_burst_lets_that_many_through_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    throttle = LogThrottle(logs.log, logging.INFO, 1.0, clock=lambda: now[0], burst=3)
    caplog.set_level(logging.INFO, logger="elockd")
    for _ in range(10):
        throttle("ended", fields={"n": 1})
        now[0] += 0.05  # 10 events in 0.5 s: 3 logged
    now[0] = 1.0
    throttle("ended", fields={"n": 2})
    assert throttle.held_back == 0
    held = [getattr(r, "held_back", None) for r in caplog.records]
    assert held == [None, None, None, 7]


def test_tls_handshake_failures_are_rate_limited(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "_tls_failure_log", LogThrottle(logs.log, logging.INFO, 10.0))
    caplog.set_level(logging.INFO, logger="elockd")
    for port in range(100):
        logs.log_tls_failure(b"10.0.0.1:%d" % port, ValueError("wrong version number"))
    assert [r.getMessage() for r in caplog.records] == [
        "TLS handshake with 10.0.0.1:0 failed: wrong version number"
    ]


def churn_one(port: int, name: bytes, key: bytes) -> None:
    """One session: a name, a lock, gone."""
    client = Client(port)
    assert client.request(b"iam " + name) == b"1 ok"
    assert client.request(b"g " + key) == b"1 Got Lock"
    client.close()


@pytest.mark.serial
def test_a_churning_client_gets_a_bounded_log_rate() -> None:
    """The same churn on a real server for 2 s of wall time: before the throttle,
    one client wrote 14-20 MB of log a second this way."""
    server = Process("--log-level", "info", "--log-format", "text")
    try:
        deadline = time.monotonic() + 10
        while b"listening on" not in server.stderr:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = len(server.stderr)
        started = time.monotonic()
        name = b"\x1b]0;owned\x07" + b"n" * 4080
        sessions = 0
        while time.monotonic() - started < 2.0:
            churn_one(server.port, name, b"k%d" % sessions)
            sessions += 1
        elapsed = time.monotonic() - started
        # The count of what was held back rides on the next line that gets through.
        deadline = time.monotonic() + 10
        while b"held_back=" not in server.stderr[before:]:
            assert time.monotonic() < deadline
            churn_one(server.port, b"late", b"k%d" % sessions)
            sessions += 1
            time.sleep(0.05)
        churned = bytes(server.stderr[before:])
    finally:
        server.stop()
    assert sessions > 200, sessions  # enough for a flood: 800 KB of names
    rate = len(churned) / elapsed
    print(f"{sessions} sessions in {elapsed:.1f} s: {rate:,.0f} log bytes/s")
    assert rate < 16 * 1024
    assert b"\x1b" not in churned and b"\x07" not in churned
