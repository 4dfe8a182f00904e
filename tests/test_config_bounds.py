"""Settings that cannot crash the server later (issue 24, C1/C2/E6).

Every bad configuration, from the file, the environment or the flags, is refused at
start with one line of at most 300 characters and exit status 2, never a
traceback: a generated set in process (:func:`elockd.daemon.main.main`, the same code the
command runs, with the server itself replaced by a trap that fails the test if a
bad configuration gets that far), and a sample of each kind through the real
command. The kernel's bounds are checked against the kernel.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elockd.daemon import main as cli
from elockd.daemon.bounds import (
    MAX_KEEPALIVE,
    MAX_TCP_KEEPCNT,
    MAX_TCP_KEEPIDLE,
    MAX_TCP_KEEPINTVL,
)
from elockd.daemon.server import keepalive_settings, tune_accepted
from elockd.net.unix_socket import UNIX_PATH_MAX
from tests.support.server_process import start_server, stop_server

# ------------------------------------------------------------ what is bad

NUMBER_KEYS = {
    "port": ["65536", "-1", "99999999999999999999"],
    "metrics_port": ["70000", "1.5"],
    "keepalive": ["65536", "70000", "1e9", "-0.5", "inf", "nan"],
    "max_connections": ["0", "1e3", "9" * 30, "9" * 5000],
    "max_line": ["-4096", "4096.0", "0x10"],
    "max_ttl": ["0", "1e400", "9e9999", "1e300", "-inf"],
    "send_timeout": ["0", "nan", "10000000000"],
    "grace": ["-1", "1e12"],
    "session_ttl": ["1", "9000000001"],
    "etcd_in_flight": ["0", "many"],
    "throttle_line_grace": ["0", "-1", "nan", "5", "7.5"],
    "unix_mode": ["999", "1000", "rw-", "-1", "0o1777"],
}
TEXT_KEYS = ["host", "metrics_host", "unix", "auth_token_file", "tls_cert", "etcd_prefix"]
NUL_TEXTS = ["a\0b", "\0", "127.0.0.1\0evil.example"]
BAD_HOSTS = ["a" * 64, "a..b", "x" * 64 + ".example", " "]
LONG_UNIX_PATH = "/tmp/" + "s" * (UNIX_PATH_MAX - 4)  # one byte too many
CHOICE_KEYS = {"replies": ["nope"], "log_level": ["loud"], "log_format": ["xml"]}


def bad_settings() -> st.SearchStrategy[tuple[str, str]]:
    """(key, text) pairs that no source may let through."""
    numbers = [(key, text) for key, texts in NUMBER_KEYS.items() for text in texts]
    texts = [(key, text) for key in TEXT_KEYS for text in NUL_TEXTS]
    hosts = [(key, text) for key in ("host", "metrics_host") for text in BAD_HOSTS]
    choices = [(key, text) for key, texts in CHOICE_KEYS.items() for text in texts]
    fixed = st.sampled_from(
        [*numbers, *texts, *hosts, *choices, ("unix", LONG_UNIX_PATH), ("etcd", "ftp://x")]
    )
    huge = st.integers(min_value=20, max_value=5000).map(lambda n: ("max_holds", "9" * n))
    nul_anywhere = st.tuples(st.sampled_from(TEXT_KEYS), st.text(max_size=30), st.text(max_size=30))
    with_nul = nul_anywhere.map(lambda parts: (parts[0], parts[1] + "\0" + parts[2]))
    return st.one_of(fixed, huge, with_nul)


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (control characters as \\uXXXX)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


#: Whole files that are not a configuration at all.
BAD_FILES: dict[str, bytes] = {
    "deep array": b"port = " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "deep inline table": b"port = " + b"{a = " * 3000 + b"1" + b"}" * 3000 + b"\n",
    "deep table header": b"[" + b".".join([b"a"] * 3000) + b"]\n",
    "latin-1": 'host = "h\xf4te"\n'.encode("latin-1"),
    "utf-16": "port = 1\n".encode("utf-16"),
    "binary": bytes(range(256)),
    "NUL byte": b"port = 1\0\n",
    "boolean": b"port = true\n",
    "table": b"[port]\nx = 1\n",
    "date": b"max_ttl = 1979-05-27\n",
    "array of numbers": b"port = [1, 2]\n",
    "array for a host": b'host = ["a", "b"]\n',
    "integer mode": b"unix_mode = 0o660\n",
    "float port": b"port = 1.5\n",
    "nan": b"max_ttl = nan\n",
    "unknown long key": b"x" * 10_000 + b" = 1\n",
    "unknown key": b"prot = 1\n",
}


# ------------------------------------------------------------ in process


class Started(BaseException):
    """Raised by the trap in place of the server: a bad configuration got through.
    A BaseException, so that nothing in main() can turn it into an exit status."""


@contextlib.contextmanager
def trapped() -> Iterator[io.StringIO]:
    """The server replaced by :class:`Started`, and stderr captured."""

    def trap(*args: object) -> None:
        raise Started(args)

    err = io.StringIO()
    with (
        mock.patch.object(cli, "trio", SimpleNamespace(run=trap)),
        contextlib.redirect_stderr(err),
    ):
        yield err


def refused_in_process(argv: list[str], environ: dict[str, str] | None = None) -> str:
    """The one line main() prints for a configuration it must refuse."""
    with trapped() as err, pytest.raises(SystemExit) as exited:
        cli.main(argv, environ or {})
    assert exited.value.code == 2, err.getvalue()
    return one_line_of(err.getvalue())


def one_line_of(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr[:2000]
    assert len(lines[0]) <= 300, lines[0]
    assert lines[0].startswith("elockd: ")
    assert "Traceback" not in stderr
    return lines[0]


def argv_and_environ(source: str, key: str, text: str, folder: str) -> tuple[list[str], dict]:
    """One bad setting given through ``source``."""
    if source == "flag":
        return ["--" + key.replace("_", "-"), text], {}
    if source == "environment":
        return [], {"ELOCKD_" + key.upper(): text}
    path = os.path.join(folder, "elockd.toml")
    with open(path, "w", encoding="utf-8") as file:
        file.write(f"{key} = {toml_string(text)}\n")
    return ["--config", path], {}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=bad_settings(), source=st.sampled_from(["flag", "environment", "file"]))
def test_every_bad_setting_from_every_source_is_one_line_and_exit_2(
    bad: tuple[str, str], source: str
) -> None:
    key, text = bad
    with tempfile.TemporaryDirectory() as folder:
        argv, environ = argv_and_environ(source, key, text, folder)
        line = refused_in_process(argv, environ)
    named = {"flag": "--" + key.replace("_", "-"), "environment": "ELOCKD_", "file": "--config"}
    assert named[source] in line, line
    assert "\0" not in line


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_every_bad_file_is_one_line_and_exit_2(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "elockd.toml"
    path.write_bytes(BAD_FILES[kind])
    line = refused_in_process(["--config", str(path)])
    assert line.startswith(f"elockd: --config {path}"), line


def test_bad_config_file_paths_are_one_line(tmp_path: Path) -> None:
    assert "Is a directory" in refused_in_process(["--config", str(tmp_path)])
    assert "No such file" in refused_in_process([], {"ELOCKD_CONFIG": str(tmp_path / "x")})
    line = refused_in_process([], {"ELOCKD_CONFIG": "a\0b"})
    assert line.startswith("elockd: ELOCKD_CONFIG: a file name without NUL")


@pytest.mark.parametrize(
    "error",
    [RecursionError("deep"), UnicodeError("label too long"), ValueError("x" * 100_000)],
    ids=["RecursionError", "UnicodeError", "ValueError"],
)
def test_anything_else_that_fails_before_listening_is_one_line_and_exit_2(
    error: Exception,
) -> None:
    """The whole class, not the examples: whatever escapes start-up before the
    server listens (here injected into the server's start) is one line."""

    async def fails(*args: object) -> None:
        raise ExceptionGroup("start", [error])

    err = io.StringIO()
    with (
        mock.patch.object(cli, "run_until_signal", fails),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as exited,
    ):
        cli.main(["--port", "0", "--metrics-port", "0"])
    assert exited.value.code == 2
    line = one_line_of(err.getvalue())
    assert line.startswith(f"elockd: cannot start: {type(error).__name__}: ")


def test_reading_the_settings_cannot_raise_past_main() -> None:
    with mock.patch.object(cli, "load_config", side_effect=MemoryError("file")):
        line = refused_in_process([])
    assert line == "elockd: cannot read the settings: MemoryError: file"


# ------------------------------------------------------------ the real command


def elockd(*args: str | bytes, env: dict | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def test_a_sample_of_each_kind_through_the_real_command(tmp_path: Path) -> None:
    """Started all at once, so that two dozen interpreters cost about two seconds."""
    base = {key: value for key, value in os.environ.items() if not key.startswith("ELOCKD_")}
    huge = tmp_path / "huge.toml"
    with open(huge, "w") as file:  # a 50 MB value was once echoed into 52 MB of stderr
        file.write('host = "' + "h" * 5_000_000 + '"\n')
    cases: dict[str, tuple[list[str | bytes], dict[str | bytes, str | bytes]]] = {
        "keepalive flag": (["--keepalive", "70000"], {}),
        "keepalive variable": ([], {"ELOCKD_KEEPALIVE": "70000"}),
        "huge count": (["--max-holds", "9" * 100_000], {}),
        "long host": (["--host", "a" * 64], {}),
        "non-ASCII bytes host": ([b"--host", b"h\xffst"], {}),
        "non-ASCII bytes variable": ([], {b"ELOCKD_ETCD_PREFIX": b"/\xff/"}),
        "long unix path": (["--unix", LONG_UNIX_PATH], {}),
        "bad mode": (["--unix-mode", "8"], {}),
        "unknown flag": (["--" + "x" * 100_000], {}),
        "bad choice": (["--replies", "y" * 100_000], {}),
        "tls cert without key": (["--tls-cert", str(write(tmp_path / "c.pem", b"x"))], {}),
        "huge value": (["--config", str(huge)], {}),
    }
    for kind in ("deep array", "latin-1", "NUL byte", "boolean", "unknown long key"):
        cases[f"file: {kind}"] = (["--config", str(write(tmp_path / kind, BAD_FILES[kind]))], {})
    for key in ("unix", "auth_token_file", "host"):
        path = write(tmp_path / f"nul-{key}.toml", f'{key} = "a\\u0000b"\n'.encode())
        cases[f"NUL in {key}"] = (["--config", str(path)], {})
    started = time.monotonic()
    processes = {
        name: elockd(*args, env={**base, **extra}) for name, (args, extra) in cases.items()
    }
    try:
        for name, process in processes.items():
            _, stderr = process.communicate(timeout=60)
            text = stderr.decode(errors="replace")
            assert process.returncode == 2, (name, text[:500])
            one_line_of(text)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    print(f"{len(cases)} cases in {time.monotonic() - started:.1f} s")


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def test_a_successor_refuses_what_the_running_server_would_refuse(tmp_path: Path) -> None:
    """Before, a successor with --keepalive 70000 took every lock over and then
    crashed on its next connection. Now it exits 2 before it asks for anything,
    and the old process serves on with its locks."""
    control = str(tmp_path / "control.sock")
    old, port = start_server("--control-socket", control)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as holder:
            holder.sendall(b"g kept\n")
            assert holder.recv(100) == b"1 Got Lock\r\n"
            successor = subprocess.run(
                [sys.executable, "-m", "elockd", "--take-over", control, "--keepalive", "70000"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert successor.returncode == 2
            assert successor.stderr.startswith("elockd: argument --keepalive: ")
            assert old.poll() is None
            holder.sendall(b"i kept\n")
            assert holder.recv(100) == b"1 Locked\r\n"
    finally:
        old.send_signal(signal.SIGTERM)
        old.wait(timeout=10)
        stop_server(old)


# ------------------------------------------------------------ the kernel's bounds


def test_the_keepalive_bounds_are_the_kernels() -> None:
    """The constants are Linux's: one more is refused by the kernel itself."""
    with socket.socket() as sock:
        for option, most in (
            (socket.TCP_KEEPIDLE, MAX_TCP_KEEPIDLE),
            (socket.TCP_KEEPINTVL, MAX_TCP_KEEPINTVL),
            (socket.TCP_KEEPCNT, MAX_TCP_KEEPCNT),
        ):
            sock.setsockopt(socket.IPPROTO_TCP, option, most)
            with pytest.raises(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, most + 1)


@pytest.mark.parametrize("seconds", [0.5, 1, 2, 7.5, 30, 3600, 65534.9, MAX_KEEPALIVE])
def test_every_allowed_keepalive_is_taken_by_the_kernel(seconds: float) -> None:
    idle, interval, count = keepalive_settings(seconds)
    assert (idle, interval, count) <= (MAX_TCP_KEEPIDLE, MAX_TCP_KEEPINTVL, MAX_TCP_KEEPCNT)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        with client, accepted:
            tune_accepted(accepted, seconds)
    assert keepalive_settings(MAX_KEEPALIVE + 1)[0] > MAX_TCP_KEEPIDLE, "the bound is tight"


def test_the_unix_path_bound_is_the_kernels(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    room = UNIX_PATH_MAX - len(os.fsencode(folder)) - 1
    for size, fits in ((room, True), (room + 1, False)):
        path = str(folder / ("s" * size))
        with socket.socket(socket.AF_UNIX) as sock:
            if fits:
                sock.bind(path)
            else:
                with pytest.raises(OSError):
                    sock.bind(path)


@pytest.mark.parametrize(
    ("argv", "environ", "named"),
    [
        (["--throttle-line-grace", "5"], {}, "--throttle-line-grace 5: not under --session-ttl 5"),
        ([], {"ELOCKD_THROTTLE_LINE_GRACE": "6"}, "ELOCKD_THROTTLE_LINE_GRACE 6: not under"),
        (["--session-ttl", "3"], {"ELOCKD_THROTTLE_LINE_GRACE": "4"}, "under --session-ttl 3"),
    ],
)
def test_a_pair_that_cannot_go_together_names_each_setting_as_it_was_given(
    argv: list[str], environ: dict[str, str], named: str
) -> None:
    """A setting given as a variable is named as the variable, not as a flag the
    operator never typed."""
    assert named in refused_in_process(argv, environ)
