"""The status page (``GET /status`` on the HTTP port) in a real browser: Debian's
``chromium``, headless, driven by selenium through Debian's ``chromium-driver``,
against a real ``python -m elockd`` process whose locks are taken over TCP.

The browser is not optional: without it these tests fail (``.ci/run`` installs it),
they never skip. One browser and one server serve the whole module; each test loads
the page afresh. Waits are explicit (WebDriverWait on what the page shows), and the
one wall-clock bound the issue names (a row within 1 s) is a serial test.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.hostile_tools import free_port
from tests.support.server_process import start_server, stop_server

#: Generous for everything but the 1 s bound: the machine may be busy.
PATIENCE = 10.0
POLL = 0.05
TOKEN = "status-page-token"
ADMIN_TOKEN = "status-page-admin"


def browser_binaries() -> tuple[str, str]:
    """Debian's chromium and chromedriver: a missing one fails the test, naming the fix."""
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail(
            "the status page tests need a real browser: apt-get install chromium chromium-driver"
        )
    return chromium, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    chromium, driver = browser_binaries()
    options = Options()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def start_with_http(*args: str) -> tuple[subprocess.Popen[str], int, int]:
    """A real server on free ports: (process, lock port, HTTP port)."""
    http_port = free_port()
    process, port = start_server("--metrics-port", str(http_port), *args)
    return process, port, http_port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(lock port, HTTP port) of a server without auth, with an operator's token."""
    admin = tmp_path_factory.mktemp("status-admin") / "admin"
    admin.write_text(ADMIN_TOKEN + "\n")
    process, port, http_port = start_with_http("--admin-token-file", str(admin))
    yield port, http_port
    stop_server(process)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(lock port, HTTP port) of a server with --auth-token-file."""
    token = tmp_path_factory.mktemp("status-auth") / "token"
    token.write_text(TOKEN + "\n")
    process, port, http_port = start_with_http(
        "--auth-token-file", str(token), "--auth-failure-delay", "0.05"
    )
    yield port, http_port
    stop_server(process)


class Client:
    """A blocking line client over TCP: one request, one reply line."""

    def __init__(self, port: int, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
        self.file = self.sock.makefile("rb")
        if token is not None:
            assert self.ask(f"auth {token}") == "200 OK"

    @property
    def peer(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def ask(self, line: str) -> str:
        self.send(line)
        return self.reply()

    def reply(self) -> str:
        return self.file.readline().decode().rstrip("\r\n")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., Client]]:
    """Open TCP clients; every one is closed (its locks freed) after the test."""
    opened: list[Client] = []

    def connect(port: int, token: str | None = None) -> Client:
        client = Client(port, token)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()


def wait(
    browser: WebDriver, condition: Callable[[WebDriver], Any], timeout: float = PATIENCE
) -> Any:
    return WebDriverWait(browser, timeout, poll_frequency=POLL).until(condition)


def until(condition: Callable[[], bool]) -> None:
    """Ask the server until ``condition`` holds (a request joining a queue sends no
    sign of it); fail after PATIENCE seconds."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(POLL)


def phase(browser: WebDriver) -> str | None:
    return browser.find_element(By.TAG_NAME, "body").get_attribute("data-phase")


def open_page(browser: WebDriver, http_port: int, query: str = "") -> None:
    """Load the page and wait until it watches (or asks for a token)."""
    browser.get(f"http://127.0.0.1:{http_port}/status{query}")
    wait(browser, lambda b: phase(b) in ("live", "auth"))


def rows(browser: WebDriver) -> list[dict[str, str]]:
    """The table as the page shows it: one dict of cell texts per row, plus the
    age in whole seconds (``seconds``) when the page knows it."""
    table = browser.execute_script(
        """return [...document.querySelectorAll('#rows tr')].map((tr) => {
            const row = {};
            for (const td of tr.cells) row[td.className.split(' ')[0]] = td.textContent;
            const age = tr.querySelector('td.age').dataset.seconds;
            if (age !== undefined) row.seconds = age;
            return row;
        })"""
    )
    assert isinstance(table, list)
    return table


def row_of(browser: WebDriver, key: str) -> dict[str, str] | None:
    found = [row for row in rows(browser) if row["key"] == key]
    assert len(found) <= 1, found
    return found[0] if found else None


def page_errors(browser: WebDriver) -> list[str]:
    """What the browser logged since the last call about the policy blocking
    something, or a script error."""
    words = ("Content Security Policy", "Refused to", "Uncaught")
    return [
        e["message"] for e in browser.get_log("browser") if any(w in e["message"] for w in words)
    ]


def test_the_page_is_static_with_a_content_security_policy(server: tuple[int, int]) -> None:
    _, http_port = server
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status") as response:
        page = response.read()
        headers = response.headers
    assert page == files("elockd.net").joinpath("static", "status.html").read_bytes()
    assert headers["content-type"] == "text/html; charset=utf-8"
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert f"connect-src 'self' ws://127.0.0.1:{http_port} " in policy
    assert headers["x-content-type-options"] == "nosniff"
    # Every script is a file of the page's own origin: no inline script, no CDN.
    scripts = re.findall(rb"<script[^>]*>", page)
    assert scripts == [b'<script src="/status/app.js" defer>']
    assert b"<style" not in page and b"http" not in page.replace(b"http-equiv", b"")
    for path, kind in (("/status/app.js", "text/javascript"), ("/status/app.css", "text/css")):
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}") as response:
            assert response.headers["content-type"].startswith(kind)
            assert response.read()
    head = urllib.request.Request(f"http://127.0.0.1:{http_port}/status", method="HEAD")
    with urllib.request.urlopen(head) as response:
        assert response.status == 200 and response.read() == b""


def test_a_host_header_that_is_not_a_host_is_not_echoed(server: tuple[int, int]) -> None:
    _, http_port = server
    with socket.create_connection(("127.0.0.1", http_port), timeout=PATIENCE) as sock:
        sock.sendall(
            b"GET /status HTTP/1.1\r\nHost: evil; script-src *\r\nConnection: close\r\n\r\n"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert b"content-security-policy: default-src 'none'" in head
    assert b"evil" not in head and b"connect-src 'self';" in head


@pytest.mark.serial
def test_a_lock_taken_over_tcp_appears_within_a_second_and_vanishes_on_release(
    browser: WebDriver, server: tuple[int, int], clients: Callable[..., Client]
) -> None:
    port, http_port = server
    open_page(browser, http_port)
    assert phase(browser) == "live"
    holder = clients(port)
    assert holder.ask("lock fast/one") == "200 Acquired"
    granted = time.monotonic()
    row = wait(browser, lambda b: row_of(b, "fast/one"), timeout=1.0)
    assert time.monotonic() - granted < 1.0
    token = holder.ask("token fast/one").split()[1]
    assert row["kind"] == "exclusive" and row["owner"] == holder.peer
    assert row["token"] == token
    assert holder.ask("unlock fast/one") == "200 Unlocked"
    released = time.monotonic()
    wait(browser, lambda b: row_of(b, "fast/one") is None, timeout=1.0)
    assert time.monotonic() - released < 1.0
    assert page_errors(browser) == []


def test_the_table_has_every_column_and_keeps_a_snapshot(
    browser: WebDriver, server: tuple[int, int], clients: Callable[..., Client]
) -> None:
    port, http_port = server
    holder, waiter, sharer = clients(port), clients(port), clients(port)
    assert holder.ask("lock cols/x ttl=600") == "200 Acquired"
    waiter.send("lock cols/x 60")  # waits: a waiter, before the page loads
    assert sharer.ask("lock_shared cols/s") == "200 1"
    until(lambda: " waiting=1 " in sharer.ask("info cols/x"))
    open_page(browser, http_port)  # the holds come from the watch's snapshot
    wait(browser, lambda b: (row_of(b, "cols/x") or {}).get("waiters") == "1")
    row = row_of(browser, "cols/x")
    assert row is not None
    assert row["kind"] == "exclusive" and row["owner"] == holder.peer
    assert row["token"] == holder.ask("token cols/x").split()[1]
    ttl = int(row["ttl"].rstrip("s"))
    assert 0 < ttl <= 600
    shared = wait(browser, lambda b: row_of(b, "cols/s"))
    assert (shared["kind"], shared["owner"], shared["token"]) == ("shared", sharer.peer, "-")
    # The holder lets go: the waiter's grant is an event, its row replaces the first.
    assert holder.ask("unlock cols/x") == "200 Unlocked"
    assert waiter.reply() == "200 Acquired"
    wait(browser, lambda b: (row_of(b, "cols/x") or {}).get("owner") == waiter.peer)
    wait(browser, lambda b: (row_of(b, "cols/x") or {}).get("waiters") == "0")
    assert browser.find_element(By.ID, "c-events").text != "0"
    assert page_errors(browser) == []


def test_a_killed_hold_vanishes(
    browser: WebDriver, server: tuple[int, int], clients: Callable[..., Client]
) -> None:
    port, http_port = server
    holder, admin = clients(port), clients(port, ADMIN_TOKEN)
    assert holder.ask("lock stuck/job") == "200 Acquired"
    open_page(browser, http_port, "?prefix=stuck/")
    wait(browser, lambda b: row_of(b, "stuck/job"))
    assert admin.ask("kill stuck/job") == "200 Killed 1"
    wait(browser, lambda b: row_of(b, "stuck/job") is None)
    wait(browser, lambda b: b.find_element(By.ID, "q-killed").text == "1")
    assert page_errors(browser) == []


def test_the_age_counts_up_and_sorts(
    browser: WebDriver, server: tuple[int, int], clients: Callable[..., Client]
) -> None:
    port, http_port = server
    client = clients(port)
    assert client.ask("lock age/old") == "200 Acquired"
    taken = time.monotonic()
    open_page(browser, http_port, "?prefix=age/")
    # Held before the page opened: its age comes from `ls`, at least what passed.
    first = wait(browser, lambda b: (row_of(b, "age/old") or {}).get("seconds"))
    assert int(first) >= int(time.monotonic() - taken) - 1
    wait(browser, lambda b: int((row_of(b, "age/old") or {}).get("seconds", -1)) >= int(first) + 2)
    assert client.ask("lock age/new") == "200 Acquired"
    wait(browser, lambda b: row_of(b, "age/new"))

    def keys() -> list[str]:
        return [row["key"] for row in rows(browser)]

    assert keys() == ["age/new", "age/old"]  # by key at first
    header = browser.find_element(By.ID, "sort-age")
    header.click()
    assert keys() == ["age/old", "age/new"]  # the oldest first
    assert header.get_attribute("aria-sort") == "descending"
    header.click()
    assert keys() == ["age/new", "age/old"]
    assert header.get_attribute("aria-sort") == "ascending"
    assert page_errors(browser) == []


def test_the_prefix_filter(
    browser: WebDriver, server: tuple[int, int], clients: Callable[..., Client]
) -> None:
    port, http_port = server
    client = clients(port)
    for key in ("jobs/a", "jobs/b", "mail/a"):
        assert client.ask(f"lock {key}") == "200 Acquired"
    open_page(browser, http_port)
    wait(browser, lambda b: {"jobs/a", "jobs/b", "mail/a"} <= {r["key"] for r in rows(b)})
    box = browser.find_element(By.ID, "prefix")
    box.send_keys("jobs/")
    wait(browser, lambda b: sorted(r["key"] for r in rows(b)) == ["jobs/a", "jobs/b"])
    # The watch follows the prefix: then a new key outside it never shows up.
    wait(browser, lambda b: "under “jobs/”" in b.find_element(By.ID, "state").text)
    assert browser.current_url.endswith("/status?prefix=jobs%2F")
    assert client.ask("lock mail/b") == "200 Acquired"
    assert client.ask("lock jobs/c") == "200 Acquired"
    wait(browser, lambda b: sorted(r["key"] for r in rows(b)) == ["jobs/a", "jobs/b", "jobs/c"])
    box.clear()
    box.send_keys(" ")  # clear() fires no input event; a blank is refused with a word
    wait(browser, lambda b: b.find_element(By.ID, "prefix-message").text != "")
    box.clear()
    box.send_keys("m")
    wait(browser, lambda b: sorted(r["key"] for r in rows(b)) == ["mail/a", "mail/b"])


def test_keys_and_owners_are_shown_as_text_never_markup(
    browser: WebDriver, server: tuple[int, int], clients: Callable[..., Client]
) -> None:
    port, http_port = server
    client = clients(port)
    assert client.ask("iam <img src=x onerror=document.title='owned'>") == "1 ok"
    assert client.ask("lock <b>bold</b>") == "200 Acquired"
    open_page(browser, http_port)
    row = wait(browser, lambda b: row_of(b, "<b>bold</b>"))
    assert row["owner"] == "<img src=x onerror=document.title='owned'>"
    assert browser.find_elements(By.CSS_SELECTOR, "#rows b, #rows img") == []
    assert browser.title == "elockd status"
    assert page_errors(browser) == []


def test_with_auth_the_page_shows_nothing_until_the_token_is_given(
    browser: WebDriver, auth_server: tuple[int, int], clients: Callable[..., Client]
) -> None:
    port, http_port = auth_server
    client = clients(port, TOKEN)
    assert client.ask("lock secret/job") == "200 Acquired"
    open_page(browser, http_port)
    assert phase(browser) == "auth"
    assert browser.find_element(By.ID, "auth").is_displayed()
    assert not browser.find_element(By.ID, "live").is_displayed()
    assert rows(browser) == []
    assert "secret/job" not in browser.page_source
    # A wrong token: the server refuses and closes; the form comes back, saying so.
    browser.find_element(By.ID, "token").send_keys("wrong")
    browser.find_element(By.ID, "token-submit").click()
    wait(browser, lambda b: "refused" in b.find_element(By.ID, "auth-message").text)
    assert phase(browser) == "auth" and rows(browser) == []
    assert "secret/job" not in browser.page_source
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "token-submit").click()
    row = wait(browser, lambda b: row_of(b, "secret/job"))
    assert row["owner"] == client.peer
    assert not browser.find_element(By.ID, "auth").is_displayed()
    # Kept in the tab's session: a reload asks for nothing and goes on.
    assert browser.execute_script("return sessionStorage.getItem('elockd.status.token')") == TOKEN
    open_page(browser, http_port)
    wait(browser, lambda b: row_of(b, "secret/job"))
    assert phase(browser) == "live"
    browser.execute_script("sessionStorage.clear()")


def test_the_page_is_read_only(browser: WebDriver, server: tuple[int, int]) -> None:
    _, http_port = server
    open_page(browser, http_port)
    assert browser.find_elements(By.TAG_NAME, "button") == [
        browser.find_element(By.ID, "token-submit")
    ]
    script = (Path(str(files("elockd.net").joinpath("static", "status.js")))).read_text()
    assert not re.search(r"[\"'`]kill\b", script)
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script


def test_with_tls_the_page_says_its_websocket_is_off(
    browser: WebDriver, tls_files: dict[str, str]
) -> None:
    """The plain-HTTP WebSocket is off when the lock port speaks TLS: the page says
    so instead of showing an empty table as if nothing were held."""
    process, _, http_port = start_with_http(
        "--tls-cert", tls_files["cert"], "--tls-key", tls_files["key"]
    )
    try:
        browser.get(f"http://127.0.0.1:{http_port}/status")
        wait(browser, lambda b: phase(b) == "disconnected")
        assert "refused" in browser.find_element(By.ID, "state").text
        assert not browser.find_element(By.ID, "live").is_displayed()
    finally:
        stop_server(process)
