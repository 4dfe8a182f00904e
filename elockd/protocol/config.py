"""Every setting of the server in one place, with the defaults the docs promise.

Each field is one flag (``max_ttl`` is ``--max-ttl``), also read from the
environment (``ELOCKD_MAX_TTL``) and from a TOML file (``max_ttl = 3600``):
:mod:`elockd.daemon.main` fills it from all three.

It lives beside the request layer, the lowest layer that reads it (through
:attr:`elockd.protocol.connection.Service.config`), so that every layer above can
too without importing the process (:mod:`elockd.daemon`). It is a plain value: no
I/O, no imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 9999
    unix: str | None = None
    # The Unix socket's file mode, in octal digits: set exactly, whatever the umask.
    unix_mode: str = "0660"
    metrics_host: str = "127.0.0.1"
    # Host names (besides IP addresses, localhost and --metrics-host) a browser may
    # use to reach the HTTP port's WebSocket; comma-separated.
    http_allowed_hosts: str = ""
    metrics_port: int = 9998
    # HTTP connections (scrapers, health checks) at once, and how long one may idle.
    metrics_max_connections: int = 32
    metrics_idle_timeout: float = 10.0
    # /metrics is rendered at most once per this many seconds (0: on every scrape).
    metrics_cache: float = 1.0
    replies: str = "elockd"
    max_connections: int = 10_000
    max_line: int = 4096
    max_keys: int = 64
    max_waiters: int = 10_000
    max_holds: int = 10_000
    # Throttle keys with state (a TAT in the future) at once.
    max_throttles: int = 1_000_000
    # `watch` streams at once, and the bytes of events one may owe before OVERFLOW.
    max_watchers: int = 100
    watch_buffer: int = 1 << 20
    # Sessions without a connection (in grace or owning leases) kept at once.
    max_sessions: int = 10_000
    # The longest WAIT, wait=, ttl= and set_timeout a request may ask for, in seconds.
    max_ttl: float = 86_400.0
    # How long a dropped connection's plain holds stay for a conn_id takeover, in
    # seconds (the starting value of each session's set_timeout).
    grace: float = 0.0
    idle_timeout: float | None = None
    send_timeout: float = 30.0
    handshake_timeout: float = 10.0
    # TCP keepalive and TCP_USER_TIMEOUT: a vanished peer is noticed within this many
    # seconds (0 keeps the operating system's defaults).
    keepalive: float = 30.0
    # A failed `auth` is answered only after this long, so guessing tokens is slow.
    auth_failure_delay: float = 1.0
    auth_token_file: str | None = None
    # The operators' token: `auth` with it marks a connection that may `kill`.
    admin_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Zero-downtime upgrade (docs/upgrade.md): where this process waits for a
    # successor, where it finds its predecessor, and how long either side may take.
    control_socket: str | None = None
    take_over: str | None = None
    handover_timeout: float = 10.0
    log_level: str = "info"
    log_format: str = "text"
    # The etcd backend (docs/cluster.md): off unless --etcd names endpoints.
    etcd: str | None = None
    etcd_prefix: str = "/elockd/"
    session_ttl: int = 5
    etcd_timeout: float = 3.0
    etcd_in_flight: int = 16
    # A throttle line's head whose node has not taken its turn this many seconds
    # after it came is passed over (under --session-ttl).
    throttle_line_grace: float = 1.0
