"""The safety checker (tests/support/safety.py): a short real run, and proof that it can fail.

``STRESS_SECONDS`` sets the length of the real run (default 6 s; ``make stress``
runs it longer); ``HANDOVER_STRESS_SECONDS`` that of the run with five hand-overs
(default 8 s: each takes up to a second, and all must land while the clients run).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.safety import (
    Client,
    Record,
    Report,
    ServerChain,
    check,
    final_state_problems,
    load_records,
    run,
)

SpawnServer = Callable[..., tuple[subprocess.Popen[str], int]]


def test_no_violation_under_random_kills(spawn_server: SpawnServer, tmp_path: Path) -> None:
    seconds = float(os.environ.get("STRESS_SECONDS", "6"))
    server, port = spawn_server()
    report = run(port, seconds, tmp_path, seed=int(os.environ.get("STRESS_SEED", "1")))
    print(report.summary())
    assert report.violations == []
    assert server.poll() is None, "the server died during the run"
    # The run must have exercised what it claims to check.
    assert report.kills >= 1
    assert all(report.grants.get(via, 0) > 0 for via in ("g", "lock", "mlock", "lock_shared"))
    assert report.max_shared.get("s3", 0) >= 2


def test_no_violation_and_nothing_noticed_across_five_handovers(tmp_path: Path) -> None:
    """The issue's bar: five hand-overs during the run, zero exclusion or limit
    violations, and no client sees an end of its connection or an error it did not
    ask for (either is an ``error`` record, hence a violation)."""
    seconds = float(os.environ.get("HANDOVER_STRESS_SECONDS", "8"))
    seed = int(os.environ.get("STRESS_SEED", "1"))
    records = tmp_path / "records"
    records.mkdir()
    with ServerChain(tmp_path) as chain:
        report = run(chain.port, seconds, records, seed=seed, handovers=5, chain=chain)
        print(f"seed {seed}: {report.summary()}")
        assert report.violations == []
        # Every hand-over happened: six processes, the first five exited 0 (each
        # once its successor listened), the last one serves and passed the final check.
        assert report.handovers == 5
        assert len(chain.processes) == 6
        assert [process.returncode for process in chain.processes[:5]] == [0] * 5
        assert chain.current is chain.processes[5] and chain.current.poll() is None
    # ... all while the clients ran, and connections moved open and went on being
    # answered (so the clients had every chance to notice).
    assert all(done < seconds for _, done in report.handovers_at), report.handovers_at
    assert report.carried_sessions > 0
    assert report.kills >= 1
    assert all(report.grants.get(via, 0) > 0 for via in ("g", "lock", "mlock", "lock_shared"))


def test_a_successor_that_cannot_start_is_reported_and_the_old_one_serves(
    tmp_path: Path,
) -> None:
    with ServerChain(tmp_path) as chain:
        first = chain.current
        assert chain.hand_over("--max-connections", "nonsense") is False
        assert chain.handovers == 0
        assert any("failed to start" in problem for problem in chain.problems), chain.problems
        assert chain.current is first and first.poll() is None
        with socket.create_connection(("127.0.0.1", chain.port), timeout=5) as sock:
            sock.sendall(b"g k\n")
            assert sock.recv(100) == b"1 Got Lock\r\n"


def test_a_server_that_was_not_handed_over_is_told_apart(spawn_server: SpawnServer) -> None:
    # The final check asks the server how often it was handed over: a process that
    # is not the end of the chain (or a fresh one) counts fewer.
    _, port = spawn_server()
    assert final_state_problems(port, handovers=0) == []
    assert any("counts 0 hand-overs, not 5" in p for p in final_state_problems(port, handovers=5))


@pytest.mark.parametrize(
    ("answer", "seen"),
    [(b"", "server closed the connection"), (b"500 Internal Error\r\n", "500 Internal Error")],
)
def test_a_client_reports_an_end_or_an_error_it_did_not_ask_for(
    tmp_path: Path, answer: bytes, seen: str
) -> None:
    """A hand-over must go unnoticed: a server that answers the first request with
    the end of the connection, or with an error, is a violation of the run."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve_once() -> None:
            conn, _ = listener.accept()
            with conn:
                request = b""
                while not request.endswith(b"\n") and (chunk := conn.recv(100)):
                    request += chunk
                conn.sendall(answer)  # then closes: the client's request is all read

        server = threading.Thread(target=serve_once)
        server.start()
        port = listener.getsockname()[1]
        Client([port], "9.0", 1, time.monotonic() + 30, tmp_path / "9.0.jsonl").run()
        server.join()
    report = Report(0)
    check(list(load_records(tmp_path)), {}, report)
    assert any(
        v.startswith("client 9.0: ReplyError") and seen in v for v in report.violations
    ), report.violations


def test_two_servers_that_share_nothing_are_caught(
    spawn_server: SpawnServer, tmp_path: Path
) -> None:
    # Clients spread over two independent servers: both grant the same keys, as two
    # cluster nodes that do not share their locks would. The run must say so.
    (_, first), (_, second) = spawn_server(), spawn_server()
    report = run([first, second], 3, tmp_path, processes=2, kill_every=(1.0, 2.0))
    assert any("exclusive overlap" in v or "shared holders" in v for v in report.violations)


def grant(
    hold: str, key: str, start: float, *, token: int | None = None, **extra: object
) -> Record:
    """A grant record as a client writes it (client "9.0" in worker process 9)."""
    record: Record = {
        "ev": "grant", "client": "9.0", "session": extra.pop("session", "9.0.0"), "hold": hold,
        "key": key, "shared": False, "via": "g", "sent": start - 0.001, "t": start,
        "ttl": None, "token": token, "token_at": start, "limit": None,
    }  # fmt: skip
    record.update(extra)
    return record


def release(hold: str, at: float, ok: bool = True) -> list[Record]:
    return [
        {"ev": "release", "client": "9.0", "hold": hold, "t": at},
        {"ev": "released", "client": "9.0", "hold": hold, "ok": ok, "t": at + 0.001},
    ]


def checked(records: list[Record], kills: dict[str, float] | None = None) -> list[str]:
    report = Report(0)
    check(records, kills or {}, report)
    return report.violations


def test_checker_accepts_a_clean_history() -> None:
    records = [
        grant("a", "x0", 1.0, token=10),
        *release("a", 2.0),
        grant("b", "x0", 2.5, token=11, session="9.0.1"),
        {"ev": "close", "client": "9.0", "session": "9.0.1", "t": 3.0},
        grant("c", "x0", 3.5, token=12, session="9.0.2"),  # after the close: fine
        grant("d", "x1", 1.0, token=13, session="9.0.3"),
    ]
    # Process 9 was killed at 4.0: the open holds c and d end there.
    assert checked(records, {"9": 4.0}) == []


def test_checker_catches_two_exclusive_holders() -> None:
    records = [grant("a", "x0", 1.0, token=1), *release("a", 2.0), grant("b", "x0", 1.5, token=2)]
    assert any("exclusive overlap on x0" in v for v in checked(records, {"9": 3.0}))


def test_checker_catches_a_kill_that_did_not_free() -> None:
    # A killed worker's hold counts until the kill, so a grant before it is an overlap.
    records = [grant("a", "x0", 1.0, token=1), grant("b", "x0", 1.5, token=2, session="8.0.0")]
    records[1]["client"] = "8.0"
    assert any("overlap" in v for v in checked(records, {"9": 2.0, "8": 3.0}))


def test_checker_catches_a_lease_that_outlives_its_connection() -> None:
    # A lease is not ended by its session's close: only by release or ttl.
    records = [
        grant("a", "x0", 1.0, token=1, ttl=5.0, sent=0.9),
        {"ev": "close", "client": "9.0", "session": "9.0.0", "t": 1.1},
        grant("b", "x0", 2.0, token=2, session="9.0.1"),
        *release("b", 2.5),
    ]
    assert any("overlap" in v for v in checked(records))
    records[0]["ttl"] = 1.0  # ends at 1.9 at the latest: then b is fine
    assert checked(records) == []


def test_checker_catches_too_many_shared_holders() -> None:
    shared = {"shared": True, "via": "lock_shared", "limit": 2, "token_at": None}
    records = [
        grant("a", "s2", 1.0, **shared),
        grant("b", "s2", 1.1, session="9.0.1", **shared),
        grant("c", "s2", 1.2, session="9.0.2", **shared),
        *release("a", 2.0),
        *release("b", 2.0),
        *release("c", 2.0),
    ]
    assert any("3 shared holders of s2" in v for v in checked(records))
    records[2]["t"] = 2.0  # c starts as a and b end: fine
    assert checked(records) == []


def test_checker_catches_fencing_tokens_going_back() -> None:
    records = [
        grant("a", "x0", 1.0, token=5),
        *release("a", 2.0),
        grant("b", "x0", 3.0, token=5),
        *release("b", 4.0),
    ]
    problems = checked(records)
    assert any("token on x0 went from 5" in v for v in problems)
    assert any("token 5 given to a and b" in v for v in problems)


def test_checker_wants_a_token_of_its_own_for_each_key_of_one_mlock() -> None:
    # Every grant has a token of its own, the keys of one mlock too (on a cluster
    # as well: its keys are ranked within their etcd revision).
    mlock = {"via": "mlock", "sent": 0.9}
    records = [
        grant("a", "x0", 1.0, token=7, **mlock),
        grant("b", "x1", 1.0, token=8, **mlock),
        *release("a", 2.0),
        *release("b", 2.0),
    ]
    assert checked(records) == []
    records[1]["token"] = 7  # one request, one token for two keys
    assert any("token 7 given to a and b" in v for v in checked(records))


def test_checker_catches_lost_holds_and_early_lease_ends() -> None:
    lost = [grant("a", "x0", 1.0, token=1), *release("a", 2.0, ok=False)]
    assert any("was lost" in v for v in checked(lost))
    early = [grant("a", "x0", 1.0, token=1, ttl=3.0, sent=1.0), *release("a", 2.0, ok=False)]
    assert any("ended" in v and "early" in v for v in checked(early))
    expired = [grant("a", "x0", 1.0, token=1, ttl=0.5, sent=1.0), *release("a", 2.0, ok=False)]
    assert checked(expired) == []
