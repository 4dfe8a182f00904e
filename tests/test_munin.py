"""The munin plugin, run by the real ``munin-run`` against a live server.

munin-run reads a plugin directory and a plugin-conf directory; each test builds
both in tmp_path (the plugin linked in under the name munin-node would see) and
runs the plugin with the system python, as munin-node does.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import trio
import trio.testing

from elockd.daemon.server import make_service, serve
from elockd.protocol.config import Config
from tests.support.foreign_service import foreign_service
from tests.support.line_client import RunningServer

PLUGIN = Path(__file__).resolve().parent.parent / "munin" / "elockd_"


def munin_run() -> str:
    path = shutil.which("munin-run") or "/usr/sbin/munin-run"
    if not os.path.exists(path):
        pytest.fail("munin-run is not installed (.ci/run installs it: apt-get install munin-node)")
    return path


class Munin:
    """A plugin dir and plugin config for one linked instance of ``elockd_``."""

    def __init__(self, root: Path, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.plugins = root / "plugins"
        self.conf = root / "plugin-conf.d"
        self.plugins.mkdir(parents=True)
        self.conf.mkdir()
        (self.plugins / name).symlink_to(PLUGIN)
        lines = ["[elockd_*]"]
        if os.geteuid() == 0:
            lines.append("user root")  # the default, nobody, cannot read tmp_path
        lines += [f"env.{key} {value}" for key, value in env.items()]
        (self.conf / "elockd").write_text("\n".join(lines) + "\n")
        self.node_conf = root / "munin-node.conf"
        self.node_conf.write_text("")

    async def run(self, *args: str) -> tuple[int, str, str]:
        result = await trio.run_process(
            [
                munin_run(),
                "--config",
                str(self.node_conf),
                "--servicedir",
                str(self.plugins),
                "--sconfdir",
                str(self.conf),
                self.name,
                *args,
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        return result.returncode, result.stdout.decode(), result.stderr.decode()


def graphs(output: str) -> dict[str, dict[str, str]]:
    """multigraph name -> {"field.attribute" or graph_* key: value}."""
    result: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in output.splitlines():
        key, _, rest = line.partition(" ")
        if key == "multigraph":
            current = result.setdefault(rest, {})
        else:
            current[key] = rest
    return result


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens there any more


def test_plugin_is_executable_and_stdlib_only() -> None:
    assert os.access(PLUGIN, os.X_OK)
    assert PLUGIN.read_text().startswith("#!/usr/bin/env python3\n")


async def test_config_declares_every_graph(tmp_path: Path, server: RunningServer) -> None:
    munin = Munin(tmp_path, f"elockd_{server.port}", {"host": "127.0.0.1"})
    code, out, err = await munin.run("config")
    assert (code, err) == (0, "")
    config = graphs(out)
    base = f"elockd_{server.port}"
    names = "connections locks commands orphans throttle invalid".split()
    assert set(config) == {f"{base}_{name}" for name in names}
    locks = config[f"{base}_locks"]
    assert locks["locks.label"] == "exclusive keys"
    assert locks["shared_locks.label"] == "shared keys"
    assert locks["shared_holders.label"] == "shared holders"
    assert locks["locks.type"] == "GAUGE"
    commands = config[f"{base}_commands"]
    assert commands["command_g.type"] == "DERIVE"
    assert commands["command_lock_shared.min"] == "0"
    assert config[f"{base}_invalid"]["invalid_commands.type"] == "DERIVE"
    assert locks["throttles.type"] == "GAUGE"  # keys with state now
    throttle = config[f"{base}_throttle"]
    assert (throttle["admitted.type"], throttle["throttled.type"]) == ("DERIVE", "DERIVE")
    assert throttle["throttled.label"] == "throttled (409)"
    assert commands["command_throttle.type"] == "DERIVE"
    assert config[f"{base}_orphans"]["orphans.type"] == "DERIVE"
    assert f"127.0.0.1:{server.port}" in config[f"{base}_connections"]["graph_title"]


async def test_values_match_q(tmp_path: Path, server: RunningServer) -> None:
    """The port comes from the link's numeric suffix; every value is the `q` one."""
    a, b, c = await server.connect(), await server.connect(), await server.connect()
    for client, request, reply in [
        (a, b"g x", b"1 Got Lock"),
        (a, b"g y", b"1 Got Lock"),
        (a, b"sg s", b"1 Got Lock"),
        (b, b"lock_shared s", b"200 2"),
        (b, b"bogus", b"0 Invalid Command: bogus"),
        (b, b"ping", b"200 PONG"),
    ]:
        assert await client.request(request) == reply
    for verdict in (b"200 ", b"200 ", b"409 "):  # throttles: 1, admitted: 2, throttled: 1
        assert (await a.request(b"throttle api 2 60")).startswith(verdict)
    assert await c.request(b"g gone") == b"1 Got Lock"
    await c.aclose()  # an orphan
    await b.send(b"lock x 100\n")  # waits
    await trio.testing.wait_all_tasks_blocked()

    munin = Munin(tmp_path, f"elockd_{server.port}", {})
    code, out, err = await munin.run()
    assert (code, err) == (0, "")
    await trio.testing.wait_all_tasks_blocked()  # the server saw the plugin hang up
    q = await a.stats()

    fields = {
        key.removesuffix(".value"): value
        for graph in graphs(out).values()
        for key, value in graph.items()
    }
    assert q["orphans"] == 1 and q["waiting"] == 1 and q["shared_holders"] == 2
    assert (q["throttles"], q["admitted"], q["throttled"]) == (1, 2, 1)
    for field, shown in fields.items():
        expected = q.get(field, 0)  # a verb never used is absent from q
        if field in ("connections", "sessions"):
            expected += 1  # the plugin's own connection, closed since
        elif field == "command_q":
            expected -= 1  # this q counted itself
        assert int(shown) == expected, field
    assert {"connections", "locks", "shared_locks", "shared_holders", "command_g"} <= set(fields)
    assert {"throttles", "admitted", "throttled", "command_throttle"} <= set(fields)


async def test_autoconf_and_suggest(tmp_path: Path, server: RunningServer) -> None:
    munin = Munin(tmp_path, "elockd_main", {"host": "127.0.0.1", "port": str(server.port)})
    assert await munin.run("autoconf") == (0, "yes\n", "")
    assert await munin.run("suggest") == (0, f"{server.port}\n", "")


async def test_server_down(tmp_path: Path) -> None:
    port = closed_port()
    munin = Munin(tmp_path, f"elockd_{port}", {})
    code, out, err = await munin.run()
    assert code == 3  # cannot tell
    assert f"cannot reach elockd at 127.0.0.1:{port}: Connection refused" in err
    values = [line.split(" ")[1] for line in out.splitlines() if ".value " in line]
    assert values and set(values) == {"U"}  # unknown: a gap in the graphs, not a zero
    code, out, _ = await munin.run("autoconf")
    assert code == 0
    assert out.startswith(f"no (cannot reach elockd at 127.0.0.1:{port}")
    assert await munin.run("suggest") == (0, "", "")
    code, out, err = await munin.run("config")  # config needs no server
    assert (code, err) == (0, "")
    assert f"elockd_{port}_locks" in graphs(out)


def unknown_values(output: str) -> set[str]:
    values = {line.split(" ")[1] for line in output.splitlines() if ".value " in line}
    assert values, output
    return values


async def start_with_token(nursery: trio.Nursery, tmp_path: Path) -> int:
    token = tmp_path / "token"
    token.write_text("letmein\n")
    config = Config(host="127.0.0.1", port=0, metrics_port=0, auth_token_file=str(token))
    addresses = await nursery.start(serve, config, make_service(config))
    port: int = addresses[0][1]
    return port


async def test_a_token_the_server_wants_is_said_not_timed_out(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Without env.token the server answers `q` with ``0 Auth Required`` and no END:
    the plugin says so at once (with a timeout far beyond the test's), draws gaps,
    and exits 3, "cannot tell"."""
    port = await start_with_token(nursery, tmp_path)
    munin = Munin(tmp_path / "anonymous", f"elockd_{port}", {"timeout": "600"})
    with trio.fail_after(60):
        code, out, err = await munin.run()
    assert code == 3
    assert "auth required (0 Auth Required): set env.token" in err and "timed out" not in err
    assert unknown_values(out) == {"U"}
    code, out, _ = await munin.run("autoconf")
    assert code == 0 and out.startswith("no (") and "auth required" in out
    refused = Munin(tmp_path / "refused", f"elockd_{port}", {"token": "guess"})
    code, out, err = await refused.run()
    assert code == 3 and "refused env.token: auth refused (403 Bad Token)" in err
    assert unknown_values(out) == {"U"}
    good = Munin(tmp_path / "good", f"elockd_{port}", {"token": "letmein"})
    code, out, err = await good.run()
    assert (code, err) == (0, "") and "U" not in unknown_values(out)


async def test_a_foreign_service_is_no_server_and_no_timeout(tmp_path: Path) -> None:
    with foreign_service() as port:
        munin = Munin(tmp_path, f"elockd_{port}", {"timeout": "600"})
        with trio.fail_after(60):
            code, out, err = await munin.run()
    assert code == 3
    assert f"127.0.0.1:{port} is not elockd? it answered `q` with 'SSH-2.0-OpenSSH" in err
    assert unknown_values(out) == {"U"}


@pytest.mark.parametrize(
    "env, complaint",
    [
        ({"port": "abc"}, "env.port 'abc' is not a port number"),
        ({"port": "70000"}, "env.port '70000' is not a port number"),
        ({"timeout": "soon"}, "env.timeout 'soon' is not a number of seconds"),
    ],
)
async def test_bad_settings_are_named_in_one_line(
    tmp_path: Path, env: dict[str, str], complaint: str
) -> None:
    munin = Munin(tmp_path, "elockd_main", env)
    for command in ("config", "fetch"):
        code, out, err = await munin.run(command)
        assert (code, out) == (2, "")
        [line] = err.splitlines()  # one line, no traceback
        assert line.startswith(f"elockd_: {complaint}")
