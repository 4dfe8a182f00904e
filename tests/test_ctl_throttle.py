"""``elockctl throttle KEY COUNT/PERIOD COMMAND``: its command line, then against a
real server process (exit statuses, the 5/1s acceptance, ``-w``, ``--peek``)."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from elockd.ctl import main as ctl
from elockd.ctl.args import rate
from elockd.ctl.status import EXIT_ERROR, EXIT_FALSE, EXIT_USAGE
from elockd.daemon.server import make_service, serve
from elockd.protocol.config import Config
from tests.support.foreign_service import foreign_service, quorumless_answer
from tests.support.server_process import start_server, stop_server
from tests.test_ctl_argv import parsed, refused

# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100/1m", (100, 60.0)),
        ("5/1s", (5, 1.0)),
        ("10/60", (10, 60.0)),
        ("1000/h", (1000, 3600.0)),
        ("3/2h", (3, 7200.0)),
        ("50/0.5", (50, 0.5)),
        ("50/.5s", (50, 0.5)),
        ("7/1.5m", (7, 90.0)),
        ("1/m", (1, 60.0)),
    ],
)
def test_a_rate_is_count_per_period_with_a_unit(text: str, value: tuple[int, float]) -> None:
    assert rate(text) == value


@pytest.mark.parametrize(
    "text",
    ["", "5", "5/", "/1s", "0/1s", "5/0", "5/0s", "-5/1s", "5/-1", "5/1d", "5/1ms", "5.5/1s",
     "5/1 s", "5/1e3", "five/1s", "5/nan", "5/inf", "5/1s/2", " 5/1s"],
)  # fmt: skip
def test_a_bad_rate_is_a_usage_error_naming_the_argument(
    capsys: pytest.CaptureFixture[str], text: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        rate(text)
    err = refused(capsys, "throttle", "api", text, "--", "true")
    if text.startswith("-"):  # read as an option, as any word with a leading dash
        assert f"unknown option -5 (in {text})" in err
    else:
        assert err.startswith(f"elockctl throttle: argument COUNT/PERIOD: '{text}' is not a rate")


@pytest.mark.parametrize(
    ("argv", "key", "command", "wait", "cost", "burst"),
    [
        (["throttle", "api", "5/1s", "--", "true"], "api", ["true"], 0.0, 1, None),
        (["throttle", "api", "5/1s", "true", "-w", "5"], "api", ["true", "-w", "5"], 0.0, 1, None),
        (["throttle", "-w", "5", "api", "5/1s", "true"], "api", ["true"], 5.0, 1, None),
        (["throttle", "api", "-w5", "5/1s", "cmd"], "api", ["cmd"], 5.0, 1, None),
        (
            ["throttle", "api", "100/1m", "--burst", "10", "--cost", "3", "--", "-cmd"],
            "api",
            ["-cmd"],
            0.0,
            3,
            10,
        ),
        (["--port", "7", "throttle", "k", "1/1h", "x", "--port", "8"], "k", ["x", "--port", "8"],
         0.0, 1, None),
    ],
)  # fmt: skip
def test_options_end_at_command(
    argv: list[str],
    key: str,
    command: list[str],
    wait: float,
    cost: int,
    burst: int | None,
) -> None:
    args = parsed(*argv)
    assert (args["key"], args["argv"], args["wait"], args["cost"], args["burst"]) == (
        key,
        command,
        wait,
        cost,
        burst,
    )


def test_peek_asks_at_cost_zero_and_runs_nothing() -> None:
    args = parsed("throttle", "api", "5/1s", "--peek")
    assert (args["peek"], args["cost"], args["argv"], args["rate"]) == (True, 0, [], (5, 1.0))
    assert parsed("throttle", "api", "5/1s", "--peek", "--json")["json"] is True


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["throttle", "api", "5/1s"], "missing COMMAND"),
        (["throttle", "api", "5/1s", "--"], "missing COMMAND"),
        (["throttle", "api"], "the following arguments are required: COUNT/PERIOD"),
        (["throttle", "api", "5/1s", "--peek", "--", "true"], "--peek runs no COMMAND"),
        (["throttle", "api", "5/1s", "--peek", "-w", "3"], "--peek does not wait"),
        (["throttle", "api", "5/1s", "--peek", "--cost", "2"], "--peek asks at cost 0"),
        (["throttle", "api", "5/1s", "--json", "true"], "--json goes with --peek"),
        (["throttle", "api", "5/1s", "--cost", "0", "true"], "argument --cost: '0'"),
        (["throttle", "api", "5/1s", "--burst", "0", "true"], "argument --burst: '0'"),
        (["throttle", "api", "5/1s", "-w", "soon", "true"], "argument -w/--wait: 'soon'"),
        (["throttle", "two words", "5/1s", "true"], "key 'two words' cannot be sent"),
        (["throttle", "api", "5/1s", "--brust", "2", "true"], "did you mean --burst?"),
    ],
)
def test_throttle_mistakes(
    capsys: pytest.CaptureFixture[str], argv: list[str], complaint: str
) -> None:
    assert complaint in refused(capsys, *argv)


def test_help_names_the_exit_statuses() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elockd.ctl.main", "throttle", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: elockctl throttle")
    assert "limited: not admitted at once, or within -w" in result.stdout


# ---------------------------------------------------------------- against a port


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound and not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_closed_port_cannot_tell(
    closed_port: int, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    argv = ["--port", str(closed_port), "throttle", "api", "5/1s", "--", "touch", str(ran)]
    assert ctl.main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err == f"elockctl: cannot connect to 127.0.0.1:{closed_port}: Connection refused\n"
    assert not ran.exists()
    assert ctl.main(["--port", str(closed_port), "throttle", "api", "5/1s", "--peek"]) == EXIT_ERROR
    assert capsys.readouterr().out == ""


def test_a_quorumless_node_cannot_tell(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``409 Backend Unavailable`` is no "limited": nobody knows the rate."""
    ran = tmp_path / "ran"
    with foreign_service(b"", quorumless_answer) as port:
        status = ctl.main(["--port", str(port), "throttle", "api", "5/1s", "touch", str(ran)])
    assert status == EXIT_ERROR and not ran.exists()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"elockctl: 127.0.0.1:{port}: throttle: 409 Backend Unavailable\n")


# ---------------------------------------------------------------- a server whose clock stands still


@contextlib.contextmanager
def still_server(**settings: Any) -> Iterator[int]:
    """An in-memory server in a thread of its own, on a clock that never moves
    (``MockClock`` at rate 0): the runs of a loop all reach it at the same instant,
    however slow this machine is, so a count is exact. Yields the port."""
    ports: queue.Queue[int] = queue.Queue()
    stop = threading.Event()

    async def serve_until_stopped() -> None:
        config = Config(host="127.0.0.1", port=0, metrics_port=0, **settings)
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(serve, config, make_service(config))
            ports.put(next(a[1] for a in addresses if isinstance(a, tuple)))
            while not stop.is_set():  # the clock stands still: poll by checkpoints
                await trio.lowlevel.checkpoint()
                await trio.to_thread.run_sync(stop.wait, 0.05)
            nursery.cancel_scope.cancel()

    thread = threading.Thread(
        target=trio.run, args=(serve_until_stopped,), kwargs={"clock": trio.testing.MockClock()}
    )
    thread.start()
    try:
        yield ports.get(timeout=30)
    finally:
        stop.set()
        thread.join(30)


def test_five_per_second_admits_five_of_twenty(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The acceptance: ``elockctl throttle api 5/1s -- COMMAND`` run 20 times in a
    loop: 5 pass at once and run COMMAND, the rest exit 1 with one line each."""
    ran = tmp_path / "ran"
    append = ["sh", "-c", f"echo ran >> {ran}"]
    with still_server() as port:
        statuses = [
            ctl.main(["--port", str(port), "throttle", "api", "5/1s", "--", *append])
            for _ in range(20)
        ]
    assert statuses == [0] * 5 + [EXIT_FALSE] * 15
    assert ran.read_text() == "ran\n" * 5
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err.splitlines() == ["elockctl: throttle 'api': limited, retry after 0.200 s"] * 15
    )


def test_command_status_and_peek(capsys: pytest.CaptureFixture[str]) -> None:
    with still_server() as port:
        assert ctl.main(["--port", str(port), "throttle", "k", "5/1s", "sh", "-c", "exit 7"]) == 7
        assert ctl.main(["--port", str(port), "throttle", "k", "5/1s", "--cost", "2", "true"]) == 0
        assert ctl.main(["--port", str(port), "throttle", "k", "5/1s", "--peek"]) == 0
        assert capsys.readouterr().out == (
            "admitted: yes\nlimit: 5\nremaining: 2\nretry_after: 0.000\nreset_after: 0.600\n"
        )
        assert ctl.main(["--port", str(port), "throttle", "k", "5/1s", "--peek", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {
            "admitted": True,
            "limit": 5,
            "remaining": 2,
            "retry_after": 0.0,
            "reset_after": 0.6,
        }
        # A peek at a rate whose burst the key's TAT (0.6 s ahead) already passed:
        # not admitted, and still exit 0 (it printed what it was asked).
        assert ctl.main(["--port", str(port), "throttle", "k", "1/0.5s", "--peek"]) == 0
        assert capsys.readouterr().out == (
            "admitted: no\nlimit: 1\nremaining: 0\nretry_after: 0.100\nreset_after: 0.600\n"
        )


def test_server_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    with still_server(max_throttles=1) as port:
        door = ["--port", str(port), "throttle"]
        assert ctl.main([*door, "k", "5/1s", "--cost", "6", "true"]) == EXIT_USAGE
        assert capsys.readouterr().err == (
            f"elockctl: 127.0.0.1:{port}: throttle: 400 Bad Request: cost above burst\n"
        )
        assert ctl.main([*door, "k", "5/1s", "true"]) == 0
        assert ctl.main([*door, "other", "5/1s", "true"]) == EXIT_ERROR
        assert capsys.readouterr().err == (
            f"elockctl: 127.0.0.1:{port}: throttle: 413 Too Many Throttles\n"
        )


# ---------------------------------------------------------------- real time


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    process, port = start_server()
    yield port
    stop_server(process)


@pytest.mark.serial
def test_waiting_runs_pass_spaced_at_the_rate(port: int) -> None:
    """With ``-w 5`` all 20 runs of a loop pass: 5 at once, then one every 200 ms,
    each waiting its turn in the server's line."""
    done: list[float] = []
    start = time.monotonic()
    for _ in range(20):
        status = ctl.main(["--port", str(port), "throttle", "-w", "5", "spaced", "5/1s", "true"])
        assert status == 0
        done.append(time.monotonic())
    elapsed = done[-1] - start
    assert 2.95 <= elapsed <= 5.5, elapsed
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(done[5:]))
    assert 0.15 <= gaps[len(gaps) // 2] <= 0.3, gaps  # the median: about 200 ms


# ---------------------------------------------------------------- as a process, from a shell


#: What a one-shot elockctl must not import: each is a share of its start-up, paid
#: on every run of a loop (trio and rich alone were over half of it).
HEAVY_MODULES = ("trio", "rich", "wsproto", "importlib.metadata")


@pytest.mark.parametrize(
    "argv",
    [
        ["throttle", "api", "5/1s", "--", "true"],
        ["throttle", "api", "5/1s", "--peek"],
        ["g", "k"],
        ["q"],
        ["stats"],
        ["info", "k"],
    ],
)
def test_one_shot_commands_start_without_the_heavy_modules(port: int, argv: list[str]) -> None:
    probe = (
        "import sys\n"
        "from elockd.ctl import main\n"
        f"status = main.main(['--port', '{port}', *{argv!r}])\n"
        f"print(status, [m for m in {HEAVY_MODULES!r} if m in sys.modules])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.stdout.splitlines()[-1].split(" ", 1)[1] == "[]", result
    # …and the commands that need them still find them.
    assert int(result.stdout.splitlines()[-1].split(" ", 1)[0]) in (0, EXIT_FALSE), result


def test_a_signal_to_elockctl_reaches_the_throttled_command(port: int) -> None:
    """Outside a terminal (cron, ``kill PID``) only elockctl gets the signal; it passes
    it on, and COMMAND's own exit status is elockctl's."""
    script = 'trap "exit 42" TERM; echo ready; while :; do sleep 0.05; done'
    process = subprocess.Popen(
        [sys.executable, "-m", "elockd.ctl", "--port", str(port), "throttle", "sig", "5/1s",
         "--", "sh", "-c", script],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 42
    finally:
        process.kill()
        process.wait()


def test_a_command_ended_by_a_signal_exits_as_a_shell_reports_it(port: int) -> None:
    status = ctl.main(["--port", str(port), "throttle", "killed", "5/1s", "sh", "-c", "kill -9 $$"])
    assert status == 128 + signal.SIGKILL
