"""When a throttle line's head loses its place: the rule, pure (no I/O, time passed in).

Only the head of a key's line is admitted, at its turn. On one server the server
itself admits the head when its turn comes, so a head always takes its turn. On a
cluster the head is admitted by its own node, and a node cut from etcd cannot: its
head would hold the whole line until etcd lapses the node's lease. So a head that
has not taken its turn ``grace`` seconds after it came is *passed over*: the next
waiter becomes the head (and its turn comes no earlier than that moment), and a
request that does not wait is admitted as if the passed-over head had left (its
refusal may still count the head's turn in ``retry``: later, never sooner).

Every node computes this from what etcd holds alone (the key's TAT, the wall time
``since`` of the write that set it, the line's rates) and its own wall clock, so
all nodes agree up to their clock skew. A head's turn is :func:`turn`: its GCRA
admission time, but never before it became the head (``since``: a waiter behind
an admission, or behind a passed-over head, became the head then).

Passing a head over admits nobody: the TAT stays, so the rate is whatever the
GCRA allows, whoever is admitted next.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

#: A waiter as the rule (and a request behind it) sees it: (units, capacity), N·T
#: and B·T of its own rate.
Step = tuple[float, float]
#: A line entry as passing over names it: (etcd key, create revision, node).
Head = tuple[bytes, int, str]


def turn(tat: float, since: float, units: float, capacity: float) -> float:
    """When a head's turn comes on a key at ``tat``: its GCRA admission time
    (``tat + N·T - B·T``), but never before ``since``, when it became the head."""
    return max(tat + units - capacity, since)


def passed_over(
    tat: float, since: float, now: float, grace: float, line: Iterable[Step], limit: int
) -> tuple[int, float]:
    """How many heads of ``line`` (oldest first, at most ``limit``) are passed over
    at ``now``, and when the next one will be (``inf``: never, as things stand).

    The first is passed over ``grace`` after its turn; each next one became the
    head then, so it is passed over ``grace`` after its own turn counted from
    there. A key with no TAT (``-inf``) passes nobody: no write says when a turn
    came."""
    if tat == -math.inf:
        return 0, math.inf
    count, came = 0, since
    for units, capacity in line:
        if count >= limit:
            break
        due = turn(tat, came, units, capacity) + grace
        if now <= due:
            return count, due
        came = due
        count += 1
    return count, math.inf


def passed_entries(heads: Sequence[Head], count: int) -> tuple[Head, ...]:
    """What passing over the first ``count`` of ``heads`` (a line's first entries,
    oldest first) removes: them, and every later entry of those ``heads`` that the
    same nodes serve. A node that let a turn pass cannot take the next one either
    (it is cut from etcd, paused or stuck): each of its entries would cost the line
    one more grace when it came to the head."""
    if not count:
        return ()
    silent = {node for _, _, node in heads[:count]}
    return (*heads[:count], *(head for head in heads[count:] if head[2] in silent))
