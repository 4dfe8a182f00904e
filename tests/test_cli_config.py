"""Settings from flags, ``ELOCKD_*`` variables and a TOML file: precedence, the
same validation everywhere, and one-line refusals that name the culprit."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from elockd import __version__
from elockd.daemon.main import (
    UsageError,
    build_parser,
    etcd_endpoints,
    load_config,
    setting_actions,
)
from elockd.protocol.config import Config


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_every_setting_is_a_flag_a_variable_and_a_key() -> None:
    actions = setting_actions(build_parser())
    assert {field.name for field in dataclasses.fields(Config)} <= set(actions)
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        assert actions[field.name].option_strings == [flag], field.name


def test_defaults_when_nothing_is_given() -> None:
    assert load_config([], {}) == (Config(), [])


def test_precedence_flags_then_environment_then_file(tmp_path: Path) -> None:
    file = write(tmp_path / "elockd.toml", "port = 7001\nmetrics_port = 7101\nmax_keys = 3\n")
    environ = {"ELOCKD_PORT": "7002", "ELOCKD_METRICS_PORT": "7102"}
    config, _ = load_config(["--config", file, "--port", "7003"], environ)
    assert (config.port, config.metrics_port, config.max_keys) == (7003, 7102, 3)


def test_the_environment_alone_sets_the_port() -> None:
    config, _ = load_config([], {"ELOCKD_PORT": "7005"})
    assert config.port == 7005


def test_a_file_named_in_the_environment(tmp_path: Path) -> None:
    file = write(tmp_path / "elockd.toml", 'host = "::1"\nlog_format = "json"\n')
    config, _ = load_config([], {"ELOCKD_CONFIG": file})
    assert (config.host, config.log_format) == ("::1", "json")


def test_file_values_of_every_toml_type_a_flag_takes(tmp_path: Path) -> None:
    file = write(
        tmp_path / "elockd.toml",
        'max_ttl = 60\nsend_timeout = 2.5\nreplies = "glockd"\n'
        'etcd = ["127.0.0.1:2379", "https://etcd.example:2379"]\n',
    )
    config, _ = load_config(["--config", file], {})
    assert config.max_ttl == 60.0 and config.send_timeout == 2.5
    assert config.replies == "glockd"
    assert config.etcd == "http://127.0.0.1:2379,https://etcd.example:2379"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot = 1\n", "--config {file}: unknown key 'prot' (did you mean port?)"),
        ("metrics-port = 1\n", "--config {file}: unknown key 'metrics-port' (did you mean"),
        ("port = 99999\n", "--config {file}: port = 99999: a port number 0-65535"),
        ("port = true\n", "--config {file}: port: a number or a string, not True"),
        ('replies = "nope"\n', "--config {file}: replies = 'nope': one of elockd, glockd"),
        ("port = \n", "--config {file}: not valid TOML"),
        ('config = "other.toml"\n', "--config {file}: unknown key 'config'"),
    ],
)
def test_file_mistakes_are_refused_by_name(tmp_path: Path, text: str, message: str) -> None:
    file = write(tmp_path / "elockd.toml", text)
    with pytest.raises(UsageError) as refused:
        load_config(["--config", file], {})
    assert str(refused.value).startswith(message.format(file=file))


def test_a_missing_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"^--config /nonexistent\.toml: No such file"):
        load_config(["--config", "/nonexistent.toml"], {})


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("ELOCKD_PORT", "99999", "ELOCKD_PORT=99999: a port number 0-65535, not '99999'"),
        ("ELOCKD_MAX_TTL", "inf", "ELOCKD_MAX_TTL=inf: a number of seconds above 0, not 'inf'"),
        ("ELOCKD_MAX_KEYS", "lots", "ELOCKD_MAX_KEYS=lots: a whole number, 1 or more, not 'lots'"),
        ("ELOCKD_LOG_FORMAT", "xml", "ELOCKD_LOG_FORMAT=xml: one of text, json, not 'xml'"),
        ("ELOCKD_ETCD", "ftp://x", "ELOCKD_ETCD=ftp://x: 'ftp://x' is not host:port"),
    ],
)
def test_environment_values_go_through_the_flags_types(
    variable: str, value: str, message: str
) -> None:
    with pytest.raises(UsageError) as refused:
        load_config([], {variable: value})
    assert str(refused.value).startswith(message)


def test_empty_and_unknown_variables_change_nothing() -> None:
    config, notes = load_config([], {"ELOCKD_PORT": "", "ELOCKD_PROT": "1", "PORT": "2"})
    assert config == Config()
    assert notes == ["ELOCKD_PROT is not an elockd setting (did you mean ELOCKD_PORT?); ignored"]
    _, notes = load_config([], {"ELOCKD_ZZZZZZ": "1"})
    assert notes == ["ELOCKD_ZZZZZZ is not an elockd setting; ignored"]


def test_grace_is_in_seconds_and_grace_ms_is_a_deprecated_alias(tmp_path: Path) -> None:
    assert load_config(["--grace", "2.5"], {})[0].grace == 2.5
    config, notes = load_config(["--grace-ms", "1500"], {})
    assert config.grace == 1.5
    assert notes == ["--grace-ms is deprecated: use --grace 1.5 (seconds)"]
    assert load_config([], {"ELOCKD_GRACE_MS": "250"})[0].grace == 0.25
    file = write(tmp_path / "elockd.toml", "grace_ms = 100\n")
    assert load_config(["--config", file, "--grace", "3"], {})[0].grace == 3.0
    with pytest.raises(UsageError, match="--grace and --grace-ms both given"):
        load_config(["--grace", "1", "--grace-ms", "1"], {})


@pytest.mark.parametrize(
    ("given", "urls"),
    [
        ("127.0.0.1:2379", "http://127.0.0.1:2379"),
        ("a:1, b:2", "http://a:1,http://b:2"),
        ("https://etcd.example:2379/", "https://etcd.example:2379"),
        ("[::1]:2379", "http://[::1]:2379"),
        ("http://user:secret@h:2379", "http://user:secret@h:2379"),
    ],
)
def test_etcd_endpoints_are_read_as_etcdctl_reads_them(given: str, urls: str) -> None:
    assert etcd_endpoints(given) == urls


@pytest.mark.parametrize("given", ["ftp://h:1", "h", "h:port", "h:99999", "http://", ",", ""])
def test_unparseable_etcd_endpoints_are_refused(given: str) -> None:
    with pytest.raises(UsageError, match="^ELOCKD_ETCD="):
        load_config([], {"ELOCKD_ETCD": given} if given else {"ELOCKD_ETCD": " "})


def test_cluster_max_keys_above_one_transaction_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"^--max-keys 65: at most 64 with --etcd"):
        load_config(["--etcd", "h:2379", "--max-keys", "65"], {})


# ------------------------------------------------------------ the real command


def elockd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elockd", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


async def test_etcd_in_flight_is_the_window_of_a_nodes_etcd_client() -> None:
    from elockd.backend.cluster.space import ClusterLockSpace
    from elockd.daemon.server import make_cluster_backend

    backend = make_cluster_backend(Config(etcd="http://127.0.0.1:9", etcd_in_flight=5))
    assert isinstance(backend, ClusterLockSpace)
    assert backend.client._limiter.total_tokens == 5
    await backend.client.aclose()


async def test_throttle_line_grace_reaches_a_nodes_throttles(tmp_path: Path) -> None:
    from elockd.backend.cluster.space import ClusterLockSpace
    from elockd.daemon.server import make_cluster_backend

    file = write(tmp_path / "elockd.toml", "throttle_line_grace = 0.25\n")
    assert load_config(["--config", file], {})[0].throttle_line_grace == 0.25
    config, _ = load_config(["--etcd", "127.0.0.1:9"], {"ELOCKD_THROTTLE_LINE_GRACE": "0.5"})
    backend = make_cluster_backend(config)
    assert isinstance(backend, ClusterLockSpace)
    assert backend.throttles.line_grace == 0.5
    await backend.client.aclose()
    with pytest.raises(UsageError, match="--throttle-line-grace 3: not under --session-ttl 3"):
        load_config(["--throttle-line-grace", "3", "--session-ttl", "3"], {})


def test_version_comes_from_the_package_metadata() -> None:
    result = elockd("--version")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"elockd {__version__}\n", "")
    assert __version__ == importlib.metadata.version("elockd")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "99999"], "argument --port: a port number 0-65535, not '99999'"),
        (["--metrics-port", "-1"], "argument --metrics-port: a port number 0-65535"),
        (["--etcd", "ftp://x"], "argument --etcd: 'ftp://x' is not host:port"),
        (["--max-ttl", "nan"], "argument --max-ttl: a number of seconds above 0, not 'nan'"),
        (["--etcd-in-flight", "0"], "argument --etcd-in-flight: a whole number, 1 or more"),
        (["--throttle-line-grace", "0"], "argument --throttle-line-grace: a number of seconds"),
        (["--tls-key", "k.pem"], "elockd: --tls-key and --tls-client-ca need --tls-cert"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_exit_2_in_at_most_3_lines(args: list[str], named: str) -> None:
    result = elockd(*args)
    assert result.returncode == 2
    assert named in result.stderr
    assert len(result.stderr.splitlines()) <= 3, result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_config_key_exits_2_naming_it(tmp_path: Path) -> None:
    file = write(tmp_path / "elockd.toml", "max_conections = 5\n")
    result = elockd("--config", file)
    assert result.returncode == 2
    assert result.stderr == (
        f"elockd: --config {file}: unknown key 'max_conections' (did you mean max_connections?)\n"
    )


def test_help_names_every_option_without_python_internals() -> None:
    result = elockd("--help")
    assert result.returncode == 0
    assert "(default: None)" not in result.stdout
    assert "ELOCKD_" in result.stdout
    for action in setting_actions(build_parser()).values():
        assert action.option_strings[0] in result.stdout
        assert action.help, action.dest
