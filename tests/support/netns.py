"""A client host of the test's own making: a network namespace joined to this host by
a veth pair, whose link the test can set down, so that the host vanishes as a
powered-off machine does (no FIN, no RST ever arrives).

Needs root and iproute2 (.ci/run installs it; CI runs as root). Addresses come from
a /30 in 10.213.0.0/16 chosen by the test's pid, so parallel runs do not collide.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
#: setns(2)'s flag for a network namespace (os.CLONE_NEWNET from Python 3.12 on).
CLONE_NEWNET = 0x40000000


def why_namespaces_cannot_be_made() -> str | None:
    """None when this process can create network namespaces, else the reason."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def enter(namespace: str) -> None:
    """Move the calling thread into ``namespace`` (made by ``ip netns add``).

    Only the calling thread moves, and every socket it opens afterwards (and every
    thread or process it starts) lives in that namespace. Used as a ``preexec_fn``,
    it starts a process inside the namespace with no ``ip netns exec`` in between,
    so the process's pid is the one to signal."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def run_in(namespace: str, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a fresh thread inside ``namespace``; its result or error.

    A fresh thread each time, never a pooled one, so that no thread in another
    namespace can ever pick the work up."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            enter(namespace)
            outcome.append((True, function(*args)))
        except BaseException as error:
            outcome.append((False, error))

    thread = threading.Thread(target=target, name=f"in {namespace}", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


@dataclass
class Host:
    """The far end: ``address`` is the namespace's, ``gateway`` ours (on the veth)."""

    namespace: str
    address: str
    gateway: str
    link: str

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def vanish(self) -> None:
        """Pull the cable: the host's link goes down; nothing is sent to us."""
        ip("netns", "exec", self.namespace, "ip", "link", "set", self.link, "down")


@contextmanager
def client_host() -> Iterator[Host]:
    """Make the namespace and veth pair; remove both afterwards, whatever happened."""
    tag = os.getpid() % 16000
    namespace = f"elockd-test-{os.getpid()}"
    ours, theirs = f"elk{tag}h", f"elk{tag}c"
    base = 4 * (tag % 16000)
    network = f"10.213.{base // 256 % 256}.{base % 256}"
    prefix = network.rsplit(".", 1)[0]
    last = int(network.rsplit(".", 1)[1])
    gateway, address = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
    ip("netns", "add", namespace)
    try:
        ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
        ip("link", "set", theirs, "netns", namespace)
        ip("addr", "add", f"{gateway}/30", "dev", ours)
        ip("link", "set", ours, "up")
        inside = ("netns", "exec", namespace, "ip")
        ip(*inside, "addr", "add", f"{address}/30", "dev", theirs)
        ip(*inside, "link", "set", theirs, "up")
        ip(*inside, "link", "set", "lo", "up")
        yield Host(namespace, address, gateway, theirs)
    finally:
        subprocess.run(["ip", "link", "del", ours], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
