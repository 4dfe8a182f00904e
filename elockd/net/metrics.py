"""Prometheus ``/metrics`` and ``/healthz`` over HTTP, inside the server's trio run.

Why it looks like this:

* The numbers are read from the engine and the connection counters *at scrape
  time* by a custom collector (:class:`ElockdCollector`), so nothing is kept twice
  and the hot path pays nothing but the plain int increments it already does.
* Every value the collector reads is an int kept up to date on the existing paths
  (``len()`` of a table, engine counters, :class:`~elockd.protocol.stats.Buckets`): a scrape
  costs the same with a million locks held as with none. No per-lock work, ever.
* HTTP is hypercorn's trio worker serving a small ASGI app of our own
  (:func:`make_app`: the exposition prometheus-client renders, cached; /healthz;
  the status page's static files),
  in the same trio run as the lock tables: no thread ever touches them, and no HTTP
  parser is written here. A connection whose first request asks for a WebSocket
  goes to :mod:`elockd.net.websocket` instead (a lock session over wsproto).
* The collector lives on its own :class:`~prometheus_client.CollectorRegistry`,
  never the process-global one, so tests can run many servers in one process.

Names follow the Prometheus conventions (``elockd_`` prefix, ``_total`` on
counters, seconds); docs/monitoring.md maps each one to its ``q`` counter.
"""

from __future__ import annotations

import logging
import platform
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any

import trio
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from elockd import __version__
from elockd.net.http import Tune, serve_http
from elockd.net.listening import open_tcp_sockets
from elockd.net.serving import ConnectionSlots, PausableService
from elockd.net.status_page import status_response
from elockd.net.websocket import serve_websocket
from elockd.protocol.connection import Service
from elockd.protocol.stats import Buckets

log = logging.getLogger("elockd")

#: hypercorn's own log ("Running on …", per-connection errors) goes here, at
#: WARNING: elockd logs the metrics address itself, and access logs stay off.
http_log = logging.getLogger("elockd.http")
http_log.setLevel(logging.WARNING)

#: Label ``kind`` by index: the engine's ``shared`` flag, then throttle waits (the
#: hold histograms have the first two only).
KINDS = ("exclusive", "shared", "throttle")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
HttpApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ElockdCollector(Collector):
    """Every elockd metric, read from the service when Prometheus scrapes."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def describe(self) -> Iterable[Metric]:
        # Registering must not collect (the registry would otherwise call
        # collect() to learn the names); our names never clash on our own registry.
        return []

    def collect(self) -> Iterable[Metric]:
        books = self.service.backend.books
        sizes = books.sizes()
        counters = self.service.counters
        timings = self.service.timings

        yield BUILD_INFO
        yield GaugeMetricFamily(
            "elockd_connections", "Client connections open now.", value=counters.connections
        )
        yield GaugeMetricFamily(
            "elockd_sessions",
            "Sessions tracked, with or without a connection (q: sessions).",
            value=sizes.sessions,
        )
        yield GaugeMetricFamily(
            "elockd_sessions_in_grace",
            "Sessions whose connection dropped and whose grace time (set_timeout) runs.",
            value=books.sessions_in_grace,
        )
        keys = GaugeMetricFamily(
            "elockd_keys",
            "Keys held now, per table (q: locks, shared_locks).",
            labels=["kind"],
        )
        keys.add_metric(["exclusive"], sizes.locks)
        keys.add_metric(["shared"], sizes.shared_locks)
        yield keys
        holders = GaugeMetricFamily(
            "elockd_holders",
            "Holds now, per table: one per key for exclusive, every holder for shared.",
            labels=["kind"],
        )
        holders.add_metric(["exclusive"], sizes.locks)
        holders.add_metric(["shared"], sizes.shared_holders)
        yield holders
        yield GaugeMetricFamily(
            "elockd_waiters", "Requests waiting for a grant now (q: waiting).", value=sizes.waiting
        )
        yield GaugeMetricFamily(
            "elockd_leases", "Holds that carry a lease (ttl) now (q: leases).", value=books.leases
        )
        yield CounterMetricFamily(
            "elockd_leases_expired",
            "Leases freed at their deadline (q: expired).",
            value=books.expired,
        )
        yield CounterMetricFamily(
            "elockd_wait_timeouts",
            "Waits that ended without a grant: 409 replies (q: timeouts).",
            value=books.timeouts,
        )
        yield GaugeMetricFamily(
            "elockd_throttles",
            "Throttle keys with state now: their TAT has not passed "
            "(q: throttles; at most --max-throttles).",
            value=sizes.throttles,
        )
        yield CounterMetricFamily(
            "elockd_admitted",
            "throttle requests admitted: 200 replies (q: admitted).",
            value=books.admitted,
        )
        yield CounterMetricFamily(
            "elockd_throttled",
            "throttle requests refused, at once or when their wait ran out: 409 replies "
            "(q: throttled).",
            value=books.throttled,
        )
        orphans = CounterMetricFamily(
            "elockd_orphans",
            "Holds freed because their session ended without releasing them "
            "(q: orphans, shared_orphans).",
            labels=["kind"],
        )
        orphans.add_metric(["exclusive"], books.orphans)
        orphans.add_metric(["shared"], books.shared_orphans)
        yield orphans
        yield CounterMetricFamily(
            "elockd_killed",
            "Holds an operator freed with kill K, exclusive and shared (q: killed).",
            value=books.killed,
        )
        yield CounterMetricFamily(
            "elockd_handovers",
            "Hand-overs to a successor process this server's state went through "
            "(q: handovers; docs/upgrade.md).",
            value=counters.handovers,
        )
        yield CounterMetricFamily(
            "elockd_invalid_commands",
            "Requests with an unknown verb, or lines over --max-line (q: invalid_commands).",
            value=counters.invalid_commands,
        )
        commands = CounterMetricFamily(
            "elockd_commands",
            "Requests per verb, both families (q: command_VERB).",
            labels=["verb"],
        )
        for verb, count in counters.commands.items():
            commands.add_metric([verb.decode("ascii")], count)
        yield commands
        yield histogram(
            "elockd_lock_wait_seconds",
            "Time requests that waited spent waiting, granted or not.",
            timings.wait,
        )
        yield histogram(
            "elockd_lock_hold_seconds",
            "How long holds lasted, from grant to release, disconnect or expiry.",
            timings.hold,
        )
        for name, value in books.extra_counters().items():
            kind, metric, documentation = EXTRA_METRICS[name]
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(metric, documentation, value=value)


#: Which elockd and which Python serve: always 1, the facts are in the labels.
BUILD_INFO = GaugeMetricFamily(
    "elockd_build_info",
    "elockd's version and the Python running it (always 1).",
    labels=["version", "python"],
)
BUILD_INFO.add_metric([__version__, platform.python_version()], 1)

#: The `q` lines only some backends have (a cluster node's), as metrics.
EXTRA_METRICS = {
    "backend_unavailable": (
        "counter",
        "elockd_backend_unavailable",
        "Requests, keepalives and frees etcd did not answer in time (q: backend_unavailable).",
    ),
    "sessions_lost": (
        "counter",
        "elockd_sessions_lost",
        "Sessions whose etcd lease expired under this node; their connections were closed.",
    ),
    "local_waiting": (
        "gauge",
        "elockd_local_waiters",
        "Requests waiting on this node (elockd_waiters counts the whole cluster).",
    ),
}


def histogram(name: str, documentation: str, per_kind: list[Buckets]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=["kind"])
    for kind, buckets in zip(KINDS, per_kind, strict=False):
        family.add_metric([kind], buckets.cumulative(), buckets.sum)
    return family


def make_registry(service: Service) -> CollectorRegistry:
    """A registry of its own: elockd's metrics plus the standard ``process_*`` ones
    (CPU, memory, open file descriptors: connections are descriptors)."""
    registry = CollectorRegistry(auto_describe=False)
    service.feed_timings()  # the histograms are read from here on, so fill them
    registry.register(ElockdCollector(service))
    ProcessCollector(registry=registry)
    return registry


class Exposition:
    """The text of ``/metrics``, rendered at most once per ``max_age`` seconds.

    Rendering walks every metric family (about a millisecond of the event loop that
    the lock clients share); scrapers in a tight loop, or many scrapers at once, get
    the cached text instead, so they cannot take more than that per second however
    often they ask. Prometheus scrapes every 15 s or so and never sees a stale value
    older than ``max_age``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        max_age: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.max_age = max_age
        self.clock = clock
        self.renders = 0  # how many times the registry was actually walked
        self._cache: dict[str, tuple[float, bytes]] = {}

    def get(self, accept: str) -> tuple[bytes, str]:
        """The body and content type for a scraper that sent ``Accept: accept``."""
        encoder, content_type = choose_encoder(accept)
        now = self.clock()
        cached = self._cache.get(content_type)
        if cached is not None and now - cached[0] < self.max_age:
            return cached[1], content_type
        body = encoder(self.registry)
        self.renders += 1
        self._cache[content_type] = (now, body)
        return body, content_type


def make_app(exposition: Exposition) -> HttpApp:
    """``/metrics`` (the cached exposition), ``/healthz``, the status page
    (:mod:`elockd.net.status_page`), 404 elsewhere. WebSocket
    sessions never get here (:mod:`elockd.net.http` hands a connection's first request
    to :mod:`elockd.net.websocket` when it is an upgrade); an upgrade asked later on a
    kept-alive connection is refused (403)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})  # before accept: 403
            return
        if scope["type"] != "http":
            return
        if scope["method"] not in ("GET", "HEAD"):
            await respond(send, 405, b"method not allowed\n", [(b"allow", b"GET, HEAD")])
        elif scope["path"] == "/metrics":
            accept = dict(scope["headers"]).get(b"accept", b"").decode("latin-1")
            body, content_type = exposition.get(accept)
            if scope["method"] == "HEAD":
                body = b""
            await respond(send, 200, body, content_type=content_type.encode())
        elif scope["path"] == "/healthz":
            # Answering at all proves the trio run (and so the lock server) is alive.
            await respond(send, 200, b"ok\n")
        elif page := status_response(scope["path"], dict(scope["headers"]).get(b"host")):
            file, file_type, headers = page
            if scope["method"] == "HEAD":
                file = b""
            await respond(send, 200, file, headers, content_type=file_type)
        else:
            await respond(
                send, 404, b"not found: try /metrics, /healthz, /status or a WebSocket on /\n"
            )

    return app


async def respond(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    content_type: bytes = b"text/plain; charset=utf-8",
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def serve_metrics(
    service: PausableService,
    host: str,
    port: int,
    slots: ConnectionSlots | None = None,
    *,
    sock: socket.socket | None = None,
    tune: Tune | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP port on ``host:port`` until cancelled: ``/metrics`` and
    ``/healthz`` to at most ``--metrics-max-connections`` connections at once, each
    closed after ``--metrics-idle-timeout`` seconds of silence (:mod:`elockd.net.http`),
    and with ``slots`` (the lock port's, for ``--max-connections``) WebSocket
    sessions on ``/``.

    ``port`` 0 takes any free port; ``task_status`` reports the bound address.
    ``sock``: a listening socket to serve instead (handed over by a predecessor).
    ``tune``: applied to every accepted socket (the lock port's keepalive).
    """
    config = service.config
    if sock is None:
        (sock,) = open_tcp_sockets(host, port, every_address=False, backlog=1024)
    bound_host, bound_port = sock.getsockname()[:2]
    exposition = Exposition(make_registry(service), max_age=config.metrics_cache)
    upgrade = None if slots is None else partial(serve_websocket, service, slots)
    try:
        task_status.started((bound_host, bound_port))
        await serve_http(
            make_app(exposition),
            sock,
            max_connections=config.metrics_max_connections,
            idle_timeout=config.metrics_idle_timeout,
            send_timeout=config.send_timeout,
            upgrade=upgrade,
            tune=tune,
        )
    finally:
        sock.close()
