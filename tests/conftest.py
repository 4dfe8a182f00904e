"""Shared fixtures: an in-process server on a free loopback port, and a line client.

``server`` runs :func:`elockd.daemon.server.serve` inside the test's own trio run, so a
test that asks for ``mock_clock`` (pytest-trio's ``trio.testing.MockClock``) gets
exact, instant leases, waits and grace periods over real TCP.

``lock_server`` is the same, once per backend: in memory, and a cluster node on a
real 3-member etcd (marked ``cluster``; ``-m "not cluster"`` leaves those out). The
contract tests ask for it and for ``clock``, which is a ``MockClock`` in memory
(waits and leases exact and instant) and real time on a cluster node (etcd answers
in real time), so the same test runs on both.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from elockd.daemon.server import make_service, serve
from elockd.protocol.config import Config
from tests.support.cluster_nodes import Nodes
from tests.support.etcd_cluster import EtcdCluster, running_cluster
from tests.support.line_client import RunningServer
from tests.support.server_process import start_server, stop_server


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    """Time that jumps ahead whenever every task is blocked: sleeps cost nothing."""
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def server_config() -> Config:
    """Override in a test module (or parametrize) to start the server differently."""
    return Config(port=0, metrics_port=0)


@pytest.fixture
async def server(nursery: trio.Nursery, server_config: Config) -> AsyncIterator[RunningServer]:
    # Ports the OS picks, metrics off: 9998 and 9999 may be busy (another elockd).
    config = replace(server_config, host="127.0.0.1", port=0, metrics_port=0)
    service = make_service(config)
    addresses = await nursery.start(serve, config, service)
    port = next(a[1] for a in addresses if isinstance(a, tuple))
    running = RunningServer(port, service, config, [])
    yield running
    for client in running._clients:
        await client.aclose()


#: Fixtures that start (or reach) a real etcd cluster.
ETCD_FIXTURES = frozenset({"etcd", "shared_etcd", "nodes"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs etcd must be marked ``cluster``, or ``-m "not cluster"``
    would start etcd after all (or fail where there is none)."""
    for item in items:
        uses = ETCD_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses and item.get_closest_marker("cluster") is None:
            raise pytest.UsageError(f"{item.nodeid} uses {sorted(uses)} but is not marked cluster")


BACKENDS = ["memory", pytest.param("cluster", marks=pytest.mark.cluster)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend a contract test runs on: ``memory`` or ``cluster``."""
    return str(request.param)


@pytest.fixture
def clock(backend: str) -> trio.testing.MockClock | None:
    """pytest-trio runs the test on this clock: instant in memory, real on etcd."""
    return trio.testing.MockClock(autojump_threshold=0) if backend == "memory" else None


@pytest.fixture
def contract_config(backend: str, server_config: Config, request: pytest.FixtureRequest) -> Config:
    """``server_config`` on the test's backend: a cluster node gets a fresh key prefix
    on the session's etcd cluster, and the shortest session TTL."""
    config = replace(server_config, host="127.0.0.1", port=0, metrics_port=0)
    if backend == "memory":
        return config
    etcd: EtcdCluster = request.getfixturevalue("shared_etcd")
    return replace(
        config,
        etcd=",".join(etcd.endpoints),
        etcd_prefix=f"/contract-{uuid.uuid4().hex[:10]}/",
        session_ttl=2,
    )


@pytest.fixture
async def lock_server(
    nursery: trio.Nursery, contract_config: Config
) -> AsyncIterator[RunningServer]:
    """A server on the test's backend, in the test's trio run."""
    service = make_service(contract_config)
    addresses = await nursery.start(serve, contract_config, service)
    port = next(a[1] for a in addresses if isinstance(a, tuple))
    running = RunningServer(port, service, contract_config, [])
    yield running
    for client in running._clients:
        await client.aclose()


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One 3-member etcd cluster for every contract test of the session (each test
    has its own key prefix); a missing etcd fails, never skips."""
    with running_cluster(tmp_path_factory.mktemp("shared-etcd")) as cluster:
        yield cluster


@pytest.fixture
def spawn_server() -> Iterator[Callable[..., tuple[subprocess.Popen[str], int]]]:
    """Start ``python -m elockd`` as a real process on a free port (through
    :func:`tests.support.server_process.start_server`, which drains its stderr; pass
    ``log=[]`` to keep what it logs); stopped afterwards."""
    processes: list[subprocess.Popen[str]] = []

    def start(*args: str, log: list[str] | None = None) -> tuple[subprocess.Popen[str], int]:
        process, port = start_server(*args, log=log)
        processes.append(process)
        return process, port

    yield start
    for process in processes:
        stop_server(process)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A real server process that wants ``auth``, and the file with its token: for
    the tools that must say "cannot tell" without one."""
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text("letmein\n")
    process, port = start_server("--auth-token-file", str(token), "--auth-failure-delay", "0.05")
    yield port, token
    stop_server(process)


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    """A throwaway certificate authority for the TLS tests."""
    return trustme.CA()


@pytest.fixture
def tls_files(ca: trustme.CA, tmp_path: Path) -> dict[str, str]:
    """PEM files for a TLS lock port on 127.0.0.1 (``cert``, ``key``), the CA that
    signed it (``ca``), a client certificate from that CA for mutual TLS
    (``client_cert``, ``client_key``), and an auth token file (``token``)."""
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.test")
    files = {
        name: str(tmp_path / f"{name}.pem")
        for name in ("cert", "key", "ca", "client_cert", "client_key")
    }
    server.cert_chain_pems[0].write_to_path(files["cert"])
    server.private_key_pem.write_to_path(files["key"])
    ca.cert_pem.write_to_path(files["ca"])
    client.cert_chain_pems[0].write_to_path(files["client_cert"])
    client.private_key_pem.write_to_path(files["client_key"])
    files["token"] = str(tmp_path / "token")
    Path(files["token"]).write_text("letmein\n")
    return files


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One 3-member etcd cluster per test module; a missing etcd fails, never skips."""
    with running_cluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture
def nodes(etcd: EtcdCluster) -> Iterator[Nodes]:
    """A factory of elockd nodes for one test; all killed at its end, and any etcd
    member a test killed or paused is brought back."""
    started = Nodes(etcd)
    try:
        yield started
    finally:
        started.close()
        etcd.heal()
