"""A paused node says nothing about a hold after another node granted it: two real
nodes over a real etcd, a real ``SIGSTOP`` (docs/cluster.md, "Every reply about a
hold: the deadline gate").

Node A's client holds K and a client of node B waits for it. Clients of A ask
``info K`` and ``ls K`` without pause, so that some of A's etcd reads are in
flight when A is stopped: etcd answers them while A sleeps, and A reads the answers
when it resumes. etcd lapses A's lease, B grants K, A is continued. Whatever A says
about K from then on, none of it may name the old holder: every reply received
after B's grant was made after the ``SIGCONT`` (A sent nothing while stopped, and
what it sent before was read at once), so a reply naming the old holder would be a
hold confirmed after another node's grant. Before the gate, ``info`` did so (its
etcd reads came back, the reply was made without a second look at the deadline).

Real time, ~15 s: marked ``serial`` (run alone, after the rest, as ``make test``
does).
"""

from __future__ import annotations

import collections

import pytest
import trio

from tests.support.cluster_nodes import TEST_SESSION_TTL, Nodes
from tests.support.line_client import LineClient
from tests.support.polling import until_waiting

pytestmark = [pytest.mark.cluster, pytest.mark.serial]

TTL = TEST_SESSION_TTL
READERS = 6  # per verb: enough that a read is in flight whenever A is stopped


async def ask_forever(client: LineClient, line: bytes, heard: list[tuple[float, bytes]]) -> None:
    """Send ``line``, read the reply (an ``ls`` to ``END``, or its one-line refusal),
    again, until the connection ends; every line with the time it was received."""
    try:
        while True:
            await client.send(line + b"\n")
            first = True
            while True:
                reply = await client.line()
                heard.append((trio.current_time(), reply))
                if not line.startswith(b"ls") or reply == b"END\r\n":
                    break
                if first and reply.startswith(b"409 "):
                    break  # refused before any row: no END follows
                first = False
    except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
        return


async def test_a_paused_node_confirms_no_hold_after_another_node_granted_it(
    nodes: Nodes,
) -> None:
    a, b = nodes.start(), nodes.start()
    heard: list[tuple[float, bytes]] = []
    with trio.fail_after(15):
        holder, waiter, third = await a.connect(), await b.connect(), await b.connect()
        assert await holder.request(b"iam old-holder") == b"1 ok"
        assert await holder.request(b"lock K") == b"200 Acquired"
        await waiter.send(b"lock K 60\n")
        await until_waiting(third, b"K", 1)
        readers = [await a.connect() for _ in range(2 * READERS)]
    async with trio.open_nursery() as nursery:
        for number, reader in enumerate(readers):
            line = b"info K" if number % 2 else b"ls K"
            nursery.start_soon(ask_forever, reader, line, heard)
        await trio.sleep(1.0)  # the readers are going
        assert any(b"exclusive=old-holder" in reply for _, reply in heard)
        a.stop()
        try:
            with trio.fail_after(2 * TTL + 3):
                assert await waiter.line() == b"200 Acquired\r\n"
            granted = trio.current_time()
            await trio.sleep(2.0)  # A stays stopped well past B's grant
        finally:
            a.cont()
        await trio.sleep(3.0)  # what A says once it runs again
        nursery.cancel_scope.cancel()
    late = [reply for at, reply in heard if at > granted and b"exclusive=old-holder" in reply]
    after = [reply for at, reply in heard if at > granted]
    kinds = collections.Counter(reply.split(b"=", 2)[0][:40] for reply in after)
    print(f"{len(heard)} replies, {len(after)} after B's grant: {dict(kinds)}")
    assert late == [], f"A named the old holder after B's grant: {late[:5]}"
    for client in (holder, waiter, third, *readers):
        await client.aclose()
