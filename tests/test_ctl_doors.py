"""Wrong doors: elockctl sent to an HTTP port, plain TCP to a TLS port, TLS to a
plain one, no client certificate where one is wanted. Each is exit 3 in one line
that names the flag to change, and comes at once, not after ``--timeout``."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest

from elockd.ctl.status import EXIT_ERROR
from tests.support.foreign_service import foreign_service
from tests.support.server_process import mutual_tls_flags, start_server, stop_server
from tests.test_ctl import ctl_process, one_line

#: Long enough that a test passing under it cannot have waited for a reply timeout.
PATIENT = ("--timeout", "600")
ARGVS = [["i", "k"], ["stats"], ["lock", "k", "-c", "true"]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    """elockd's own HTTP (metrics and WebSocket) port."""
    port = free_port()
    process, _ = start_server("--metrics-port", str(port))
    try:
        yield port
    finally:
        stop_server(process)


@pytest.fixture
def mutual_tls_port(tls_files: dict[str, str]) -> Iterator[int]:
    process, port = start_server(*mutual_tls_flags(tls_files))
    try:
        yield port
    finally:
        stop_server(process)


def wrong_door(port: int, *argv: str) -> tuple[str, float]:
    started = time.monotonic()
    result = ctl_process(port, *PATIENT, *argv, timeout=60)
    took = time.monotonic() - started
    assert result.returncode == EXIT_ERROR, result
    assert result.stdout == ""
    return one_line(result.stderr), took


@pytest.mark.parametrize("argv", ARGVS)
def test_an_http_port_suggests_port_at_once(http_port: int, argv: list[str]) -> None:
    line, took = wrong_door(http_port, *argv)
    assert "not an elockd reply: 'HTTP/1.1 400" in line
    assert "an HTTP port" in line and "--port" in line and "--url ws://" in line
    assert took < 5, f"{took:.1f} s: it waited for a reply instead of reading the refusal"


@pytest.mark.parametrize("argv", ARGVS)
def test_plain_tcp_to_a_tls_port_suggests_tls(mutual_tls_port: int, argv: list[str]) -> None:
    line, took = wrong_door(mutual_tls_port, *argv)
    assert "closed the connection" in line and "the port speaks TLS: add --tls" in line
    assert took < 5, f"{took:.1f} s"


@pytest.mark.parametrize("argv", ARGVS)
def test_tls_to_a_plain_port_says_it_is_not_tls(argv: list[str]) -> None:
    process, port = start_server()
    try:
        line, _ = wrong_door(port, "--tls", *argv)
    finally:
        stop_server(process)
    assert "WRONG_VERSION_NUMBER" in line and "does not speak TLS" in line


@pytest.mark.parametrize("argv", ARGVS)
def test_a_missing_client_certificate_is_named(
    mutual_tls_port: int, tls_files: dict[str, str], argv: list[str]
) -> None:
    line, took = wrong_door(mutual_tls_port, "--tls-ca", tls_files["ca"], *argv)
    assert "client certificate" in line and "--tls-cert PEM --tls-key PEM" in line
    assert took < 5, f"{took:.1f} s"


@contextlib.contextmanager
def tls_server_that_alerts(tls_files: dict[str, str]) -> Iterator[int]:
    """A TLS 1.3 server that wants a client certificate and says so with the
    ``certificate_required`` alert (as OpenSSL's own servers do)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls_files["cert"], tls_files["key"])
    context.load_verify_locations(tls_files["ca"])
    context.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                raw, _ = listener.accept()
                raw.settimeout(5)
                with context.wrap_socket(
                    raw, server_side=True, do_handshake_on_connect=False
                ) as tls:
                    with contextlib.suppress(OSError):
                        tls.do_handshake()
                        tls.recv(100)  # reads the empty certificate: sends the alert
                    # Closing with the request unread would reset the connection, and
                    # a reset can overtake the alert: wait for the client to hang up.
                    tls.setblocking(True)  # the client hangs up right after the alert
                    with contextlib.suppress(OSError):
                        while os.read(tls.fileno(), 4096):
                            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)


def test_a_certificate_alert_is_named(tls_files: dict[str, str]) -> None:
    with tls_server_that_alerts(tls_files) as port:
        line, _ = wrong_door(
            port, "--tls-ca", tls_files["ca"], "--tls-server-name", "localhost", "i", "k"
        )
    assert "CERTIFICATE_REQUIRED" in line
    assert "the server wants a client certificate: --tls-cert PEM --tls-key PEM" in line


def test_tls_records_in_reply_suggest_tls() -> None:
    """A TLS port that answers plain bytes with an alert record (protocol_version)."""
    with foreign_service(b"\x15\x03\x01\x00\x02\x02\x46") as port:
        line, _ = wrong_door(port, "i", "k")
    assert "the port speaks TLS: add --tls" in line


def test_a_close_from_a_plain_port_gets_no_tls_hint() -> None:
    """A port that hangs up on every connection without TLS (elockd stopping, a
    firewall's reset): no guess, since the hint comes from asking the port whether
    it speaks TLS, not from the close alone."""
    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                listener.accept()[0].close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        line, _ = wrong_door(int(listener.getsockname()[1]), "i", "k")
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
    assert ("closed the connection" in line or "reset by peer" in line) and "TLS" not in line
