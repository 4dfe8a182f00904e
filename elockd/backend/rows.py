"""``ls`` rows a batch of keys at a time, as both backends list them.

Each backend keeps its keys in byte order (:class:`elockd.engine.keyindex.KeyIndex`)
and knows how to make one key's row; what a listing does with them is the same:
skip keys no longer live or not old enough, stop after ``limit`` rows, and yield
None for a batch that listed nothing, so the reply lets other connections run
during a long ``older=`` scan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from elockd.backend.interface import KeyRow, KeyRows


def rows_in_batches(
    batches: Iterable[Iterable[bytes]],
    row_for: Callable[[bytes], KeyRow | None],
    older: float | None,
    limit: int | None,
) -> KeyRows:
    """The rows of ``batches``' keys (``row_for``: None for a key not live)."""
    left = -1 if limit is None else limit
    for batch in batches:
        listed = False
        for key in batch:
            row = row_for(key)
            if row is None or (older is not None and (row.age is None or row.age < older)):
                continue
            listed = True
            yield row
            left -= 1
            if left == 0:
                return
        if not listed:
            yield None
