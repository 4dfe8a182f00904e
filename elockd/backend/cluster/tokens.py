"""Fencing tokens: the one home of the rule that gives every exclusive grant a
token of its own, larger than every one before it.

A hold's token comes from its entry's create revision, the entry's *rank* (a
number the node gives each new entry), and the cluster's token floor
(``<prefix>meta/token_floor``, which :mod:`.node` loads at join): tokens then
increase across keys, nodes and rebuilt clusters.

Why ranks: entries in one queue never share a create revision (a txn that creates
one reads its queue, so two never share a batch, see
:mod:`elockd.backend.cluster.etcd.batch`), but entries of different queues do,
when the keys of one ``mlock`` or the requests of one batch commit together. The
node numbers its new entries round modulo :data:`TOKENS_PER_REVISION`
(:class:`RankCounter`), and the batcher is told to take at most that many ranks in
a row into one batch (one revision): no two holds of a revision share a token.
The etcd client knows nothing of tokens; it is only given that number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

#: Fencing tokens: the entry's create revision times this, plus the entry's rank,
#: plus the floor. Also the most ranks one batch of txns may take in a row.
TOKENS_PER_REVISION = 64


def fencing_token(floor: int, revision: int, rank: int) -> int:
    """The token of the hold whose entry was created at ``revision`` with ``rank``:
    the same on every node, also after a takeover."""
    return floor + revision * TOKENS_PER_REVISION + rank


class Ranked(Protocol):
    """An entry as the mirror knows it, with the rank it was written with."""

    @property
    def rank(self) -> int: ...


def rank_of(entry: Ranked | None) -> int:
    """The rank of an entry the mirror knows (a granted waiter's); 0 for one it
    does not (a grant checks beforehand that the mirror still has it)."""
    return entry.rank if entry is not None else 0


class RankCounter:
    """This node's count of the ranks its new entries take, round modulo
    :data:`TOKENS_PER_REVISION`, in the order their txns are queued."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def take(self, keys: Sequence[bytes]) -> tuple[dict[bytes, int], int]:
        """The rank of each key's new entry, and how many ranks that took (what the
        txn tells the batcher). A request's keys take consecutive ranks in byte
        order (an ``mlock``'s tokens are consecutive), from 0 when they would wrap:
        the ranks skipped count as taken, so that a batch's run of at most
        TOKENS_PER_REVISION ranks never holds one rank twice."""
        start = self.next
        skipped = TOKENS_PER_REVISION - start if start + len(keys) > TOKENS_PER_REVISION else 0
        first = (start + skipped) % TOKENS_PER_REVISION
        self.next = (first + len(keys)) % TOKENS_PER_REVISION
        ranks = {key: first + place for place, key in enumerate(sorted(keys))}
        return ranks, skipped + len(keys)
