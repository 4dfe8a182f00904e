"""The cluster's parts meet etcd through one wrapper, by construction.

Every part of a cluster node (lease, records, ends, takeover, recipe, node) is
given an :class:`EtcdCalls` and never the etcd client: these tests read the
package's source to show that no part but ``calls.py`` reaches the client, that the
etcd client package knows nothing of the lock layer (the rank rule is passed in),
and check what the wrapper makes of etcd not answering.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import cast

import pytest
import trio
import trio.testing

from elockd.backend.cluster.calls import EtcdCalls
from elockd.backend.cluster.etcd.client import EtcdClient, EtcdUnavailable
from elockd.backend.cluster.tokens import TOKENS_PER_REVISION
from elockd.backend.interface import BackendUnavailable

CLUSTER = Path(__file__).resolve().parent.parent / "elockd" / "backend" / "cluster"
#: calls.py holds the client; space.py builds the parts and keeps the client only
#: for the server to close it.
HOLDERS = {"calls.py", "space.py"}


def parts() -> list[Path]:
    return sorted(CLUSTER.glob("*.py"))


def test_no_part_but_calls_names_or_reaches_the_etcd_client() -> None:
    for path in parts():
        tree = ast.parse(path.read_text(), str(path))
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        if path.name not in HOLDERS:
            assert "EtcdClient" not in names | imported, path.name
        if path.name != "calls.py":
            assert "_client" not in attributes, path.name
            # Only the façade keeps it (for the server to close), and never calls it.
            calls_on_client = [
                node
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "client"
            ]
            assert calls_on_client == [], (path.name, [ast.unparse(n) for n in calls_on_client])


def test_the_etcd_client_package_imports_nothing_of_the_lock_layer() -> None:
    for path in sorted((CLUSTER / "etcd").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                module = node.module
                if module.startswith("elockd.backend"):
                    assert module.startswith("elockd.backend.cluster.etcd"), (path.name, module)
                assert not module.startswith("elockd.engine"), (path.name, module)


def dead_calls() -> EtcdCalls:
    return EtcdCalls(EtcdClient(["http://127.0.0.1:9"], deadline=0.3, attempt_timeout=0.1))


async def test_a_call_etcd_does_not_answer_fails_closed_and_is_counted_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls = dead_calls()
    with pytest.raises(BackendUnavailable):
        await calls.get(b"k")
    assert calls.backend_unavailable == 1 and calls.keeper_wanted.is_set()
    with pytest.raises(BackendUnavailable):
        await calls.txn([], [])
    assert calls.backend_unavailable == 2


async def test_the_unmapped_calls_raise_etcds_own_error_and_count_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The node's loops and start-up steps count or retry by their own rules."""
    calls = dead_calls()
    with pytest.raises(EtcdUnavailable):
        await calls.unmapped.get(b"k")
    assert calls.backend_unavailable == 0 and not calls.keeper_wanted.is_set()


async def test_start_up_retries_a_step_until_etcd_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls = dead_calls()
    tries: list[float] = []

    async def step() -> str:
        tries.append(trio.current_time())
        if len(tries) < 3:
            await calls.unmapped.get(b"k")  # etcd not answering, as etcd says it
        return "joined"

    assert await calls.until_answered(step) == "joined"
    assert len(tries) == 3 and calls.backend_unavailable == 2


async def test_the_batcher_is_given_the_rank_rule_of_fencing_tokens() -> None:
    told: list[int | None] = []

    class Client:
        async def run_batches(self, *, max_ranks: int | None = None) -> None:
            told.append(max_ranks)

    await EtcdCalls(cast(EtcdClient, Client())).run_batches()
    assert told == [TOKENS_PER_REVISION]
