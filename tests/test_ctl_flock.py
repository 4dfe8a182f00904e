"""``elockctl lock KEY`` side by side with util-linux ``flock FILE``.

The same commands run under both, with the lock free, held exclusively or shared
by someone else: exit status, stdout and stderr must match wherever flock defines
them (flock's name in its messages read as elockctl's, the seconds of ``--verbose``
masked). Where elockctl differs on purpose (it does not wait without ``-w``; its
own statuses 2, 3, 75, 126/127 instead of sysexits) it is documented in
docs/client.md, and not compared here.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elockd.client import BlockingClient
from tests.support.polling import eventually_blocking
from tests.support.server_process import start_server, stop_server

FLOCK = shutil.which("flock")
names = itertools.count()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    assert FLOCK is not None, "util-linux flock(1) is needed (Debian: util-linux)"
    process, port = start_server()
    yield port
    stop_server(process)


def default_signal_actions() -> None:
    """In the child before exec: the signals these tests send get their default
    action. An ignored signal stays ignored across exec, so a suite started under
    ``nohup`` (SIGHUP ignored) would hand that to both tools, and neither would
    end on it, rightly."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@dataclass
class Door:
    """One tool, one lock: a file for flock, a key for elockctl."""

    tool: str
    port: int
    path: Path
    key: str

    def argv(self, options: list[str], command: list[str]) -> list[str]:
        if self.tool == "flock":
            assert FLOCK is not None
            return [FLOCK, *options, str(self.path), *command]
        ctl = [sys.executable, "-m", "elockd.ctl.main", "--port", str(self.port), "lock"]
        return [*ctl, *options, self.key, *command]

    def run(self, options: list[str], command: list[str]) -> tuple[int, str, str]:
        result = subprocess.run(
            self.argv(options, command), capture_output=True, text=True, timeout=60
        )
        return result.returncode, normalized(result.stdout), normalized(result.stderr)

    def start(
        self, options: list[str], command: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(options, command),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=default_signal_actions,
        )

    @contextlib.contextmanager
    def held(self, shared: bool = False) -> Iterator[None]:
        """Someone else holds the lock (exclusively, or one shared hold)."""
        if self.tool == "flock":
            with open(self.path, "a") as file:
                fcntl.flock(file, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                yield
            return
        with (
            BlockingClient(port=self.port) as holder,
            holder.shared(self.key) if shared else holder.lock(self.key),
        ):
            yield

    def until_waiting(self, process: subprocess.Popen[str]) -> None:
        """Until ``process`` waits for the lock (a blocked request in /proc/locks for
        flock; a waiter on the server for elockctl)."""

        def waits() -> bool:
            assert process.poll() is None, process.communicate()
            if self.tool == "flock":
                locks = Path("/proc/locks").read_text()
                return re.search(rf"-> FLOCK\s+ADVISORY\s+\w+\s+{process.pid}\s", locks) is not None
            with BlockingClient(port=self.port) as client:
                return client.info(self.key).waiting >= 1

        eventually_blocking(waits, timeout=20, interval=0.02, what=f"{self.tool} waiting")


def normalized(output: str) -> str:
    text = re.sub(r"(flock|elockctl): ", "TOOL: ", output)
    return re.sub(r"took [0-9.]+ seconds", "took N seconds", text)


@pytest.fixture
def doors(port: int, tmp_path: Path) -> list[Door]:
    name = f"flock-side-{next(names)}"
    return [Door(tool, port, tmp_path / f"{name}.lock", name) for tool in ("flock", "elockctl")]


def same(
    doors: list[Door], options: list[str], command: list[str], held: str | None = None
) -> tuple[int, str, str]:
    """Run under both tools, with the lock held by someone else when ``held`` says
    so (``"exclusive"`` or ``"shared"``); the outcomes must be equal. Returns it."""
    outcomes = []
    for door in doors:
        holding = door.held(held == "shared") if held else contextlib.nullcontext()
        with holding:
            outcomes.append(door.run(options, command))
    assert outcomes[0] == outcomes[1], f"flock {outcomes[0]} != elockctl {outcomes[1]}"
    return outcomes[0]


# ---------------------------------------------------------------- the command's own


def test_the_commands_exit_status(doors: list[Door]) -> None:
    assert same(doors, [], ["sh", "-c", "exit 7"])[0] == 7
    assert same(doors, [], ["true"]) == (0, "", "")
    assert same(doors, [], ["sh", "-c", "kill -TERM $$"])[0] == 128 + signal.SIGTERM
    assert same(doors, ["-x"], ["sh", "-c", "exit 3"])[0] == 3


def test_the_commands_own_options_are_its_own(doors: list[Door]) -> None:
    assert same(doors, [], ["echo", "-n", "hello"]) == (0, "hello", "")
    words = ["-s", "-x", "-n", "-w", "5", "-E", "9", "-c", "x", "--", "--port", "1"]
    outcome = same(doors, [], ["printf", "%s|", *words])
    assert outcome == (0, "|".join(words) + "|", "")


def test_a_shell_command(doors: list[Door]) -> None:
    outcome = same(doors, [], ["-c", 'echo "a  b" "$((6 * 7))"; exit 3'])
    assert outcome == (3, "a  b 42\n", "")


def test_verbose_says_what_flock_says(doors: list[Door]) -> None:
    # On stdout, as flock prints them. The order is not compared: flock's lines sit
    # in its stdio buffer until it exits (after the command's "x" on a pipe),
    # elockctl's are flushed before the command starts.
    outcomes = [door.run(["--verbose"], ["echo", "-n", "x"]) for door in doors]
    told = [
        (code, sorted(re.findall(r"TOOL: .*\n", out)), re.sub(r"TOOL: .*\n", "", out), err)
        for code, out, err in outcomes
    ]
    assert told[0] == told[1], outcomes
    assert told[0] == (
        0,
        ["TOOL: executing echo\n", "TOOL: getting lock took N seconds\n"],
        "x",
        "",
    )


# ---------------------------------------------------------------- not granted


@pytest.mark.parametrize(
    "options, status",
    [
        (["-n"], 1),
        (["--nonblock"], 1),
        (["-n", "-E", "9"], 9),
        (["--conflict-exit-code", "0", "-n"], 0),
        (["-w", "0.3"], 1),
        (["-w", "0.3", "-E", "42"], 42),
        (["-w", "0"], 1),
        (["-x", "-n"], 1),
        (["-s", "-n"], 1),  # shared refused while someone holds it exclusively
    ],
)
def test_not_granted_is_silent_with_the_conflict_status(
    doors: list[Door], options: list[str], status: int, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    assert same(doors, options, ["touch", str(ran)], held="exclusive") == (status, "", "")
    assert not ran.exists(), "COMMAND ran without the lock"


def test_verbose_says_why_not(doors: list[Door]) -> None:
    assert same(doors, ["--verbose", "-n"], ["true"], held="exclusive") == (
        1,
        "",
        "TOOL: failed to get lock\n",
    )
    assert same(doors, ["--verbose", "-w", "0.2"], ["true"], held="exclusive") == (
        1,
        "",
        "TOOL: timeout while waiting to get lock\n",
    )


def test_shared_and_exclusive(doors: list[Door]) -> None:
    assert same(doors, ["-s", "-n"], ["echo", "ok"], held="shared") == (0, "ok\n", "")
    assert same(doors, ["-n"], ["echo", "ok"], held="shared") == (1, "", "")
    assert same(doors, ["-x", "-n"], ["echo", "ok"], held="shared") == (1, "", "")
    assert same(doors, ["-e", "-n"], ["echo", "ok"], held="shared") == (1, "", "")
    # The last of -s and -x counts.
    assert same(doors, ["-x", "-s", "-n"], ["echo", "ok"], held="shared") == (0, "ok\n", "")
    assert same(doors, ["-s", "-x", "-n"], ["echo", "ok"], held="shared") == (1, "", "")


# ---------------------------------------------------------------- waiting


def test_a_waiter_runs_once_the_lock_is_free(doors: list[Door]) -> None:
    for door in doors:
        with door.held():
            waiter = door.start(["-w", "30"], ["echo", "ran"])
            door.until_waiting(waiter)
            assert waiter.poll() is None, f"{door.tool} ran while the lock was held"
        out, err = waiter.communicate(timeout=30)
        assert (waiter.returncode, out, err) == (0, "ran\n", ""), door.tool


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_ends_the_waiter_as_it_ends_flock(
    doors: list[Door], signum: signal.Signals, tmp_path: Path
) -> None:
    """Killed by the signal (not an exit status): a shell loop around it stops, as
    it does around flock. COMMAND never runs, and nothing is left waiting."""
    ran = tmp_path / "ran"
    statuses = []
    for door in doors:
        with door.held():
            waiter = door.start(["-w", "30"], ["touch", str(ran)])
            door.until_waiting(waiter)
            waiter.send_signal(signum)
            _, err = waiter.communicate(timeout=30)
            statuses.append((waiter.returncode, normalized(err)))
        assert not ran.exists(), door.tool
        # Free for the next taker at once: the dead waiter left nothing behind.
        assert door.run(["-n"], ["true"]) == (0, "", ""), door.tool
    assert statuses[0] == statuses[1] == (-signum, ""), statuses


# ---------------------------------------------------------------- a guarded job

JOB = """\
#!/bin/sh
# Records its arguments and when it starts and ends.
echo "start $$ $*" >> "$JOB_LOG"
sleep 0.3
echo "end $$ $*" >> "$JOB_LOG"
"""


def script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def logged_runs(door: Door, log: Path, runs: list[tuple[list[str], list[str]]]) -> list[list[str]]:
    """Start every (options, command) at once under ``door``, with ``$JOB_LOG`` set
    to ``log``; each must exit 0 silently. Returns the log's lines, split."""
    env = {**os.environ, "JOB_LOG": str(log)}
    started = [door.start(options, command, env) for options, command in runs]
    for run in started:
        out, err = run.communicate(timeout=90)
        assert (run.returncode, out, err) == (0, "", ""), door.tool
    return [line.split() for line in log.read_text().splitlines()]


def test_two_guarded_jobs_never_overlap(doors: list[Door], tmp_path: Path) -> None:
    """``elockctl lock K ./job.sh -s`` runs ``./job.sh -s`` under an exclusive lock
    (the -s is the job's): two at once run one after the other, as under flock."""
    job = script(tmp_path / "job.sh", JOB)
    for door in doors:
        runs = [(["-w", "30"], [str(job), "-s"])] * 2
        events = logged_runs(door, tmp_path / f"{door.tool}.log", runs)
        assert [event[0] for event in events] == [
            "start",
            "end",
            "start",
            "end",
        ], f"two jobs overlapped under {door.tool}: {events}"
        assert events[0][1] == events[1][1] and events[2][1] == events[3][1]
        assert all(event[2:] == ["-s"] for event in events), "the job lost its -s"


def test_the_job_script_is_run_from_the_current_directory(
    doors: list[Door], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``./job.sh`` is found where the caller stands, as flock finds it."""
    script(tmp_path / "job.sh", '#!/bin/sh\necho "job $*"\n')
    monkeypatch.chdir(tmp_path)
    assert same(doors, [], ["./job.sh", "-s", "x"]) == (0, "job -s x\n", "")


READER_OR_WRITER = """\
#!/bin/sh
echo "start $1 $$" >> "$JOB_LOG"
sleep 0.2
echo "end $1 $$" >> "$JOB_LOG"
"""


def test_readers_and_writers_at_once(doors: list[Door], tmp_path: Path) -> None:
    """Three readers (-s) and two writers (-x) started together: a writer is never
    in with anyone, under elockctl as under flock; readers may be in together."""
    job = script(tmp_path / "rw.sh", READER_OR_WRITER)
    modes = [("-s", "r"), ("-x", "w"), ("-s", "r"), ("-x", "w"), ("-s", "r")]
    for door in doors:
        runs = [(["-w", "60", mode], [str(job), role]) for mode, role in modes]
        events = logged_runs(door, tmp_path / f"{door.tool}-rw.log", runs)
        inside: dict[str, str] = {}
        for event, role, pid in events:
            if event == "start":
                assert "w" not in inside.values(), f"{door.tool}: in beside a writer"
                assert role == "r" or not inside, f"{door.tool}: a writer beside {inside}"
                inside[pid] = role
            else:
                del inside[pid]
        assert len(events) == 10
