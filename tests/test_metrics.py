"""Prometheus metrics: the collector, the engine's O(1) counts, the HTTP endpoint,
and the real tools (``promtool check metrics`` on a real scrape, the alert rules'
unit tests, the example config, the Grafana dashboard's queries)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform
import random
import re
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from elockd.daemon.server import make_service, serve
from elockd.engine.locks import LockEngine
from elockd.net.metrics import EXTRA_METRICS, Exposition, make_registry, serve_metrics
from elockd.protocol.config import Config
from elockd.protocol.connection import Service
from elockd.protocol.stats import Buckets
from tests.support.line_client import RunningServer

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "contrib" / "prometheus"
DASHBOARD = ROOT / "contrib" / "grafana" / "elockd-dashboard.json"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def tool(name: str) -> str:
    """The path of a real tool the tests drive; missing is a failure, not a skip."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (.ci/run installs it: apt-get install prometheus)")
    return path


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    """A bare HTTP/1.0 GET (the server then closes the connection, no chunking)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def scrape(port: int) -> Samples:
    status, body = await http_get(port, "/metrics")
    assert status == 200
    return parse(body.decode())


@pytest.fixture
def server_config() -> Config:
    """These tests scrape, change the tables, and scrape again at once: no cache."""
    return Config(port=0, metrics_port=0, metrics_cache=0)


async def start_metrics(nursery: trio.Nursery, service: Service) -> int:
    _, port = await nursery.start(serve_metrics, service, "127.0.0.1", 0)
    assert isinstance(port, int)
    return port


# ------------------------------------------------------------------ pure parts


def test_buckets_count_values_on_a_bound_in_that_bound() -> None:
    buckets = Buckets((1.0, 2.0))
    for seconds in (0.5, 1.0, 1.5, 2.0, 3.0):
        buckets.observe(seconds)
    assert buckets.cumulative() == [("1.0", 2), ("2.0", 4), ("+Inf", 5)]
    assert buckets.count == 5
    assert buckets.sum == 8.0


def test_engine_keeps_shared_holders_and_grace_sessions_exact() -> None:
    """The O(1) counters equal a full count after every step of a random run."""
    rng = random.Random(4)
    engine = LockEngine()
    sessions = [engine.open_session(f"s{i}", b"p") for i in range(8)]
    now = 0.0
    for step in range(3000):
        now += rng.random()
        session = rng.choice(sessions)
        key = rng.choice([b"a", b"b", b"c"])
        action = rng.randrange(6)
        if not session.connected:
            fresh = engine.open_session(f"n{step}", b"p")
            taken = engine.take_over(session.id, fresh) if rng.random() < 0.5 else None
            sessions[sessions.index(session)] = taken or fresh
        elif action == 0:
            engine.acquire_shared(session, key, now, ttl=rng.choice([None, 2.0]))
        elif action == 1:
            engine.release_shared(session, key, now)
        elif action == 2:
            engine.wait_shared(session, key, now, limit=2)
        elif action == 3:
            session.grace = rng.choice([0.0, 3.0])
            engine.disconnect(session, now)
        elif action == 4:
            engine.release_all(session, now)
        else:
            engine.advance(now)
        holders = sum(1 for _ in engine.shared_holds())
        in_grace = sum(
            1 for s in engine.sessions.values() if not s.connected and s.grace_deadline is not None
        )
        assert (engine.shared_holders, engine.sessions_in_grace) == (holders, in_grace), step


class NoIteration(dict[Any, Any]):
    """A table that fails the test if anything walks it: only len() is allowed."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("scrape walked a lock table")

    def keys(self) -> Any:
        raise AssertionError("scrape walked a lock table")

    values = items = keys


def test_scrape_does_no_per_lock_work() -> None:
    service = make_service(Config(port=0, metrics_port=0))
    engine = service.backend
    for i in range(50):
        session = engine.open_session(f"s{i}", b"p")
        for k in range(1000):
            engine.acquire(session, b"x%d-%d" % (i, k), 0.0)
            engine.acquire_shared(session, b"s%d" % k, 0.0)
    engine.exclusive = NoIteration(engine.exclusive)
    engine.shared = NoIteration(engine.shared)
    engine.sessions = NoIteration(engine.sessions)
    registry = make_registry(service)
    assert registry.get_sample_value("elockd_keys", {"kind": "exclusive"}) == 50_000
    assert registry.get_sample_value("elockd_keys", {"kind": "shared"}) == 1000
    assert registry.get_sample_value("elockd_holders", {"kind": "shared"}) == 50_000
    assert registry.get_sample_value("elockd_sessions") == 50


def test_build_info_names_the_installed_version_and_the_python() -> None:
    registry = make_registry(make_service(Config(port=0, metrics_port=0)))
    labels = {"version": importlib.metadata.version("elockd"), "python": platform.python_version()}
    assert registry.get_sample_value("elockd_build_info", labels) == 1


# ----------------------------------------------------------- over real HTTP


async def test_values_move_as_clients_lock_and_release(
    nursery: trio.Nursery, server: RunningServer
) -> None:
    port = await start_metrics(nursery, server.service)
    before = await scrape(port)
    assert value(before, "elockd_connections") == 0
    assert value(before, "elockd_keys", kind="exclusive") == 0

    a, b = await server.connect(), await server.connect()
    assert await a.request(b"g job") == b"1 Got Lock"
    assert await a.request(b"sg pool") == b"1 Got Lock"
    assert await b.request(b"sg pool") == b"2 Got Lock"
    assert await b.request(b"bogus") == b"0 Invalid Command: bogus"
    await b.send(b"lock job 100\n")  # waits behind a
    await trio.testing.wait_all_tasks_blocked()
    during = await scrape(port)
    assert value(during, "elockd_connections") == 2
    assert value(during, "elockd_sessions") == 2
    assert value(during, "elockd_keys", kind="exclusive") == 1
    assert value(during, "elockd_keys", kind="shared") == 1
    assert value(during, "elockd_holders", kind="shared") == 2
    assert value(during, "elockd_waiters") == 1
    assert value(during, "elockd_commands_total", verb="g") == 1
    assert value(during, "elockd_commands_total", verb="sg") == 2
    assert value(during, "elockd_commands_total", verb="lock") == 1
    assert value(during, "elockd_invalid_commands_total") == 1
    assert value(during, "elockd_handovers_total") == 0  # docs/upgrade.md

    await a.aclose()  # a vanishes holding both: orphans, and b is granted
    assert await b.line() == b"200 Acquired\r\n"
    after = await scrape(port)
    assert value(after, "elockd_connections") == 1
    assert value(after, "elockd_waiters") == 0
    assert value(after, "elockd_orphans_total", kind="exclusive") == 1
    assert value(after, "elockd_orphans_total", kind="shared") == 1
    assert value(after, "elockd_holders", kind="shared") == 1
    assert value(after, "elockd_lock_wait_seconds_count", kind="exclusive") == 1
    # Every q counter has its metric, with the same value.
    q = await b.stats()
    assert value(after, "elockd_keys", kind="exclusive") == q["locks"]
    assert value(after, "elockd_holders", kind="shared") == q["shared_holders"]
    assert value(after, "elockd_orphans_total", kind="shared") == q["shared_orphans"]


async def test_wait_and_hold_histograms(
    nursery: trio.Nursery, server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    port = await start_metrics(nursery, server.service)
    a, b = await server.connect(), await server.connect()
    assert await a.request(b"g k") == b"1 Got Lock"
    await b.send(b"lock k 60\n")
    await trio.sleep(3)  # the mock clock jumps: b has waited 3 s
    assert await a.request(b"r k") == b"1 Released Lock"
    assert await b.line() == b"200 Acquired\r\n"
    assert await b.request(b"sg s") == b"1 Got Lock"
    await trio.sleep(120)
    assert await b.request(b"sr s") == b"1 Released Lock"
    assert await b.request(b"lock_shared s 1 limit=1") == b"200 1"  # no wait: not observed
    samples = await scrape(port)

    def bucket(name: str, kind: str, le: str) -> float:
        return value(samples, f"{name}_bucket", kind=kind, le=le)

    assert bucket("elockd_lock_wait_seconds", "exclusive", "2.5") == 0
    assert bucket("elockd_lock_wait_seconds", "exclusive", "5.0") == 1
    assert value(samples, "elockd_lock_wait_seconds_sum", kind="exclusive") == pytest.approx(3)
    assert value(samples, "elockd_lock_wait_seconds_count", kind="shared") == 0
    assert bucket("elockd_lock_hold_seconds", "exclusive", "1.0") == 0  # a held k 3 s
    assert bucket("elockd_lock_hold_seconds", "exclusive", "10.0") == 1
    assert bucket("elockd_lock_hold_seconds", "shared", "60.0") == 0  # b held s 120 s
    assert bucket("elockd_lock_hold_seconds", "shared", "300.0") == 1
    assert value(samples, "elockd_lock_hold_seconds_count", kind="shared") == 1


async def test_throttle_gauge_counters_and_wait_kind(
    nursery: trio.Nursery, server: RunningServer, mock_clock: trio.testing.MockClock
) -> None:
    """``throttle`` moves elockd_throttles, elockd_admitted_total and
    elockd_throttled_total as `q` moves throttles, admitted and throttled; a throttle
    wait goes into the wait histogram as kind ``throttle``, not a lock kind."""
    port = await start_metrics(nursery, server.service)
    a, b = await server.connect(), await server.connect()
    assert (await a.request(b"throttle api 1 10")).startswith(b"200 ")
    assert (await a.request(b"throttle api 1 10")).startswith(b"409 ")
    assert (await a.request(b"throttle other 5 10")).startswith(b"200 ")
    await b.send(b"throttle api 1 10 wait=20\n")  # its turn comes 10 s after the first
    await trio.testing.wait_all_tasks_blocked()
    during = await scrape(port)
    assert value(during, "elockd_throttles") == 2
    assert value(during, "elockd_admitted_total") == 2
    assert value(during, "elockd_throttled_total") == 1
    assert value(during, "elockd_lock_wait_seconds_count", kind="throttle") == 0
    await trio.sleep(10)
    assert (await b.line()).startswith(b"200 ")
    samples = await scrape(port)
    assert value(samples, "elockd_admitted_total") == 3
    assert value(samples, "elockd_lock_wait_seconds_bucket", kind="throttle", le="5.0") == 0
    assert value(samples, "elockd_lock_wait_seconds_bucket", kind="throttle", le="10.0") == 1
    assert value(samples, "elockd_lock_wait_seconds_sum", kind="throttle") == pytest.approx(10)
    assert value(samples, "elockd_lock_wait_seconds_count", kind="exclusive") == 0
    q = await a.stats()
    assert value(samples, "elockd_throttles") == q["throttles"]
    assert value(samples, "elockd_admitted_total") == q["admitted"]
    assert value(samples, "elockd_throttled_total") == q["throttled"]


async def test_healthz_and_unknown_paths(nursery: trio.Nursery, server: RunningServer) -> None:
    port = await start_metrics(nursery, server.service)
    assert await http_get(port, "/healthz") == (200, b"ok\n")
    status, _ = await http_get(port, "/nope")
    assert status == 404


def test_the_exposition_is_rendered_at_most_once_per_max_age() -> None:
    service = make_service(Config(port=0, metrics_port=0))
    now = [100.0]
    exposition = Exposition(make_registry(service), max_age=1.0, clock=lambda: now[0])
    first, content_type = exposition.get("")
    assert content_type.startswith("text/plain") and b"elockd_connections 0.0" in first
    service.counters.connections = 7
    for _ in range(1000):  # scrapers in a tight loop within one second
        assert exposition.get("")[0] == first
        now[0] += 0.0009
    now[0] += 0.2
    assert b"elockd_connections 7.0" in exposition.get("")[0]
    openmetrics, kind = exposition.get("application/openmetrics-text; version=1.0.0")
    assert kind.startswith("application/openmetrics-text") and openmetrics.endswith(b"# EOF\n")
    assert exposition.renders == 3


async def test_http_connections_are_capped_and_idle_ones_closed(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """Scrapers opening connections in a crowd are served --metrics-max-connections
    at a time (the rest wait in the backlog, costing nothing); a connection that
    says nothing is closed after --metrics-idle-timeout."""
    config = Config(port=0, metrics_port=0, metrics_max_connections=2, metrics_idle_timeout=5)
    port = await start_metrics(nursery, make_service(config))
    silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
    opened = trio.current_time()
    # Both slots are taken by silent connections: a third waits until one closes.
    assert await http_get(port, "/healthz") == (200, b"ok\n")
    assert trio.current_time() - opened == 5.0, "served once the idle ones were closed"
    for stream in silent:
        assert await stream.receive_some(1) == b""
        await stream.aclose()


async def test_serve_starts_metrics_on_the_configured_port(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elockd")
    port = free_port()
    config = Config(port=0, metrics_port=port)
    await nursery.start(serve, config, make_service(config))
    assert f"elockd metrics on http://127.0.0.1:{port}/metrics" in caplog.text
    assert "elockd_connections 0.0" in (await http_get(port, "/metrics"))[1].decode()


async def test_metrics_port_0_turns_the_endpoint_off(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elockd")
    config = Config(port=0, metrics_port=0)
    await nursery.start(serve, config, make_service(config))
    assert "listening on" in caplog.text
    assert "metrics on" not in caplog.text


# ---------------------------------------------------------- the real tools


def exchange(sock: socket.socket, requests: bytes, replies: int) -> bytes:
    """Send requests, return the reply lines (blocking, as a shell client would)."""
    sock.settimeout(10)
    sock.sendall(requests)
    received = b""
    while received.count(b"\r\n") < replies:
        received += sock.recv(4096)
    return received


@pytest.fixture
def busy_scrape(spawn_server: Callable[..., tuple[subprocess.Popen[str], int]]) -> str:
    """A scrape of a real ``python -m elockd`` process after some traffic."""
    metrics_port = free_port()
    _, port = spawn_server("--metrics-port", str(metrics_port))
    with (
        socket.create_connection(("127.0.0.1", port)) as a,
        socket.create_connection(("127.0.0.1", port)) as b,
    ):
        exchange(a, b"g k\nsg s\nlock w\nbogus\n", 4)
        replies = exchange(b, b"lock k 0.05\nlock_shared s 0.05 limit=1\nsg s\n", 3)
        assert replies == b"409 Unavailable\r\n409 1\r\n2 Got Lock\r\n"
        # A refusal, then a wait of about 50 ms for the turn of a fast rate.
        throttles = (
            b"throttle api 1 60\nthrottle api 1 60\nthrottle f 1 0.05\nthrottle f 1 0.05 wait=5\n"
        )
        replies = exchange(b, throttles, 4)
        assert [line[:4] for line in replies.split(b"\r\n")] == [
            b"200 ",
            b"409 ",
            b"200 ",
            b"200 ",
            b"",
        ]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as response:
        text: str = response.read().decode()
    return text


def test_promtool_check_metrics_passes_on_a_real_scrape(busy_scrape: str) -> None:
    samples = parse(busy_scrape)
    assert value(samples, "elockd_wait_timeouts_total") == 2
    assert value(samples, "elockd_throttled_total") == 1
    assert value(samples, "elockd_lock_wait_seconds_count", kind="throttle") == 1
    assert value(samples, "elockd_lock_wait_seconds_count", kind="shared") == 1
    result = subprocess.run(
        [tool("promtool"), "check", "metrics"],
        input=busy_scrape,
        capture_output=True,
        text=True,
        check=False,
    )
    # promtool prints lint warnings (and exits non-zero) for any naming problem.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_alert_rules_config_and_rule_unit_tests() -> None:
    promtool = tool("promtool")
    for args in (
        ["check", "rules", "elockd-alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "elockd-alerts.test.yml"],
    ):
        result = subprocess.run(
            [promtool, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        assert "SUCCESS" in result.stdout


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every panel's query, with Grafana's variables given values, parses: promtool
    checks them as the expressions of a rule file (it has no other offline check)."""
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    filled = [
        e.replace("$__rate_interval", "1m").replace("$job", "elockd").replace("$instance", ".*")
        for e in expressions
    ]
    assert all("$" not in e for e in filled), filled
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(filled)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert f"SUCCESS: {len(filled)} rules found" in result.stdout


def test_alerts_and_dashboard_query_only_metrics_elockd_exports(busy_scrape: str) -> None:
    exported = {family.name for family in text_string_to_metric_families(busy_scrape)}
    exported |= {s.name for f in text_string_to_metric_families(busy_scrape) for s in f.samples}
    # Only a cluster node exports these (tests/test_cluster.py scrapes one).
    exported |= {
        name + ("_total" if kind == "counter" else "") for kind, name, _ in EXTRA_METRICS.values()
    }
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    expressions.append((PROMETHEUS_DIR / "elockd-alerts.yml").read_text())
    used = {m for e in expressions for m in re.findall(r"\b((?:elockd|process)_[a-z_]+)", e)}
    assert used - {"elockd_"}, "no metric found in the queries"
    assert used <= exported, used - exported


def test_hold_and_wait_hooks_are_wired_only_for_a_metrics_registry() -> None:
    service = make_service(Config(port=0, metrics_port=0))
    assert service.backend.on_hold_end is None and service.backend.on_wait_end is None
    make_registry(service)
    assert service.backend.on_hold_end == service.timings.hold_ended
    assert service.backend.on_wait_end == service.timings.wait_ended


def test_dashboard_shows_p50_and_p99_of_lock_wait_and_hold_by_kind() -> None:
    """The wait and hold histograms (``elockd_lock_wait_seconds``, ``elockd_lock_hold_seconds``)
    each have a panel with their p50 and p99, one line per ``kind``."""
    dashboard = json.loads(DASHBOARD.read_text())
    quantiles: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            found = re.fullmatch(
                r"histogram_quantile\((0\.5|0\.99), sum by \(kind, le\) "
                r"\(rate\(elockd_lock_(wait|hold)_seconds_bucket\{[^}]*\}\[\$__rate_interval\]\)\)\)",
                target["expr"],
            )
            if found:
                assert "{{kind}}" in target["legendFormat"], target
                quantiles.setdefault(found.group(2), set()).add(found.group(1))
    assert quantiles == {"wait": {"0.5", "0.99"}, "hold": {"0.5", "0.99"}}


def test_the_lock_wait_alert_is_p99_above_10s_for_10_minutes() -> None:
    """The example alert the docs promise (its firing is unit-tested by promtool in
    test_alert_rules_config_and_rule_unit_tests)."""
    text = (PROMETHEUS_DIR / "elockd-alerts.yml").read_text()
    rule = text.split("- alert: ElockdLockWaitP99High", 1)[1].split("- alert:", 1)[0]
    assert "histogram_quantile(0.99," in rule and "elockd_lock_wait_seconds_bucket" in rule
    assert re.search(r"\)\s*> 10\n", rule) and "for: 10m" in rule
