"""The safety checker (tests/safety.py): a short real run, and proof that it can fail.

``STRESS_SECONDS`` sets the length of the real run (default 6 s; ``make stress``
runs it longer).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.safety import Record, Report, check, run

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
