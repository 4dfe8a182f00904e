"""Where elockctl's options end: at ``lock``'s COMMAND, as in flock(1); global
options before or after the command; unknown options blamed by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elockd.ctl.args import build_parser, parse
from elockd.ctl.status import EXIT_USAGE


def parsed(*argv: str) -> dict[str, object]:
    return vars(parse(build_parser(), list(argv)))


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(build_parser(), list(argv))
    assert exited.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, key, command, shared",
    [
        # The command's own options are its own, wherever they look like ours.
        (["lock", "K", "cmd", "-s"], "K", ["cmd", "-s"], False),
        (["lock", "k", "echo", "-n", "hello"], "k", ["echo", "-n", "hello"], False),
        (
            ["lock", "K", "./job.sh", "-s", "-w", "5", "--", "x"],
            "K",
            ["./job.sh", "-s", "-w", "5", "--", "x"],
            False,
        ),
        # Ours before COMMAND, on either side of KEY, clustered as getopt allows.
        (["lock", "-s", "K", "cmd"], "K", ["cmd"], True),
        (["lock", "K", "-s", "cmd", "-x"], "K", ["cmd", "-x"], True),
        (["lock", "K", "-sw5", "cmd"], "K", ["cmd"], True),
        (["lock", "K", "--shared", "--", "-cmd"], "K", ["-cmd"], True),
        # -x, -e, --exclusive as flock; the last of -s and -x counts, as in flock.
        (["lock", "-s", "-x", "K", "cmd"], "K", ["cmd"], False),
        (["lock", "-x", "-s", "K", "cmd"], "K", ["cmd"], True),
        (["lock", "-e", "K", "cmd"], "K", ["cmd"], False),
        # A global option before COMMAND is elockctl's; after it, COMMAND's.
        (["lock", "K", "--port", "7", "cmd", "--port", "8"], "K", ["cmd", "--port", "8"], False),
    ],
)
def test_options_end_at_the_command(
    argv: list[str], key: str, command: list[str], shared: bool
) -> None:
    args = parsed(*argv)
    assert (args["key"], args["argv"], args["shared"]) == (key, command, shared)


def test_global_options_may_follow_the_command() -> None:
    assert parsed("i", "x", "--port", "9999")["port"] == 9999
    assert parsed("i", "x", "--port=9998")["port"] == 9998
    args = parsed("i", "two", "words", "--tim", "3")  # a unique prefix, as argparse
    assert (args["key"], args["timeout"]) == (["two", "words"], 3.0)
    args = parsed("lock", "K", "--host", "h", "-w", "2", "cmd")
    assert (args["host"], args["wait"], args["argv"]) == ("h", 2.0, ["cmd"])
    assert parsed("info", "k", "--json", "--port", "5")["port"] == 5
    assert parsed("--port", "5", "stats")["port"] == 5


def test_unknown_options_are_blamed_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--prot", "1", "i", "x")
    assert "unknown option --prot (did you mean --port?)" in err and "'1'" not in err
    assert "unknown option --prot (did you mean --port?)" in refused(
        capsys, "i", "x", "--prot", "1"
    )
    assert "unknown option -q" in refused(capsys, "lock", "K", "-q", "cmd")
    assert "did you mean --shared?" in refused(capsys, "lock", "K", "--sharde", "cmd")
    assert "unknown command 'lokc' (did you mean lock?)" in refused(capsys, "lokc", "K", "cmd")
    assert "ambiguous option --t" in refused(capsys, "--t", "1", "i", "x")
    # upgrade's flags are the new elockd's, after '--': not taken for elockctl's.
    err = refused(capsys, "upgrade", "/run/elockd.control", "--port", "1")
    assert "the new elockd's flags go after '--'" in err


def test_upgrade_flags_after_the_double_dash() -> None:
    args = parsed("upgrade", "/c", "--wait", "3", "--", "--port", "1", "-s")
    assert (args["control"], args["wait"], args["argv"]) == ("/c", 3.0, ["--port", "1", "-s"])


def test_a_probe_key_after_a_double_dash() -> None:
    assert parsed("i", "--", "-odd")["key"] == ["-odd"]


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["lock", "K", "-c", "true", "extra"], "not both (found extra)"),
        (["lock", "K"], "missing COMMAND"),
        (["lock", "K", "--"], "missing COMMAND"),
        (["lock", "K", "--limit", "2", "cmd"], "--limit needs --shared"),
    ],
)
def test_lock_mistakes(capsys: pytest.CaptureFixture[str], argv: list[str], complaint: str) -> None:
    assert complaint in refused(capsys, *argv)


def test_help_goes_to_the_command_it_follows() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elockd.ctl.main", "lock", "K", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: elockctl lock")
