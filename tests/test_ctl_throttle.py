"""``elockctl throttle KEY COUNT/PERIOD COMMAND``: its command line, then against a
real server process (exit statuses, the 5/1s acceptance, ``-w``, ``--peek``)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elockd.ctl import main as ctl
from elockd.ctl.args import rate
from elockd.ctl.status import EXIT_ERROR, EXIT_FALSE
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


_ = (json, EXIT_FALSE)
