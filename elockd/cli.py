"""Command line: flags -> :class:`~elockd.config.Config` -> run the server."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import trio

from elockd.config import Config
from elockd.replies import STYLES
from elockd.server import run_until_signal


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a number above 0")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError("must be a number, 0 or more")
    return value


def session_ttl(text: str) -> int:
    """etcd raises lease TTLs below its own minimum (about 1.5 election timeouts,
    2 s at etcd's defaults) anyway; asking for less would only mislead."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("must be at least 2 seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="elockd",
        description="Network lock server: exclusive and counted shared locks owned by "
        "a connection, freed when it goes away.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--host", default=defaults.host, help="address to listen on (127.0.0.1: local only)")
    add("--port", type=non_negative_int, default=defaults.port, help="TCP port (0: any free)")
    add("--unix", metavar="PATH", default=None, help="also listen on this Unix socket")
    add("--metrics-host", default=defaults.metrics_host, help="address of /metrics")
    add(
        "--metrics-port",
        type=non_negative_int,
        default=defaults.metrics_port,
        help="HTTP port of /metrics and /healthz (0: off)",
    )
    add(
        "--metrics-max-connections",
        type=positive_int,
        default=defaults.metrics_max_connections,
        help="HTTP connections at once on the metrics port; more wait in the backlog",
    )
    add(
        "--metrics-idle-timeout",
        type=positive_float,
        default=defaults.metrics_idle_timeout,
        metavar="SECONDS",
        help="close an HTTP connection idle for this long",
    )
    add(
        "--metrics-cache",
        type=non_negative_float,
        default=defaults.metrics_cache,
        metavar="SECONDS",
        help="render /metrics at most once per this long; scrapers in between get the "
        "same text (0: render on every scrape)",
    )
    add(
        "--replies",
        choices=sorted(STYLES),
        default=defaults.replies,
        help="reply texts of the terse family",
    )
    add(
        "--max-connections",
        type=positive_int,
        default=defaults.max_connections,
        help="connections at once; one more is told '0 Too Many Connections'",
    )
    add(
        "--max-line",
        type=positive_int,
        default=defaults.max_line,
        help="longest request line in bytes; longer ones get '0 Line Too Long'",
    )
    add("--max-keys", type=positive_int, default=defaults.max_keys, help="keys per mlock")
    add(
        "--max-waiters",
        type=positive_int,
        default=defaults.max_waiters,
        help="waiting requests per key",
    )
    add(
        "--max-holds",
        type=positive_int,
        default=defaults.max_holds,
        help="holds one session may have at once ('0 Too Many Holds' / '413 Too Many Holds')",
    )
    add(
        "--max-sessions",
        type=positive_int,
        default=defaults.max_sessions,
        help="sessions without a connection (in grace or owning leases) kept at once; "
        "one more ends at once, its holds freed",
    )
    add(
        "--max-ttl",
        type=positive_float,
        default=defaults.max_ttl,
        metavar="SECONDS",
        help="longest WAIT, wait=, ttl= and set_timeout a request may ask for (longer: 400)",
    )
    add(
        "--idle-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="close a connection that sends nothing for this long (off by default; "
        "holders keep theirs open with 'ping')",
    )
    add(
        "--send-timeout",
        type=positive_float,
        default=defaults.send_timeout,
        metavar="SECONDS",
        help="drop a client whose replies cannot be sent for this long (it stopped reading)",
    )
    add(
        "--handshake-timeout",
        type=positive_float,
        default=defaults.handshake_timeout,
        metavar="SECONDS",
        help="time a TLS client has to finish its handshake",
    )
    add(
        "--keepalive",
        type=non_negative_float,
        default=defaults.keepalive,
        metavar="SECONDS",
        help="notice a client host that vanished (no FIN, no RST) within this long "
        "through TCP keepalive (0: the operating system's defaults)",
    )
    add(
        "--auth-failure-delay",
        type=non_negative_float,
        default=defaults.auth_failure_delay,
        metavar="SECONDS",
        help="answer a wrong 'auth' token only after this long (other clients go on)",
    )
    add(
        "--auth-token-file",
        metavar="FILE",
        default=None,
        help="demand 'auth TOKEN' with this file's content as the first request",
    )
    add("--tls-cert", metavar="PEM", default=None, help="serve the lock port over TLS")
    add("--tls-key", metavar="PEM", default=None, help="private key of --tls-cert")
    add(
        "--tls-client-ca",
        metavar="PEM",
        default=None,
        help="require client certificates signed by this CA (mutual TLS)",
    )
    add(
        "--grace-ms",
        type=non_negative_int,
        default=defaults.grace_ms,
        help="default time a dropped connection's holds stay for a conn_id takeover",
    )
    add(
        "--etcd",
        metavar="URL[,URL...]",
        default=None,
        help="keep every lock in this etcd cluster, shared with other elockd nodes "
        "(docs/cluster.md); default: in memory, this process only",
    )
    add("--etcd-prefix", default=defaults.etcd_prefix, help="root of elockd's keys in etcd")
    add(
        "--session-ttl",
        type=session_ttl,
        default=defaults.session_ttl,
        metavar="SECONDS",
        help="with --etcd: a crashed node's locks are freed after this long",
    )
    add(
        "--etcd-timeout",
        type=positive_float,
        default=defaults.etcd_timeout,
        metavar="SECONDS",
        help="with --etcd: give up on etcd after this long and reply 'Backend Unavailable'",
    )
    add(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=defaults.log_level,
    )
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> Config:
    parser = build_parser()
    options = vars(parser.parse_args(argv))
    if (options["tls_key"] or options["tls_client_ca"]) and not options["tls_cert"]:
        parser.error("--tls-key and --tls-client-ca need --tls-cert")
    return Config(**options)


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every etcd request at INFO: thousands a second on a cluster node.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        trio.run(run_until_signal, config)
    except (OSError, ValueError) as error:
        logging.getLogger("elockd").error("cannot start: %s", error)
        return 1
    return 0
