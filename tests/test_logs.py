"""Operational logs: what an operator reads at each level, in text and in JSON.

In-process tests read the records (``caplog``); the real process shows the JSON
stream as a log pipeline receives it."""

from __future__ import annotations

import io
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from elockd.daemon.logs import configure_logging, effective_configuration, redact_url
from elockd.daemon.server import make_service, serve
from elockd.observe import logs
from elockd.observe.logthrottle import LogThrottle
from elockd.protocol.commands import COMMANDS
from elockd.protocol.config import Config
from tests.support.line_client import LineClient
from tests.support.polling import eventually, until_waiting


def fields(record: logging.LogRecord, *names: str) -> dict[str, object]:
    return {name: getattr(record, name, None) for name in names}


async def start(nursery: trio.Nursery, config: Config) -> int:
    config = replace(config, port=0, metrics_port=0)
    addresses = await nursery.start(serve, config, make_service(config))
    return int(addresses[0][1])


async def connect(port: int) -> LineClient:
    return LineClient(await trio.open_tcp_stream("127.0.0.1", port))


@pytest.fixture(autouse=True)
def fresh_refusal_throttles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusal and session-end lines are rate-limited per process; each test starts
    with none sent."""
    monkeypatch.setattr(logs, "_refusals", {})
    monkeypatch.setattr(
        logs,
        "_session_end_log",
        LogThrottle(
            logs.log, logging.INFO, logs.SESSION_END_INTERVAL, burst=logs.SESSION_END_BURST
        ),
    )


async def test_info_has_the_orphans_and_nothing_per_request(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elockd")
    port = await start(nursery, Config())
    caplog.clear()
    client = await connect(port)
    for request in (b"iam backup-7", b"g a", b"sg b", b"lock c", b"lock c", b"q"):
        await client.send(request + b"\n")
    await client.lines_until_end()
    await client.aclose()
    checker = await connect(port)

    async def freed() -> bool:
        return await checker.request(b"i a") == b"0 Not Locked"

    await eventually(freed)
    assert [r.getMessage() for r in caplog.records] == ["session ended holding locks"]
    record = caplog.records[0]
    assert record.levelno == logging.INFO
    assert fields(record, "client_name", "freed", "exclusive", "shared", "why") == {
        "client_name": "backup-7",
        "freed": 3,
        "exclusive": 2,
        "shared": 1,
        "why": "disconnected",
    }
    assert str(record.peer).startswith("127.0.0.1:")


async def test_a_failed_auth_is_a_warning_with_the_peer(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A throttle of its own: a failed auth of an earlier test within 10 s would
    # hold this one's warning back.
    monkeypatch.setattr(logs, "_auth_failure_warning", LogThrottle(logs.log, logging.WARNING))
    token = tmp_path / "token"
    token.write_text("right\n")
    port = await start(nursery, Config(auth_token_file=str(token)))
    intruder = await connect(port)
    assert await intruder.request(b"auth wrong") == b"403 Bad Token"
    local_port = intruder.stream.socket.getsockname()[1]
    (record,) = [r for r in caplog.records if r.getMessage() == "auth failed"]
    assert record.levelno == logging.WARNING
    assert record.peer == f"127.0.0.1:{local_port}"
    await intruder.aclose()


async def test_refusals_at_limits_are_logged_once_per_interval(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elockd")
    port = await start(nursery, Config(max_holds=1, max_keys=2, max_waiters=1))
    client = await connect(port)
    assert await client.request(b"g a") == b"1 Got Lock"
    for _ in range(3):
        assert await client.request(b"g b") == b"0 Too Many Holds"
    assert await client.request(b"mlock x y z") == b"413 Too Many Keys"
    other = await connect(port)
    await other.send(b"lock a 30\n")
    await until_waiting(client, b"a")
    third = await connect(port)
    assert await third.request(b"lock a 30") == b"413 Too Many Waiters"
    refusals = [r for r in caplog.records if r.getMessage() == "refused at a limit"]
    assert [r.limit for r in refusals] == ["--max-holds", "--max-keys", "--max-waiters"]
    assert all(r.levelno == logging.INFO for r in refusals)
    assert all(str(r.peer).startswith("127.0.0.1:") for r in refusals)
    for each in (client, other, third):
        await each.aclose()


async def test_too_many_connections_is_logged(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elockd")
    port = await start(nursery, Config(max_connections=1))
    first = await connect(port)
    assert await first.request(b"ping") == b"200 PONG"
    second = await connect(port)
    assert await second.line() == b"0 Too Many Connections\r\n"
    (record,) = [r for r in caplog.records if r.getMessage() == "refused at a limit"]
    assert record.limit == "--max-connections"
    await first.aclose()
    await second.aclose()


async def test_debug_logs_connections_requests_and_waits(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="elockd")
    port = await start(nursery, Config())
    holder = await connect(port)
    assert await holder.request(b"lock job") == b"200 Acquired"
    waiter = await connect(port)
    await waiter.send(b"lock job 30\n")
    await until_waiting(holder, b"job")
    assert await holder.request(b"unlock job") == b"200 Unlocked"
    assert await waiter.line() == b"200 Acquired\r\n"
    await holder.aclose()
    await waiter.aclose()
    await eventually(lambda: "connection closed" in [r.getMessage() for r in caplog.records])
    seen = [
        (r.getMessage(), getattr(r, "verb", None), getattr(r, "reply", None))
        for r in caplog.records
    ]
    assert ("connection opened", None, None) in seen
    assert ("request", "lock", "200 Acquired") in seen
    assert ("waiting", "lock", None) in seen
    assert ("request", "unlock", "200 Unlocked") in seen
    assert ("wait ended", "lock", "200 Acquired") in seen
    assert ("connection closed", None, None) in seen
    (wait,) = [r for r in caplog.records if r.getMessage() == "waiting"]
    assert fields(wait, "peer", "arguments")["arguments"] == "job 30"


async def test_request_tracing_is_wired_only_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elockd")
    assert make_service(Config()).commands is COMMANDS  # not one wrapper in the hot path
    caplog.set_level(logging.DEBUG, logger="elockd")
    traced = make_service(Config()).commands
    assert traced.keys() == COMMANDS.keys()
    assert traced[b"g"] is not COMMANDS[b"g"]


def test_the_start_record_redacts_secrets() -> None:
    assert redact_url("http://root:hunter2@etcd:2379") == "http://root:***@etcd:2379"
    assert redact_url("https://etcd:2379") == "https://etcd:2379"
    config = Config(etcd="http://a:2379,https://u:pw@b:2379", auth_token_file="/etc/elockd/token")
    shown = effective_configuration(config)
    assert shown["etcd"] == "http://a:2379,https://u:***@b:2379"
    assert shown["auth_token_file"] == "/etc/elockd/token"


def test_text_and_json_render_the_same_record(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for log_format in ("text", "json"):
            stream = io.StringIO()
            configure_logging("info", log_format, stream)
            # A throttle of its own per format: the server's allows one line per 10 s.
            throttle = LogThrottle(logs.log, logging.WARNING)
            monkeypatch.setattr(logs, "_auth_failure_warning", throttle)
            logs.log_auth_failure(b"10.1.2.3:4567")
            logging.getLogger("elockd").debug("not shown at info")
            (line,) = stream.getvalue().splitlines()
            if log_format == "json":
                record = json.loads(line)
                assert set(record) == {"ts", "level", "event", "logger", "peer"}
                assert (record["level"], record["event"]) == ("warning", "auth failed")
                assert record["peer"] == "10.1.2.3:4567"
            else:
                assert "[warning] auth failed" in line
                assert line.endswith("peer=10.1.2.3:4567")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.captureWarnings(False)


# ------------------------------------------------------------ the real process


def read_port(process: subprocess.Popen[str]) -> tuple[int, list[str]]:
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if "listening on" in line:
            return int(json.loads(line)["event"].rsplit(":", 1)[1]), lines
    raise AssertionError(f"server did not start (exit {process.wait()}): {lines}")


def exchange(port: int, requests: bytes, replies: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(requests)
        received = b""
        while received.count(b"\r\n") < replies:
            received += sock.recv(4096)
        return received


def test_json_logs_are_json_only_with_the_auth_warning_and_the_orphans(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("letmein-7f3a\n")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0"),
            *("--log-format", "json", "--auth-token-file", str(token), "--grace-ms", "0"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port, lines = read_port(process)
        assert exchange(port, b"auth guess\n", 1) == b"403 Bad Token\r\n"
        replies = exchange(port, b"auth letmein-7f3a\niam nightly\ng a\nlock b\nsg c\n", 5)
        assert replies.endswith(b"1 Got Lock\r\n")  # then the client vanishes
        deadline = time.monotonic() + 10
        while exchange(port, b"auth letmein-7f3a\ni a\n", 2) != b"200 OK\r\n0 Not Locked\r\n":
            assert time.monotonic() < deadline
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait()
    assert process.stderr is not None
    text = "".join(lines) + process.stderr.read()
    process.stderr.close()
    records = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    assert all({"ts", "level", "event"} <= set(record) for record in records)
    assert "letmein-7f3a" not in text
    events = [(r["level"], r["event"]) for r in records]
    assert events[0] == ("warning", "setting")  # --grace-ms is deprecated
    assert events[1] == ("info", "elockd starting")
    assert records[1]["auth_token_file"] == str(token)
    assert ("warning", "auth failed") in events
    (orphans,) = [r for r in records if r["event"] == "session ended holding locks"]
    assert (orphans["client_name"], orphans["freed"], orphans["level"]) == ("nightly", 3, "info")
    assert events[-1] == ("info", "elockd stopped")
    assert not [event for event in events if event[0] == "debug"]


def test_a_traced_waiting_reply_is_still_named_by_its_verb_for_a_hand_over() -> None:
    """With --log-level debug every reply's wording is wrapped to be logged; a
    hand-over names a waiting request's wording by the function it wraps, so the
    wrapper must lead back to it (else every hand-over fails while one waits)."""
    import inspect

    from elockd.daemon.server import make_memory_backend
    from elockd.net.serving import PausableService
    from elockd.observe.tracing import trace_requests
    from elockd.protocol.commands import COMMANDS
    from elockd.protocol.connection import Connection, Outcome

    config = Config()
    service = PausableService(config, make_memory_backend(config), COMMANDS)
    trace_requests(service)
    holder, waiter = Connection(service, b"a"), Connection(service, b"b")
    assert holder.handle(b"lock K", 0.0) == b"200 Acquired\r\n"
    outcome = waiter.handle(b"lock K 5", 0.0)
    assert isinstance(outcome, Outcome) and outcome.waits
    assert outcome.finish is not COMMANDS[b"lock"].wait_reply  # traced
    assert inspect.unwrap(outcome.finish) is COMMANDS[b"lock"].wait_reply
