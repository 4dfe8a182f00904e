"""The one command table: every verb of both families and its handler.

No verb belongs to both families, so one dict serves both; ``WORD_VERBS`` tells the
dispatcher which style of refusal (``0 …`` or ``403 …``) a verb's client expects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elockd.terse import TERSE_COMMANDS
from elockd.word import WORD_COMMANDS

if TYPE_CHECKING:
    from elockd.protocol import Handler

assert not TERSE_COMMANDS.keys() & WORD_COMMANDS.keys(), "a verb in both families"

COMMANDS: dict[bytes, Handler] = {**TERSE_COMMANDS, **WORD_COMMANDS}
WORD_VERBS = frozenset(WORD_COMMANDS)
