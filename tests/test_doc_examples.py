"""The documentation's shell examples, run as written against a real server.

docs/word-family.md has an ``nc`` session per capability: every ``$ command`` of
its ``console`` blocks runs under ``sh`` (port 9999 replaced by the test server's),
and its output must be the lines shown. What varies from run to run is masked on
both sides: client ports, fencing tokens, seconds left, counters; a session id shown
by one command and used by a later one is replaced by the one this run got.

docs/rate-limits.md's sessions (``nc`` and ``elockctl throttle``) run the same way;
the milliseconds and seconds a rate reply gives may be a little off what the page
shows (time passes between the commands), the counts may not.

docs/operations.md's ``openssl s_client`` probe of a TLS port must end by itself
and show the replies.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elockd.ctl.args import build_parser
from tests.support.server_process import mutual_tls_flags, start_server, stop_server

DOCS = Path(__file__).resolve().parent.parent / "docs"
SESSION_ID = re.compile(r"\b[0-9a-f]{32}\b")
MASKS = [
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:PORT"),
    (re.compile(r"token=\d+"), "token=T"),
    (re.compile(r"^200 \d{12,}$", re.MULTILINE), "200 T"),
    (re.compile(r"ttl=\d+\.\d+"), "ttl=S"),
    (re.compile(r"^STAT (\w+) \d+$", re.MULTILINE), r"STAT \1 N"),
    (SESSION_ID, "ID"),
]


@dataclass
class Example:
    command: str
    output: str
    line: int


def console_examples(path: Path) -> list[Example]:
    """Every ``$ command`` of the file's ``console`` blocks, with the output after it."""
    examples: list[Example] = []
    in_block = False
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if text.startswith("```"):
            in_block = text == "```console"
            continue
        if not in_block:
            continue
        if text.startswith("$ "):
            examples.append(Example(text[2:], "", number))
        else:
            examples[-1].output += text + "\n"
    return examples


def masked(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    assert shutil.which("nc"), "nc is needed (Debian: netcat-openbsd)"
    process, port = start_server()
    yield port
    stop_server(process)


def test_word_family_sessions_run_as_documented(port: int) -> None:
    examples = console_examples(DOCS / "word-family.md")
    assert len(examples) >= 15, "an nc session per capability"
    learned: dict[str, str] = {}  # a session id shown in the doc -> this run's
    for example in examples:
        command = example.command.replace("9999", str(port))
        for shown, real in learned.items():
            command = command.replace(shown, real)
        result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
        got = result.stdout.replace("\r\n", "\n")
        where = f"docs/word-family.md:{example.line}: {example.command}"
        assert (result.returncode, result.stderr) == (0, ""), where
        assert masked(got) == masked(example.output), where
        for shown, real in zip(
            SESSION_ID.findall(example.output), SESSION_ID.findall(got), strict=True
        ):
            learned.setdefault(shown, real)


#: A rate reply's durations: milliseconds on the wire, seconds from elockctl.
DURATION = re.compile(
    r"(?<=reset=)\d+|(?<=retry=)\d+|(?<=retry after )\d+\.\d+|(?<=_after: )\d+\.\d+"
)


def same_but_durations(got: str, shown: str) -> bool:
    """Equal text, durations within 50 ms (wire milliseconds) or 2 % (seconds)."""
    if DURATION.sub("D", got) != DURATION.sub("D", shown):
        return False
    for real, documented in zip(DURATION.findall(got), DURATION.findall(shown), strict=True):
        if "." in documented:
            if abs(float(real) - float(documented)) > 0.05 + 0.02 * float(documented):
                return False
        elif abs(int(real) - int(documented)) > 50:
            return False
    return True


@pytest.fixture
def own_port() -> Iterator[int]:
    """A server of the test's own: the keys other pages' sessions leave held (a
    lease on ``partner-api``) are not in this page's way."""
    assert shutil.which("nc"), "nc is needed (Debian: netcat-openbsd)"
    process, port = start_server()
    yield port
    stop_server(process)


def test_rate_limit_sessions_run_as_documented(own_port: int) -> None:
    examples = console_examples(DOCS / "rate-limits.md")
    assert len(examples) >= 6, "an nc session for each way to limit work, and elockctl"
    port = own_port
    elockctl = f"{sys.executable} -m elockd.ctl --port {port} "
    for example in examples:
        command = example.command.replace("9999", str(port)).replace("elockctl ", elockctl)
        result = subprocess.run(
            ["sh", "-c", command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # as a terminal shows them
            text=True,
            timeout=60,
        )
        got = result.stdout.replace("\r\n", "\n")
        where = f"docs/rate-limits.md:{example.line}: {example.command}"
        # (no status check: a loop whose last run was limited ends in 1)
        assert same_but_durations(got, example.output), f"{where}\n{got}"


def test_the_openssl_probe_of_operations_md_ends_by_itself(
    tls_files: dict[str, str], tmp_path: Path
) -> None:
    """``-quiet`` implies ``-ign_eof``: the probe ends because ``quit`` makes the
    server close, not because its input ended."""
    text = (DOCS / "operations.md").read_text()
    found = re.search(r"```sh\n(printf 'auth[^`]*openssl s_client[^`]*)```", text)
    assert found is not None, "the openssl probe in docs/operations.md"
    process, port = start_server(*mutual_tls_flags(tls_files, auth=True))
    probe = (
        found[1]
        .replace("lockhost:9999", f"127.0.0.1:{port}")
        .replace("cat token", f"cat {tls_files['token']}")
        .replace("ca.pem", tls_files["ca"])
        .replace("me.pem", tls_files["client_cert"])
        .replace("me.key", tls_files["client_key"])
    )
    try:
        result = subprocess.run(
            ["sh", "-c", probe], capture_output=True, text=True, timeout=20, cwd=tmp_path
        )
    finally:
        stop_server(process)
    assert result.stdout.replace("\r\n", "\n") == "200 OK\n1 Got Lock\n200 Bye\n", result
    # As the doc says: no close_notify from the server, so s_client reports the EOF.
    assert result.returncode == 0 or "unexpected eof" in result.stderr, result


def test_client_md_names_the_user_the_unit_runs_as() -> None:
    unit = (DOCS.parent / "contrib" / "systemd" / "elockd.service").read_text()
    client = (DOCS / "client.md").read_text()
    assert "\nUser=elockd\n" in unit and "DynamicUser" not in unit
    assert "`User=elockd`" in client and "DynamicUser" not in client


def test_the_elockctl_synopsis_lists_every_global_option() -> None:
    """docs/client.md's synopsis block, against the parser that ships."""
    client = (DOCS / "client.md").read_text()
    found = re.search(r"```\n(elockctl \[--host[^`]*)```", client)
    assert found is not None
    synopsis = found[1]
    parser = build_parser()
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert option in synopsis, f"{option} missing from the synopsis"
