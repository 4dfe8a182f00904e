"""The operators' elockctl commands: ``ls``, ``watch``, ``kill``, ``top``.

Pure parts first (ages in words, ``ls`` lines read into rows, the table, the
rates of ``top``), then each command end to end against a real server process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from elockd.client import BlockingClient, ProtocolError
from elockd.client.replies import ReplyReader
from elockd.ctl import main as ctl
from elockd.ctl.operate import ls_line
from elockd.ctl.rows import (
    Row,
    duration,
    duration_flag,
    lock_table,
    parse_listing,
    parse_row,
)
from elockd.ctl.status import EXIT_ERROR, EXIT_FALSE, EXIT_USAGE
from elockd.ctl.top import Sample, frame, longest_queues, oldest, rates
from elockd.ctl.watch import stamp
from tests.support.polling import eventually_blocking
from tests.support.server_process import start_server, stop_server

EXCLUSIVE = (
    b"nightly/report exclusive=10.0.0.7:51234 shared=0 waiting=2 age=11520.250 token=42 ttl=-"
)
SHARED = b"jobs/b exclusive=- shared=3 waiting=0 age=45.001 token=- ttl=29.500"
QUEUED = b"jobs/c exclusive=- shared=0 waiting=1 age=- token=- ttl=-"


def rendered(renderable: object, width: int = 160) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(text, str)
    return text


# ---------------------------------------------------------------- ages in words


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.9, "0s"),
        (45.7, "45s"),
        (60, "1m"),
        (725, "12m5s"),
        (3600, "1h"),
        (3605, "1h"),  # two units at most: the seconds of an hour do not count
        (11520.25, "3h12m"),
        (86400 * 2 + 3 * 3600 + 59, "2d3h"),
        (86400 * 2 + 5 * 60, "2d"),
        (None, "-"),
    ],
)
def test_duration_says_the_two_largest_units(seconds: float | None, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("45s", 45),
        ("10m", 600),
        ("1h", 3600),
        ("1h30m", 5400),
        ("2d", 172800),
        ("0.5", 0.5),
    ],
)
def test_older_takes_seconds_or_units(text: str, seconds: float) -> None:
    assert duration_flag(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1x", "-5", "1h 30m", "30m1h", "nan"])
def test_older_refuses_what_is_no_duration(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a duration"):
        duration_flag(text)


# ---------------------------------------------------------------- ls lines


def test_ls_lines_become_rows_of_each_kind() -> None:
    held = parse_row(EXCLUSIVE)
    assert held == Row("nightly/report", "10.0.0.7:51234", 0, 2, 11520.25, 42, None)
    assert held.kind == "exclusive"
    shared = parse_row(SHARED)
    assert (shared.kind, shared.shared, shared.ttl, shared.token) == ("shared", 3, 29.5, None)
    queued = parse_row(QUEUED)
    assert (queued.kind, queued.age, queued.waiting) == ("waiting", None, 1)


def test_an_owner_name_with_a_blank_is_read_whole() -> None:
    row = parse_row(b"k exclusive=night shift shared=0 waiting=0 age=1.000 token=7 ttl=-")
    assert (row.owner, row.token) == ("night shift", 7)


@pytest.mark.parametrize(
    "line",
    [b"HTTP/1.1 400 Bad Request", b"k exclusive=a shared=x waiting=0 age=1 token=- ttl=-", b""],
)
def test_a_line_that_is_no_row_is_a_protocol_error(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="not an 'ls' line"):
        parse_row(line)


def test_a_cut_listing_is_told_by_its_last_line() -> None:
    rows, more = parse_listing([EXCLUSIVE, SHARED, "… more".encode()])
    assert [row.key for row in rows] == ["nightly/report", "jobs/b"]
    assert more
    assert parse_listing([EXCLUSIVE]) == ([parse_row(EXCLUSIVE)], False)
    assert parse_listing([]) == ([], False)


def test_the_client_reads_an_ls_reply_as_one_block() -> None:
    reader = ReplyReader()
    reader.feed(EXCLUSIVE + b"\r\n" + SHARED + b"\r\n")
    assert reader.take_reply(multiline=True) is None  # no END yet
    reader.feed(b"END\r\n" + "… more".encode() + b"\r\nEND\r\nEND\r\n")
    assert reader.take_reply(multiline=True) == [EXCLUSIVE, SHARED, b"END"]
    assert reader.take_reply(multiline=True) == ["… more".encode(), b"END"]
    assert reader.take_reply(multiline=True) == [b"END"]  # nothing listed


def test_the_request_carries_prefix_older_and_limit() -> None:
    assert ls_line(None, None, None) == b"ls"
    assert ls_line("jobs/", 3600.0, 5) == b"ls jobs/ older=3600 limit=5"
    assert ls_line("", 0.25, None) == b"ls older=0.25"


def test_json_rows_keep_seconds_as_numbers_and_dashes_as_null() -> None:
    assert parse_row(QUEUED).as_json() == {
        "kind": "waiting",
        "key": "jobs/c",
        "owner": None,
        "shared": 0,
        "waiting": 1,
        "age": None,
        "token": None,
        "ttl": None,
    }
    json.dumps(parse_row(SHARED).as_json())  # every value serialises


def test_the_table_shows_every_column_with_human_ages() -> None:
    rows = [parse_row(line) for line in (EXCLUSIVE, SHARED, QUEUED)]
    lines = rendered(lock_table(rows, plain=True)).splitlines()
    assert lines[0].split() == ["KEY", "KIND", "OWNER", "AGE", "TOKEN", "TTL", "WAITING"]
    assert lines[1].split() == [
        "nightly/report",
        "exclusive",
        "10.0.0.7:51234",
        "3h12m",
        "42",
        "-",
        "2",
    ]
    assert lines[2].split() == ["jobs/b", "shared", "3", "holders", "45s", "-", "29s", "0"]
    assert lines[3].split() == ["jobs/c", "waiting", "-", "-", "-", "-", "1"]


# ---------------------------------------------------------------- top's parts


def test_rates_leave_out_tops_own_requests() -> None:
    before = Sample(10.0, {"command_g": 100, "command_q": 5, "command_ls": 5, "command_r": 7})
    after = Sample(
        12.0, {"command_g": 300, "command_q": 6, "command_ls": 6, "command_r": 8, "command_i": 4}
    )
    assert rates(before, after) == {"g": 100.0, "i": 2.0, "r": 0.5}
    assert rates(after, after) == {}


def test_the_oldest_holds_and_the_longest_queues_come_first() -> None:
    rows = [
        Row("a", "x", 0, 0, 5.0, 1, None),
        Row("b", None, 2, 4, 500.0, None, None),
        Row("c", None, 0, 9, None, None, None),
        Row("d", "y", 0, 1, 50.0, 2, None),
    ]
    assert [row.key for row in oldest(rows, 2)] == ["b", "d"]
    assert [row.key for row in longest_queues(rows, 5)] == ["c", "b", "d"]


def test_a_frame_shows_the_headline_panes_and_rates() -> None:
    rows = [parse_row(line) for line in (EXCLUSIVE, SHARED, QUEUED)]
    moment = datetime(2025, 3, 1, 3, 4, 5, tzinfo=UTC)
    text = rendered(frame("127.0.0.1:9999", rows, False, {"g": 12.0, "r": 3.5}, 10, moment))
    assert "elockd 127.0.0.1:9999   2 keys held, 3 waiting   15.5 req/s   03:04:05 UTC" in text
    oldest_pane = text.split("Oldest holds")[1].split("Longest queues")[0]
    queue_pane = text.split("Longest queues")[1].split("Requests per second")[0]
    assert oldest_pane.index("nightly/report") < oldest_pane.index("jobs/b")
    assert "jobs/c" not in oldest_pane
    assert queue_pane.index("nightly/report") < queue_pane.index("jobs/c")
    assert "jobs/b" not in queue_pane
    assert re.search(r"all\s+15\.5", text) and re.search(r"g\s+12\.0", text)
    cut = rendered(frame("s", rows, True, None, 10, moment))
    assert "cut at --scan 3 keys" in cut and "measuring" in cut


def test_event_stamps_are_utc_with_milliseconds() -> None:
    assert stamp(datetime(2025, 3, 1, 3, 4, 5, 678912, tzinfo=UTC)) == "2025-03-01T03:04:05.678Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stamp())


# ---------------------------------------------------------------- end to end


ADMIN_TOKEN = "operator-secret"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A server with an admin token; the port and the token's file."""
    path = tmp_path_factory.mktemp("admin") / "admin-token"
    path.write_text(ADMIN_TOKEN + "\n")
    process, port = start_server("--admin-token-file", str(path))
    yield port, path
    stop_server(process)


def run(port: int, *argv: str) -> int:
    return ctl.main(["--port", str(port), *argv])


def named(port: int, name: str) -> BlockingClient:
    """A connected client that calls itself ``name`` (the OWNER ``ls`` shows)."""
    client = BlockingClient(port=port)
    client.connect()
    client.command(f"iam {name}")
    return client


@contextlib.contextmanager
def waiting_on(port: int, key: str, name: str) -> Iterator[None]:
    """A connection of its own waits for ``key`` for the block. A bare socket: the
    block ends the wait by closing it (a client's goodbye would queue behind it)."""
    with socket.create_connection(("127.0.0.1", port)) as waiter:
        waiter.sendall(f"iam {name}\nlock {key} 60\n".encode())
        eventually_blocking(
            lambda: waiter_count(port, key) >= 1, timeout=10, what=f"{name} waiting"
        )
        yield


def waiter_count(port: int, key: str) -> int:
    with BlockingClient(port=port) as probe:
        return probe.info(key).waiting


def json_rows(port: int, capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert run(port, "ls", "--json", *argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_ls_lists_exactly_the_held_and_waited_keys_under_a_prefix(
    server: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, _ = server
    holder, sharer, outsider = named(port, "alice"), named(port, "bob"), named(port, "carol")
    try:
        hold = holder.acquire("ops/a")
        sharer.acquire_shared("ops/b", limit=5)
        outsider.acquire("other/x")
        with waiting_on(port, "ops/a", "dave"):
            rows = json_rows(port, capsys, "ops/")
            assert [row["key"] for row in rows] == ["ops/a", "ops/b"]
            first, shared = rows
            assert (first["kind"], first["owner"], first["waiting"]) == ("exclusive", "alice", 1)
            assert first["token"] == hold.token and first["ttl"] is None
            assert (shared["kind"], shared["shared"], shared["owner"]) == ("shared", 1, None)

            assert run(port, "ls", "ops/") == 0
            table = capsys.readouterr().out.splitlines()
            assert table[0].split() == ["KEY", "KIND", "OWNER", "AGE", "TOKEN", "TTL", "WAITING"]
            assert table[1].split()[:3] == ["ops/a", "exclusive", "alice"]
            assert table[1].split()[4:] == [str(hold.token), "-", "1"]
            assert table[2].split()[:4] == ["ops/b", "shared", "1", "holder"]
            assert len(table) == 3

            # ages grow between two listings
            before = first["age"]
            eventually_blocking(
                lambda: json_rows(port, capsys, "ops/")[0]["age"] > before,
                timeout=10,
                what="an age that grows",
            )
    finally:
        for client in (holder, sharer, outsider):
            client.close()


def test_ls_older_and_limit_cut_the_listing(
    server: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, _ = server
    holder = named(port, "fred")
    try:
        for key in ("cut/a", "cut/b", "cut/c"):
            holder.acquire(key)
        assert [row["key"] for row in json_rows(port, capsys, "cut/", "--older", "0")] == [
            "cut/a",
            "cut/b",
            "cut/c",
        ]
        assert json_rows(port, capsys, "cut/", "--older", "1h") == []
        assert run(port, "ls", "cut/", "--older", "1h") == 0
        assert capsys.readouterr().out == "no key is held or waited for under cut/\n"

        assert [row["key"] for row in json_rows(port, capsys, "cut/", "--limit", "2")] == [
            "cut/a",
            "cut/b",
        ]
        assert run(port, "ls", "cut/", "--limit", "2", "--json") == 0
        assert "more keys than --limit 2" in capsys.readouterr().err
        assert run(port, "ls", "cut/", "--limit", "2") == 0
        out = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in out[1:3]] == ["cut/a", "cut/b"]
        assert out[3].startswith("… more (cut at --limit 2)")
    finally:
        holder.close()


def test_ls_usage_errors_are_exit_2(
    server: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, _ = server
    with pytest.raises(SystemExit) as exited:
        run(port, "ls", "--older", "soon")
    assert exited.value.code == EXIT_USAGE
    assert "'soon' is not a duration" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        run(port, "ls", "a b")
    assert exited.value.code == EXIT_USAGE
    assert "prefix 'a b' cannot be sent" in capsys.readouterr().err


def test_ls_with_no_server_cannot_tell(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(closed_port(), "ls") == EXIT_ERROR
    assert "cannot connect" in capsys.readouterr().err


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_kill_frees_every_hold_and_the_next_token_is_larger(
    server: tuple[int, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    port, admin = server
    holder, sharer = named(port, "stuck"), named(port, "reader")
    try:
        token = holder.acquire("kill/a").token
        assert token is not None
        sharer.acquire_shared("kill/b")
        assert run(port, "kill", "kill/a", "--admin-token-file", str(admin)) == 0
        assert capsys.readouterr().out == "killed 1\n"
        assert holder.command("token kill/a")[0].startswith(b"403")  # evicted: fenced off
        with BlockingClient(port=port) as next_holder:
            assert (next_holder.acquire("kill/a").token or 0) > token
        assert run(port, "kill", "kill/b", "--admin-token-file", str(admin)) == 0
        assert capsys.readouterr().out == "killed 1\n"
        assert run(port, "kill", "kill/free", "--admin-token-file", str(admin)) == 0
        assert capsys.readouterr().out == "killed 0\n"

        wrong = tmp_path / "wrong"
        wrong.write_text("guess\n")
        assert run(port, "kill", "kill/a", "--admin-token-file", str(wrong)) == EXIT_FALSE
        captured = capsys.readouterr()
        assert captured.out == ""
        # Refused at 'auth' (403 Bad Token) or at 'kill' (403 Forbidden): a "no" either way.
        assert "(403 " in captured.err or ": 403 Forbidden" in captured.err
        assert f"--admin-token-file {wrong}" in captured.err
        assert len(captured.err.splitlines()) == 1
    finally:
        holder.close()
        sharer.close()


def test_kill_without_the_flag_or_its_file_is_a_usage_error(
    server: tuple[int, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    port, _ = server
    for argv in (["kill", "k"], ["kill", "k", "--admin-token-file", str(tmp_path / "absent")]):
        with pytest.raises(SystemExit) as exited:
            run(port, *argv)
        assert exited.value.code == EXIT_USAGE
        assert "--admin-token-file" in capsys.readouterr().err


def test_kill_on_a_server_without_an_admin_token_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    process, port = start_server()
    try:
        token = tmp_path / "admin"
        token.write_text(ADMIN_TOKEN)
        assert run(port, "kill", "k", "--admin-token-file", str(token)) == EXIT_FALSE
        assert "--admin-token-file" in capsys.readouterr().err
    finally:
        stop_server(process)


def test_kill_with_no_server_cannot_tell(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token = tmp_path / "admin"
    token.write_text(ADMIN_TOKEN)
    assert run(closed_port(), "kill", "k", "--admin-token-file", str(token)) == EXIT_ERROR


class Lines:
    """The stdout of a child, line by line, with a timeout (a thread reads it)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        assert process.stdout is not None
        stdout = process.stdout

        def read() -> None:
            for line in stdout:
                self.queue.put(line.rstrip("\n"))
            self.queue.put(None)

        threading.Thread(target=read, daemon=True).start()

    def next(self, timeout: float = 10) -> str:
        line = self.queue.get(timeout=timeout)
        assert line is not None, "the stream ended"
        return line

    def event(self, timeout: float = 10) -> str:
        """The next line, its stamp checked and taken off."""
        stamp_text, _, event = self.next(timeout).partition(" ")
        assert STAMP.fullmatch(stamp_text), stamp_text
        return event


STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def watch_process(port: int, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "elockd.ctl", "--port", str(port), "watch", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_watch_prints_the_snapshot_then_each_event_and_ctrl_c_ends_it_quietly(
    server: tuple[int, Path],
) -> None:
    port, _ = server
    holder, other = named(port, "gina"), named(port, "hank")
    process = watch_process(port, "w/")
    try:
        token = holder.acquire("w/a").token
        lines = Lines(process)
        # Either the hold came before the watch (the snapshot) or after it (an event).
        first = lines.event()
        if first == "SYNCED":
            assert lines.event() == f"+ w/a exclusive gina token={token}"
        else:
            assert first == f"+ w/a exclusive gina token={token}"
            assert lines.event() == "SYNCED"
        other.acquire("elsewhere/x")  # outside the prefix: nothing
        hold = other.acquire("w/b")
        assert lines.event() == f"+ w/b exclusive hank token={hold.token}"
        other.release(hold)
        assert lines.event() == "- w/b exclusive hank released"
        other.acquire_shared("w/s")
        assert lines.event() == "+ w/s shared hank holders=1"
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == 0
        assert process.stderr is not None and process.stderr.read() == ""
    finally:
        process.kill()
        process.wait()
        holder.close()
        other.close()


def test_watch_shows_a_kill(server: tuple[int, Path]) -> None:
    port, admin = server
    holder = named(port, "ivan")
    process = watch_process(port, "wk/")
    try:
        lines = Lines(process)
        assert lines.event() == "SYNCED"
        token = holder.acquire("wk/a").token
        assert lines.event() == f"+ wk/a exclusive ivan token={token}"
        assert (
            ctl.main(["--port", str(port), "kill", "wk/a", "--admin-token-file", str(admin)]) == 0
        )
        assert lines.event() == "- wk/a exclusive ivan killed"
    finally:
        process.kill()
        process.wait()
        holder.close()


def test_watch_cannot_tell_when_the_server_goes() -> None:
    server_process, port = start_server()
    process = watch_process(port)
    try:
        lines = Lines(process)
        assert lines.event() == "SYNCED"
        stop_server(server_process)
        assert process.wait(10) == EXIT_ERROR
        assert process.stderr is not None
        assert "ended the watch: connection lost" in process.stderr.read()
    finally:
        process.kill()
        process.wait()
        stop_server(server_process)


def test_watch_exits_1_on_overflow() -> None:
    """A watcher stopped (SIGSTOP) while far more events than its buffer and every
    socket buffer between could hold happen gets OVERFLOW once it reads again."""
    server_process, port = start_server("--watch-buffer", "4096", "--max-line", "65536")
    process = watch_process(port, "big/")
    lines = Lines(process)
    client = BlockingClient(port=port)
    client.connect()
    try:
        assert lines.event() == "SYNCED"
        process.send_signal(signal.SIGSTOP)
        key = "big/" + "k" * 60000
        total = socket_buffers() * 2
        for _ in range(total // (2 * len(key)) + 1):
            client.release(client.acquire(key))
        process.send_signal(signal.SIGCONT)
        assert process.wait(20) == EXIT_FALSE
        assert process.stderr is not None
        err = process.stderr.read()
        assert "the server ended the watch: OVERFLOW" in err and len(err.splitlines()) == 1
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()
        client.close()
        stop_server(server_process)


def socket_buffers() -> int:
    """The most bytes the kernel can hold on one loopback connection, both ends."""
    most = 0
    for name in ("ipv4/tcp_rmem", "ipv4/tcp_wmem", "core/rmem_max", "core/wmem_max"):
        with open(f"/proc/sys/net/{name}") as file:
            most += int(file.read().split()[-1])
    return most


def test_top_once_shows_the_oldest_hold_and_a_waiting_queue(
    server: tuple[int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    port, _ = server
    reporter, young = named(port, "reporter"), named(port, "young")
    try:
        token = reporter.acquire("nightly/report").token
        eventually_blocking(
            lambda: json_rows(port, capsys, "nightly/")[0]["age"] >= 0.05, what="an older hold"
        )
        young.acquire("nightly/other")
        with waiting_on(port, "nightly/report", "waiter"):
            assert run(port, "top", "nightly/", "--once", "--interval", "0.2") == 0
        text = capsys.readouterr().out
        assert f"elockd 127.0.0.1:{port}   2 keys held, 1 waiting" in text
        oldest_pane = text.split("Oldest holds")[1].split("Longest queues")[0]
        queue_pane = text.split("Longest queues")[1].split("Requests per second")[0]
        assert oldest_pane.index("nightly/report") < oldest_pane.index("nightly/other")
        report = next(line for line in queue_pane.splitlines() if "nightly/report" in line)
        assert report.split()[1:3] == ["exclusive", "reporter"]
        assert report.split()[-3:] == [str(token), "-", "1"]
        assert "nightly/other" not in queue_pane
        assert re.search(r"all\s+\d+\.\d", text)
    finally:
        reporter.close()
        young.close()
