"""``kill K`` and ``--admin-token-file`` over TCP (docs/protocol.md: Operators, Access).

The contract tests take ``lock_server`` and ``clock`` (its tokens set by this
module's ``server_config``), so they run on both backends: in memory on a mock
clock, and on a cluster node in real time.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing

from elockd.client import Client, Hold, LockLost
from elockd.daemon.server import make_service, serve
from elockd.net.metrics import make_registry
from elockd.protocol.config import Config
from tests.support.line_client import LineClient, RunningServer
from tests.support.polling import until_waiting

LOCK_TOKEN = b"lock-token"
ADMIN_TOKEN = b"admin-token"


@pytest.fixture
def server_config(tmp_path: Path) -> Config:
    """Both tokens: clients `auth` with the lock token, operators with the admin one."""
    (tmp_path / "token").write_bytes(LOCK_TOKEN + b"\n")
    (tmp_path / "admin").write_bytes(ADMIN_TOKEN + b"\n")
    return Config(
        auth_token_file=str(tmp_path / "token"),
        admin_token_file=str(tmp_path / "admin"),
        auth_failure_delay=0.0,
    )


async def client_with(server: RunningServer, token: bytes, name: bytes | None = None) -> LineClient:
    client = await server.connect()
    assert await client.request(b"auth " + token) == b"200 OK"
    if name is not None:
        assert await client.request(b"iam " + name) == b"1 ok"
    return client


async def token_of(client: LineClient, key: bytes) -> int:
    reply = await client.request(b"token " + key)
    assert reply.startswith(b"200 "), reply
    return int(reply[4:])


async def test_kill_frees_every_hold_and_fences_the_evicted_holder(
    lock_server: RunningServer,
    clock: trio.testing.MockClock | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = lock_server
    caplog.set_level(logging.WARNING, logger="elockd")
    holder = await client_with(server, LOCK_TOKEN, b"stuck-job")
    waiter = await client_with(server, LOCK_TOKEN, b"next-job")
    readers = [await client_with(server, LOCK_TOKEN, b"reader%d" % i) for i in range(2)]
    admin = await client_with(server, ADMIN_TOKEN)
    assert await holder.request(b"lock nightly/report 0 ttl=600") == b"200 Acquired"
    killed_token = await token_of(holder, b"nightly/report")
    for reader in readers:
        assert (await reader.request(b"lock_shared nightly/report")).startswith(b"200 ")
    await waiter.send(b"lock nightly/report 600\n")
    await until_waiting(admin, b"nightly/report")

    assert await admin.request(b"kill nightly/report") == b"200 Killed 3"
    # The waiter is served as on a release, with a larger fencing token.
    assert await waiter.line() == b"200 Acquired\r\n"
    assert await token_of(waiter, b"nightly/report") > killed_token
    # The evicted session sees the key as not held.
    assert await holder.request(b"token nightly/report") == b"403 Not Locked"
    assert await holder.request(b"unlock nightly/report") == b"403 Not Locked"
    assert await holder.request(b"renew nightly/report ttl=60") == b"403 Not Locked"
    for reader in readers:
        assert await reader.request(b"unlock_shared nightly/report") == b"403 Not Locked"
    stats = await admin.stats()
    assert stats["killed"] == 3 and stats["locks"] == 1 and stats["shared_locks"] == 0
    assert stats["leases"] == 0  # the killed lease went with its hold
    assert make_registry(server.service).get_sample_value("elockd_killed_total") == 3

    (record,) = [r for r in caplog.records if r.getMessage() == "kill"]
    assert record.levelno == logging.WARNING
    admin_port = admin.stream.socket.getsockname()[1]
    assert record.peer == f"127.0.0.1:{admin_port}"  # type: ignore[attr-defined]
    assert record.key == "nightly/report"  # type: ignore[attr-defined]
    assert record.freed == 3  # type: ignore[attr-defined]
    evicted = str(record.evicted)  # type: ignore[attr-defined]
    holder_port = holder.stream.socket.getsockname()[1]
    assert f"stuck-job (127.0.0.1:{holder_port}) exclusive token={killed_token}" in evicted
    assert "reader0 (" in evicted and "reader1 (" in evicted and evicted.count("shared") == 2
    assert "next-job" not in evicted


async def test_kill_needs_the_admin_token(
    lock_server: RunningServer, clock: trio.testing.MockClock | None
) -> None:
    server = lock_server
    holder = await client_with(server, LOCK_TOKEN)
    assert await holder.request(b"lock k") == b"200 Acquired"
    assert await holder.request(b"kill k") == b"403 Forbidden"
    # Refused before its key is read (the line's shape is checked first, as for
    # every verb): a non-operator learns nothing of the key.
    assert await holder.request(b"kill") == b"403 Forbidden"
    unauthenticated = await server.connect()
    assert await unauthenticated.request(b"kill k") == b"403 Auth Required"
    admin = await client_with(server, ADMIN_TOKEN)
    # The admin token passes wherever the lock token does: an operator can lock too.
    assert await admin.request(b"lock mine") == b"200 Acquired"
    assert await admin.request(b"kill free-key") == b"200 Killed 0"
    assert await admin.request(b"kill") == b"400 Bad Request: missing key"
    await token_of(holder, b"k")  # still held
    assert (await admin.stats())["killed"] == 0


async def test_the_clients_on_lost_fires_at_the_next_renewal_release_or_check_after_a_kill(
    lock_server: RunningServer, clock: trio.testing.MockClock | None
) -> None:
    server = lock_server
    lost: list[Hold] = []
    admin = await client_with(server, ADMIN_TOKEN)
    async with Client("127.0.0.1", server.port, auth_token=LOCK_TOKEN) as client:
        lease = await client.acquire("jobs/lease", ttl=3, on_lost=lost.append)
        plain = await client.acquire("jobs/plain", on_lost=lost.append)
        assert await admin.request(b"kill jobs/lease") == b"200 Killed 1"
        assert await admin.request(b"kill jobs/plain") == b"200 Killed 1"
        assert lost == [] and lease.held  # nothing told the client yet
        await trio.sleep(1.5)  # past a third of the ttl: the renewal is refused
        assert lost == [lease] and lease.lost
        assert lease.lost_reason == "renewal refused (403 Not Locked)"
        with pytest.raises(LockLost):
            await client.release(plain)
        assert lost == [lease, plain] and plain.lost
        # A check asks the server at once (``token K``), without waiting for either.
        checked = await client.acquire("jobs/checked", on_lost=lost.append)
        assert await client.check(checked) is True and lost == [lease, plain]
        assert await admin.request(b"kill jobs/checked") == b"200 Killed 1"
        assert await client.check(checked) is False
        assert lost == [lease, plain, checked] and checked.lost
        assert checked.lost_reason == "the server no longer has it (token jobs/checked: 403)"


async def start(nursery: trio.Nursery, config: Config) -> RunningServer:
    config = replace(config, host="127.0.0.1", port=0, metrics_port=0, auth_failure_delay=0.0)
    service = make_service(config)
    addresses = await nursery.start(serve, config, service)
    return RunningServer(int(addresses[0][1]), service, config, [])


async def test_without_the_flag_kill_is_always_forbidden(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    (tmp_path / "token").write_bytes(LOCK_TOKEN)
    for config in (Config(), Config(auth_token_file=str(tmp_path / "token"))):
        server = await start(nursery, config)
        client = await server.connect()
        assert await client.request(b"auth " + LOCK_TOKEN) == b"200 OK"
        assert await client.request(b"lock k") == b"200 Acquired"
        assert await client.request(b"kill k") == b"403 Forbidden"
        await client.aclose()


async def test_with_only_an_admin_token_requests_need_no_auth_but_a_wrong_one_fails(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    (tmp_path / "admin").write_bytes(ADMIN_TOKEN)
    server = await start(nursery, Config(admin_token_file=str(tmp_path / "admin")))
    client = await server.connect()
    assert await client.request(b"lock k") == b"200 Acquired"
    assert await client.request(b"kill k") == b"403 Forbidden"
    guesser = await server.connect()
    assert await guesser.request(b"auth guess") == b"403 Bad Token"
    assert await guesser.at_eof()
    admin = await server.connect()
    assert await admin.request(b"auth " + ADMIN_TOKEN) == b"200 OK"
    assert await admin.request(b"kill k") == b"200 Killed 1"
    assert await client.request(b"token k") == b"403 Not Locked"


def test_an_admin_token_equal_to_the_lock_token_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("same\n")
    (tmp_path / "admin").write_text("same")
    result = subprocess.run(
        [sys.executable, "-m", "elockd", "--port", "0", "--metrics-port", "0",
         "--auth-token-file", str(tmp_path / "token"),
         "--admin-token-file", str(tmp_path / "admin")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"elockd: --admin-token-file {tmp_path / 'admin'}: the same token as "
        f"--auth-token-file {tmp_path / 'token'} (every client could kill)"
    ]


async def read_snapshot(client: LineClient) -> list[bytes]:
    assert await client.line() == b"200 Watching\r\n"
    lines = []
    while (line := await client.line()) != b"SYNCED\r\n":
        lines.append(line)
    return lines


async def test_watch_streams_a_snapshot_then_grants_and_frees_with_their_reasons(
    lock_server: RunningServer, clock: trio.testing.MockClock | None
) -> None:
    """``watch`` on both backends: the snapshot, ``SYNCED``, then each change in
    order, a kill's free named ``killed``."""
    server = lock_server
    holder = await client_with(server, LOCK_TOKEN, b"alice")
    admin = await client_with(server, ADMIN_TOKEN)
    assert await holder.request(b"lock jobs/a") == b"200 Acquired"
    assert await holder.request(b"lock_shared jobs/b") == b"200 1"
    assert await holder.request(b"lock other/c") == b"200 Acquired"
    token = await token_of(holder, b"jobs/a")
    # ls answers once the node shows what it granted (on a cluster, its mirror):
    # the snapshot then shows it too.
    assert len(await admin.listing(b"ls")) > 0
    watcher = await client_with(server, LOCK_TOKEN)
    await watcher.send(b"watch jobs/\n")
    assert await read_snapshot(watcher) == [
        b"+ jobs/a exclusive alice token=%d\r\n" % token,
        b"+ jobs/b shared alice holders=1\r\n",
    ]
    assert await holder.request(b"unlock jobs/a") == b"200 Unlocked"
    assert await holder.request(b"unlock other/c") == b"200 Unlocked"
    assert await holder.request(b"lock jobs/d 0 ttl=0.3") == b"200 Acquired"
    token_d = await token_of(holder, b"jobs/d")
    assert await admin.request(b"kill jobs/b") == b"200 Killed 1"
    with trio.fail_after(10):
        assert await watcher.line() == b"- jobs/a exclusive alice released\r\n"
        assert await watcher.line() == b"+ jobs/d exclusive alice token=%d\r\n" % token_d
        assert token_d > token
        assert await watcher.line() == b"- jobs/b shared alice holders=0 killed\r\n"
        if clock is not None:
            clock.jump(1)
        assert await watcher.line() == b"- jobs/d exclusive alice expired\r\n"
    assert await watcher.request(b"ping") == b"200 Bye"
