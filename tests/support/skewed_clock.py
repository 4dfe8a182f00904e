"""A process whose wall clock is off by a fixed offset, through libfaketime (Debian's
``faketime`` package): the cluster's throttle TATs are on the wall clock, and a
test of what a skewed node does needs a node whose ``time.time()`` is really off.

``FAKETIME="+0.5"`` (or ``"-0.5"``) is libfaketime's relative offset in seconds: the
faked clock keeps running, offset from the real one. ``FAKETIME_DONT_FAKE_MONOTONIC``
leaves ``CLOCK_MONOTONIC`` (trio's clock) alone. With it, libfaketime 0.9.10 makes
Python's ``time.sleep`` fail with EINVAL (its absolute monotonic ``clock_nanosleep``
is mistranslated); elockd never calls it, and trio sleeps in ``epoll_wait``.
"""

from __future__ import annotations

import glob
import os

import pytest

#: Where distributions put the library (Debian: a multiarch directory).
LIBRARY_PATTERNS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def libfaketime() -> str:
    """The path of libfaketime.so.1; a missing library fails the test, never skips it."""
    for pattern in LIBRARY_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    pytest.fail("libfaketime.so.1 not found: install it (apt-get install faketime)")


def skewed_env(offset: float) -> dict[str, str]:
    """This process's environment, with the wall clock ``offset`` seconds off (ahead
    when positive) and the monotonic clock untouched."""
    return {
        **os.environ,
        "LD_PRELOAD": libfaketime(),
        "FAKETIME": f"{offset:+.3f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
