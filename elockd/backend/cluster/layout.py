"""Where the lock space lives in etcd: one root prefix, four kinds of key.

``<root>q/x/<hex key>/<session tag hex>``
    an entry in the queue of an exclusive lock (``g``, ``lock``, ``mlock``);
``<root>q/s/<hex key>/<session tag hex>``
    an entry in the queue of a shared lock (``sg``, ``lock_shared``);
``<root>s/<sha256 of session id>``
    a session's record (:class:`SessionRecord`): the node serving it, whether a
    client is connected, its grace time;
``<root>n/<node id>``
    a node's heartbeat, bound to a short node lease: a session whose node's
    heartbeat is gone may be taken over (``conn_id``) on another node;
``<root>meta/token_floor``
    added to every etcd revision to make a fencing token (see :mod:`.ledger`);
``<root>meta/killed``
    written by each ``kill K`` in the txn that marks the holds killed (their entries
    rewritten in place, :func:`killed_value`), naming their entries (:mod:`.operators`);
``<root>t/tat/<hex key>``
    a throttle key's TAT on the wall clock and the node that wrote it
    (:func:`tat_value`), bound to no lease (a rate outlives the node that admitted);
``<root>t/wait/<hex key>/<waiter id hex>``
    a ``throttle ... wait=S`` request in its key's line, bound to the lease of the
    node serving it; the line is ordered by create revision (:mod:`.throttle`).

Queue entries and records are bound to the etcd lease of the node that serves
their session (one lease per node, not per session: keepalive traffic grows with
nodes, not sessions), so a dead node's sessions are freed at once when it runs out.
Lock names are hex-encoded: a ``/`` in a name can never reach into the layout, and
any byte is allowed. A session id is a bearer secret, so only its hash is ever
written to etcd; entries name the session by its *tag*, a random number its record
carries too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

EXCLUSIVE = b"x"
SHARED = b"s"


@dataclass(frozen=True, slots=True)
class EntryName:
    """What an entry's etcd key says: the table, the lock name and the session's tag."""

    kind: bytes
    key: bytes
    tag: int

    @property
    def queue(self) -> tuple[bytes, bytes]:
        return self.kind, self.key


class Layout:
    """Builds and parses the keys under one root prefix."""

    def __init__(self, root: bytes) -> None:
        if not root.endswith(b"/"):
            root += b"/"
        self.root = root
        self.queues = root + b"q/"
        self.sessions = root + b"s/"
        self.nodes = root + b"n/"
        self.token_floor = root + b"meta/token_floor"
        self.killed = root + b"meta/killed"
        self.throttles = root + b"t/"
        self.tats = root + b"t/tat/"
        self.throttle_lines = root + b"t/wait/"

    def queue_prefix(self, kind: bytes, key: bytes) -> bytes:
        return b"%s%s/%s/" % (self.queues, kind, key.hex().encode())

    def entry(self, kind: bytes, key: bytes, tag: int) -> bytes:
        return b"%s%x" % (self.queue_prefix(kind, key), tag)

    def parse_entry(self, etcd_key: bytes) -> EntryName | None:
        """The parts of a queue entry's key; None for any other key."""
        if not etcd_key.startswith(self.queues):
            return None
        parts = etcd_key[len(self.queues) :].split(b"/")
        if len(parts) != 3 or parts[0] not in (EXCLUSIVE, SHARED):
            return None
        try:
            return EntryName(parts[0], bytes.fromhex(parts[1].decode()), int(parts[2], 16))
        except ValueError:
            return None

    def tat(self, key: bytes) -> bytes:
        """Where a throttle key's TAT lives."""
        return self.tats + key.hex().encode()

    def throttle_line(self, key: bytes) -> bytes:
        """The prefix of a throttle key's line of waiters."""
        return b"%s%s/" % (self.throttle_lines, key.hex().encode())

    def throttle_waiter(self, key: bytes, waiter: int) -> bytes:
        return b"%s%x" % (self.throttle_line(key), waiter)

    def parse_throttle(self, etcd_key: bytes) -> tuple[bytes, int | None] | None:
        """(throttle key, waiter id) of a waiter's etcd key, (throttle key, None) of a
        TAT's; None for anything else."""
        try:
            if etcd_key.startswith(self.tats):
                return bytes.fromhex(etcd_key[len(self.tats) :].decode()), None
            if etcd_key.startswith(self.throttle_lines):
                name, _, waiter = etcd_key[len(self.throttle_lines) :].partition(b"/")
                return bytes.fromhex(name.decode()), int(waiter, 16)
        except ValueError:
            return None
        return None

    def session_record(self, session_id: str) -> bytes:
        return self.sessions + hashlib.sha256(session_id.encode()).hexdigest().encode()

    def node(self, node_id: str) -> bytes:
        return self.nodes + node_id.encode()


def entry_value(
    limit: int,
    ttl: float | None,
    owner: bytes,
    *,
    held: bool = False,
    rank: int = 0,
    peer: bytes | None = None,
    at: float | None = None,
) -> bytes:
    """An entry's value: a flag, ``h`` once a shared entry with a limit holds (``w``
    before), with ``:RANK`` unless its rank is 0 (the node's count of the entries
    it creates, so that entries created at one revision get tokens of their own,
    and an ``mlock``'s keys consecutive ones in byte order); the request's
    holder limit (0: none); its lease in seconds (0: none); the holder's address
    (``IP:PORT``, for glockd's ``dump``), and last the owner ``d`` shows, which may
    hold blanks. With an address the flag is upper case (``W``/``H``): values
    written before it existed (``w``/``h``, no address) still read.

    ``at``: the wall-clock time of the write (when the request was queued, or when
    a shared entry was marked held), appended to the address as ``@SECONDS``: what
    ``ls`` ages a hold from on every node (docs/cluster.md, "Operators on a
    cluster"). Appended there because older nodes read the address as one opaque
    word (only glockd's ``dump`` shows it), where a field of its own would shift
    the owner they read."""
    flag = b"h" if held else b"w"
    fields = [str(limit).encode(), repr(ttl or 0.0).encode()]
    if peer is not None:
        flag = flag.upper()
        fields.append(peer if at is None else b"%s@%.3f" % (peer, at))
    if rank:
        flag += b":%d" % rank
    return b" ".join([flag, *fields, owner])


#: The word before an entry's value once an operator's ``kill`` has revoked its
#: hold (:func:`killed_value`).
KILLED_MARK = b"k "


def killed_value(value: bytes) -> bytes:
    """The value a ``kill`` rewrites a holding entry with, in place (same key, same
    create revision, same lease): its old value behind :data:`KILLED_MARK`. The entry
    keeps its place at the head of its queue, so nothing behind it is granted, until
    the node serving its session has dropped the hold and deletes the entry (its
    acknowledgement), or etcd lapses that node's lease (docs/cluster.md, "An operator's kill").
    A node that predates the mark reads it as malformed: a held exclusive entry,
    which blocks (safe)."""
    return KILLED_MARK + value


@dataclass(frozen=True, slots=True)
class EntryValue:
    held: bool
    limit: int
    ttl: float | None
    owner: bytes
    rank: int = 0
    peer: bytes = b""  # the holder's address ("" in values written without one)
    at: float | None = None  # wall-clock time of the write (None: not written)
    killed: bool = False  # revoked by a kill, not yet acknowledged (killed_value)


def encode_entry_value(
    value: EntryValue, *, owner: bytes | None = None, peer: bytes | None = None
) -> bytes:
    """``value`` written again (:func:`entry_value`), with another owner or address
    if given; the kill mark is not kept (:func:`killed_value` adds it)."""
    return entry_value(
        value.limit,
        value.ttl,
        value.owner if owner is None else owner,
        held=value.held,
        rank=value.rank,
        peer=value.peer if peer is None else peer,
        at=value.at,
    )


def parse_entry_value(value: bytes) -> EntryValue:
    """The parts of an entry value. A malformed one reads as a held exclusive entry
    with no owner: it then blocks others (safe), never lets them through."""
    if value.startswith(KILLED_MARK):
        # One mark at most; a value that repeats it (written by something else under
        # the prefix) reads as malformed, not as a recursion as deep as it is long.
        return replace(_parse_unmarked(value[len(KILLED_MARK) :]), killed=True)
    return _parse_unmarked(value)


def _parse_unmarked(value: bytes) -> EntryValue:
    flag, _, rank = value.split(b" ", 1)[0].partition(b":")
    with_peer = flag in (b"W", b"H")
    parts = value.split(b" ", 4 if with_peer else 3)
    try:
        held, limit, ttl = flag in (b"h", b"H"), int(parts[1]), float(parts[2])
        order = int(rank) if rank else 0
    except (ValueError, IndexError):
        return EntryValue(True, 1, None, b"?")
    rest = parts[3:]
    peer = rest.pop(0) if with_peer and rest else b""
    peer, at = _split_time(peer)
    owner = rest[0] if rest else b""
    return EntryValue(held, limit, ttl if ttl > 0 else None, owner, order, peer or owner, at)


def _split_time(peer: bytes) -> tuple[bytes, float | None]:
    """``IP:PORT@SECONDS`` as (address, time); an address without one as it is."""
    address, at, seconds = peer.rpartition(b"@")
    if not at:
        return peer, None
    try:
        return address, float(seconds)
    except ValueError:
        return peer, None


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What a session's record says: the node that serves the session, whether a
    client is connected to it there, its grace time in ms, and its tag (which names
    it in its entries' keys). A ``conn_id`` on another node reads it to judge whether
    the session may be taken over, and to carry its grace time and entries along."""

    node: str
    connected: bool
    grace_ms: int = 0
    tag: int = 0


def encode_record(record: SessionRecord) -> bytes:
    """A session record's value: ``<node id> <connected 0|1> <grace ms> <tag hex>``.
    Fields added later go at the end: :func:`parse_record` ignores what it does not
    know."""
    return b"%s %d %d %x" % (record.node.encode(), record.connected, record.grace_ms, record.tag)


def parse_record(value: bytes) -> SessionRecord:
    """The parts of a record value. Missing or malformed fields read as not
    connected, with no grace time and no tag (a record without a tag was written
    by a node with a lease per session: it cannot be taken over)."""
    parts = value.split(b" ")
    node = parts[0].decode(errors="replace")
    connected = len(parts) > 1 and parts[1] == b"1"
    try:
        grace_ms = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        grace_ms = 0
    try:
        tag = int(parts[3], 16) if len(parts) > 3 else 0
    except ValueError:
        tag = 0
    return SessionRecord(node, connected, grace_ms, tag)


def tat_value(tat: float, node_id: str, since: float | None = None) -> bytes:
    """A TAT's value: the wall-clock time (``repr``, so it reads back exactly), the
    node that wrote it (which deletes it once it lapses) and, when given, the
    writer's wall clock as it wrote: the line's head became the head then, and its
    turn comes no earlier (:mod:`elockd.engine.line_grace`)."""
    if since is None:
        return b"%r %s" % (tat, node_id.encode())
    return b"%r %s %r" % (tat, node_id.encode(), since)


def parse_tat_value(value: bytes) -> tuple[float, str, float]:
    """(TAT, writer, since) of a TAT's value (``since`` ``-inf`` when it has none).
    A malformed one reads as far in the future with no writer: it then refuses
    (safe) until an operator deletes it."""
    parts = value.split(b" ", 2)
    try:
        tat = float(parts[0])
        since = float(parts[2]) if len(parts) > 2 else float("-inf")
    except ValueError:
        return float("inf"), "", float("-inf")
    writer = parts[1].decode(errors="replace") if len(parts) > 1 else ""
    return tat, writer, since


def waiter_value(node_id: str, units: float, capacity: float) -> bytes:
    """A throttle waiter's value: its node, ``units`` (its cost in seconds of its
    rate, N·T) and ``capacity`` (B·T of its rate): enough for a request behind it to
    say when its own turn comes (:func:`.throttle_book.behind`)."""
    return b"%s %r %r" % (node_id.encode(), units, capacity)


def parse_waiter_value(value: bytes) -> tuple[str, float, float]:
    """(node, units, capacity) of a waiter's value; 0 for what does not read."""
    parts = value.split(b" ")
    node = parts[0].decode(errors="replace")
    try:
        return node, float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        return node, 0.0, 0.0
