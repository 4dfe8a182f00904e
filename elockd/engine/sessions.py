"""A session: who holds what.

A session is born with a connection and owns every hold that connection takes. It
outlives its connection only while a grace time runs (``set_timeout``) or while it
still owns a lease, so that ``conn_id ID`` can take it over after a network blip.
These are plain records; the rules that change them live in :mod:`elockd.engine.locks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

#: A waiter's states.
WAITING = 0
GRANTED = 1
CANCELLED = 2


class Hold:
    """One session's hold on one key, exclusive or shared.

    ``token`` is the fencing token of an exclusive hold (0 for shared holds).
    ``lease_deadline`` is None for a plain hold, which lives as long as its session;
    freeing a hold sets it back to None, so lease-heap entries that still point at
    a freed (or renewed) hold no longer match and are skipped. No other field: there
    are a million of these on a busy server, and every slot is 8 bytes of each.
    """

    __slots__ = ("granted_at", "key", "lease_deadline", "session", "shared", "token")

    def __init__(
        self, session: Session, key: bytes, shared: bool, token: int, granted_at: float
    ) -> None:
        self.session = session
        self.key = key
        self.shared = shared
        self.token = token
        self.granted_at = granted_at
        self.lease_deadline: float | None = None


class Session:
    """A connection's identity: its holds, pending waits, grace time and name.

    ``peer`` is ``IP:PORT`` of the current (or last) connection; ``name`` is what the
    client set with ``iam``. Identity (not equality) is what the lock tables key on.
    """

    __slots__ = (
        "abort",
        "connected",
        "ending",
        "exclusive",
        "grace",
        "grace_deadline",
        "id",
        "leases",
        "name",
        "peer",
        "shared",
        "waiters",
    )

    def __init__(self, session_id: str, peer: bytes) -> None:
        self.id = session_id
        self.peer = peer
        self.name: bytes | None = None
        self.connected = True
        # Its connection and grace are over, and its holds wait to be freed in a
        # later slice (elockd.engine.locks: bounded slices); no conn_id may take it over.
        self.ending = False
        self.grace = 0.0
        self.grace_deadline: float | None = None
        self.exclusive: dict[bytes, Hold] = {}
        self.shared: dict[bytes, Hold] = {}
        self.waiters: set[Waiter] = set()
        self.leases = 0
        # Ends its connection (set by the server while it has one): a backend that
        # loses the session (a cluster node whose etcd lease ran out) calls it.
        self.abort: Callable[[], None] | None = None

    @property
    def owner(self) -> bytes:
        """What ``d``/``sd``/``info`` print for this session's holds."""
        return self.name if self.name is not None else self.peer

    def is_empty(self) -> bool:
        """True when the session holds nothing and waits for nothing."""
        return not (self.exclusive or self.shared or self.waiters)

    def __repr__(self) -> str:
        # Never the id, not even a part: it is a bearer secret, and a repr ends up
        # in tracebacks and logs.
        return f"<Session {self.owner!r}>"


class Waiter:
    """One request that could not be granted at once and chose to wait.

    ``keys`` has one key for ``lock``/``lock_shared`` and several for ``mlock``.
    ``taken`` lists the keys an ``mlock`` waiter already holds while it waits for the
    rest; they are freed again if it gives up. ``count`` is the number of shared
    holders right after a shared grant (the ``200 N`` reply).
    """

    __slots__ = (
        "count",
        "deadline",
        "keys",
        "limit",
        "missing",
        "serial",
        "session",
        "shared",
        "since",
        "state",
        "taken",
        "ttl",
        "wake",
    )

    def __init__(
        self,
        session: Session,
        keys: tuple[bytes, ...],
        *,
        shared: bool,
        limit: int,
        ttl: float | None,
        since: float,
    ) -> None:
        self.session = session
        self.keys = keys
        self.shared = shared
        self.limit = limit
        self.ttl = ttl
        self.since = since
        self.serial = 0  # arrival order, set when it starts waiting
        self.state = WAITING
        self.taken: list[bytes] = []
        self.missing = len(keys)
        self.count = 0
        self.deadline = math.inf  # when the wait gives up (the engine times it out)
        self.wake: Callable[[], None] | None = None

    @property
    def granted(self) -> bool:
        return self.state == GRANTED

    @property
    def waiting(self) -> bool:
        return self.state == WAITING
