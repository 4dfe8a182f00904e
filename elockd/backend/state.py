"""The record format of a hand-over state, as every backend writes its tables in it
(docs/upgrade.md).

A state is a stream of JSON records, each ``{"t": KIND, ...}``. A backend writes
its own tables (:meth:`elockd.backend.interface.Backend.dump`) and reads them back
(:meth:`~elockd.backend.interface.Backend.restore`); the hand-over
(:mod:`elockd.handover.records`) adds the service's counters to the backend's first
record and the parked connections after its last, and never looks inside the
tables. Bytes (keys, peers, names) travel as latin-1 strings, which map every
byte to one character and back; times travel as durations, because each process
has its own clock.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar

from elockd.engine.sessions import Session

#: Rows per record: a record stays well under a megabyte even with long keys.
BATCH = 2000

Record = dict[str, Any]


class StateError(Exception):
    """The stream is not a state this code can adopt (the message says why)."""


def text(data: bytes) -> str:
    return data.decode("latin-1")


def raw(data: str) -> bytes:
    return data.encode("latin-1")


def time_left(deadline: float | None, now: float) -> float | None:
    """A deadline as a duration: each process has its own clock (None: no deadline)."""
    return None if deadline is None or deadline == math.inf else deadline - now


def batches(kind: str, rows: Iterator[list[Any]]) -> Iterator[Record]:
    batch: list[list[Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= BATCH:
            yield {"t": kind, "rows": batch}
            batch = []
    if batch:
        yield {"t": kind, "rows": batch}


#: Fields every backend's session row starts with (see :func:`session_row`).
SESSION_FIELDS = 6
S = TypeVar("S", bound=Session)


def session_row(session: Session, now: float) -> list[Any]:
    """What every backend keeps of a session: id, peer, name, grace, whether
    connected, and the grace time left (None: not in grace). A backend adds its own
    fields after these."""
    name = None if session.name is None else text(session.name)
    return [
        session.id,
        text(session.peer),
        name,
        session.grace,
        session.connected,
        time_left(session.grace_deadline, now),
    ]


def restored_session(kind: type[S], row: Sequence[Any], now: float) -> tuple[S, float | None]:
    """A session of ``kind`` from a row's first :data:`SESSION_FIELDS`, and when its
    grace ends on this clock (None: not in grace)."""
    session_id, peer, name, grace, connected, grace_left = row[:SESSION_FIELDS]
    session = kind(session_id, raw(peer))
    session.name = None if name is None else raw(name)
    session.grace = grace
    session.connected = connected
    return session, None if grace_left is None else now + grace_left


class TableDump(Protocol):
    """A backend's tables on their way out."""

    #: Each session's place in the dump, filled in as :meth:`records` runs: the
    #: hand-over names a connection's session by it.
    places: dict[Session, int]

    def records(self) -> Iterator[Record]:
        """The tables' records, a batch at a time; the first one the header, to
        which the hand-over adds the service's own counters."""

    def pending_ref(self, later: Any, session: Session) -> int:
        """How the records name a waiting request that ``session``'s connection
        still has to answer (one given to ``dump``), once :meth:`records` ran."""


class TableRestore(Protocol):
    """A predecessor's tables on their way in, record by record."""

    #: The sessions in the order of their places in the dump.
    sessions: list[Session]

    def feed(self, record: Record) -> None:
        """Take one of the backend's records in (:class:`StateError` if it is none)."""

    def pending(self, ref: int) -> Any:
        """The waiting request (a :class:`~elockd.backend.interface.Later`) that
        :meth:`TableDump.pending_ref` named ``ref``."""

    def finish(self, gone: list[Session]) -> None:
        """Every record is in; ``gone``: sessions whose connection did not come
        along, to end by the usual rules."""

    def counts(self) -> tuple[int, int]:
        """Sessions and holds taken over, for the log line."""


class RecordReader:
    """Feeds each record to the method named after its kind (``_sessions`` for
    ``{"t": "sessions"}``)."""

    def feed(self, record: Record) -> None:
        handler = getattr(self, f"_{record.get('t')}", None)
        if handler is None:
            raise StateError(f"unexpected record {record.get('t')!r}")
        handler(record)
