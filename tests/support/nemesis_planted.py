"""``python -m tests.support.nemesis_planted ARGS``: elockd with its deadline check
disabled, a planted fault for the nemesis's checker to catch.

A node confirms a hold only while its etcd lease is within its local deadline
(``NodeLease.past_deadline``, ``check_expiry``, the deadline timer, and the reply
gate's ``cannot_vouch``). Here those four are replaced in this process before
elockd's main runs, so a node cut from etcd or paused goes on confirming holds
that etcd has freed and the other node has granted: two holders. Nothing of this
is in elockd; the test starts this module instead of ``elockd``
(tests/support/server_process.py, ``module``).
"""

from __future__ import annotations

import sys

import trio

from elockd.backend.cluster.lease import NodeLease


def never_past(self: NodeLease) -> bool:
    return False


def always_vouch(self: NodeLease) -> bool:
    return False


def no_expiry(self: NodeLease) -> None:
    return None


async def no_timer(self: NodeLease) -> None:
    await trio.sleep_forever()


def plant() -> None:
    NodeLease.past_deadline = never_past  # type: ignore[method-assign]
    NodeLease.check_expiry = no_expiry  # type: ignore[method-assign]
    NodeLease.enforce_deadline = no_timer  # type: ignore[method-assign]
    NodeLease.cannot_vouch = always_vouch  # type: ignore[method-assign]


if __name__ == "__main__":
    plant()
    from elockd.daemon.main import main

    sys.exit(main())
