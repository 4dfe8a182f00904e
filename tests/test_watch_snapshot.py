"""A ``watch`` snapshot (docs/protocol.md, "watch") read while the tables change, and
what it costs: the snapshot and the events after it add up to the tables exactly,
and the snapshot holds a bounded amount of the server's memory and reads only the
keys under its prefix, however many keys the server holds. In process, on the
in-memory backend, so every interleaving is the test's to choose."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from elockd.protocol import replies
from elockd.protocol.connection import Connection, Service, Streamed
from tests.support.sansio import memory_service, whole

NOW = 1000.0


def connections(service: Service, count: int) -> list[Connection]:
    return [Connection(service, b"10.0.0.%d:1" % n) for n in range(count)]


def take(conn: Connection, keys: list[bytes]) -> None:
    for key in keys:
        assert whole(conn.handle(b"g " + key, NOW)) == b"1 Got Lock\r\n"


def apply(model: dict[bytes, dict[str, object]], line: bytes) -> None:
    """One ``+``/``-`` line applied to a model of the holds, checking that it makes
    sense there (no hold granted twice, none freed that was not held)."""
    words = line.rstrip(b"\r\n").split(b" ")
    sign, key, kind, owner = words[:4]
    state = model.setdefault(key, {"exclusive": None, "shared": set()})
    shared = state["shared"]
    assert isinstance(shared, set)
    if kind == b"exclusive":
        if sign == b"+":
            assert state["exclusive"] is None, line
            state["exclusive"] = (owner, words[4])
        else:
            held = state["exclusive"]
            assert held is not None and held[0] == owner, line  # type: ignore[index]
            state["exclusive"] = None
    else:
        holders = int(words[4].split(b"=")[1])
        if sign == b"+":
            assert owner not in shared, line
            shared.add(owner)
        else:
            assert owner in shared, line
            shared.discard(owner)
        assert len(shared) == holders, line


def holds(model: dict[bytes, dict[str, object]]) -> set[tuple[bytes, ...]]:
    found: set[tuple[bytes, ...]] = set()
    for key, state in model.items():
        if state["exclusive"] is not None:
            owner, token = state["exclusive"]  # type: ignore[misc]
            found.add((key, b"exclusive", owner, token))
        for owner in state["shared"]:  # type: ignore[attr-defined]
            found.add((key, b"shared", owner))
    return found


def watched(conn: Connection, prefix: bytes) -> Streamed:
    reply = conn.handle(b"watch " + prefix if prefix else b"watch", NOW)
    assert isinstance(reply, Streamed), reply
    return reply


@pytest.mark.parametrize("seed", range(6))
def test_a_snapshot_read_while_the_tables_change_adds_up_to_them(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Grants and frees, exclusive and shared, on keys already shown, still to be
    shown, and new ones (before, inside and after each batch of keys the snapshot
    reads), between every two snapshot lines: the snapshot plus the events make
    exactly the holds a fresh snapshot shows at the end."""
    monkeypatch.setattr(replies, "CHUNK_BYTES", 1)  # one chunk per snapshot line
    rng = random.Random(seed)
    service = memory_service()
    clients = connections(service, 8)
    space = [b"k/%04d" % n for n in range(0, 3000, 2)]  # odd numbers come later
    outside = [b"j/%d" % n for n in range(50)] + [b"l/%d" % n for n in range(50)]
    for n, key in enumerate(space[:900] + outside):
        take(clients[n % 8], [key])
    watcher = connections(service, 1)[0]

    def churn() -> None:
        for _ in range(rng.randrange(4)):
            conn = rng.choice(clients)
            key = rng.choice([*space, *outside, b"k/%04d" % rng.randrange(1, 3000, 2)])
            verb = rng.choice([b"g", b"r", b"sg", b"sr"])
            conn.handle(verb + b" " + key, NOW)

    chunks = watched(watcher, b"k/").chunks
    assert next(chunks) == b"200 Watching\r\n"
    model: dict[bytes, dict[str, object]] = {}
    for chunk in chunks:
        if chunk == b"SYNCED\r\n":
            break
        for line in chunk.splitlines(keepends=True):
            apply(model, line)
        churn()
    for _ in range(200):
        churn()
    assert watcher.watcher is not None
    for line in watcher.watcher.lines:
        assert line.split(b" ")[1].startswith(b"k/"), line
        apply(model, line)
    fresh: dict[bytes, dict[str, object]] = {}
    check = connections(service, 1)[0]
    for line in whole(watched(check, b"k/")).splitlines(keepends=True)[1:-1]:
        apply(fresh, line)
    assert holds(model) == holds(fresh)
    assert len(holds(fresh)) > 500


def test_a_snapshot_holds_little_memory_however_many_keys_it_shows() -> None:
    """A watcher of every key on a server of 200,000 holds, whose client reads the
    first chunk and no more: the server keeps no list or set of the keys for it (that
    would be about 10 MB here, outside --watch-buffer, for each of --max-watchers)."""
    service = memory_service(max_holds=300_000)
    holder = connections(service, 1)[0]
    take(holder, [b"bulk/%07d" % n for n in range(200_000)])
    watcher = connections(service, 1)[0]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        chunks = watched(watcher, b"").chunks
        assert next(chunks).startswith(b"200 Watching\r\n+ bulk/0000000 exclusive ")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    print(f"\nsnapshot of 200,000 holds, first chunk sent: {held / 1024:.0f} KiB held")
    assert held < 1 << 20, held


def test_a_narrow_watch_reads_only_the_keys_under_its_prefix() -> None:
    """``watch jobs/`` on a server of 200,000 other holds costs about what ``ls jobs/``
    does (the keys under the prefix), not a scan of every key."""
    service = memory_service(max_holds=300_000)
    holder = connections(service, 1)[0]
    take(holder, [b"bulk/%07d" % n for n in range(200_000)])
    take(holder, [b"jobs/%d" % n for n in range(10)])

    def best(request: bytes) -> float:
        times = []
        for _ in range(7):
            conn = connections(service, 1)[0]
            started = time.perf_counter()
            reply = conn.handle(request, NOW)
            assert whole(reply).count(b"jobs/") == 10  # type: ignore[arg-type]
            times.append(time.perf_counter() - started)
            conn.close(NOW)
        return min(times)

    ls, watch = best(b"ls jobs/"), best(b"watch jobs/")
    print(f"\nls jobs/ {ls * 1e6:.0f} us, watch jobs/ {watch * 1e6:.0f} us among 200,010 holds")
    assert watch < max(10 * ls, 0.002), (watch, ls)
