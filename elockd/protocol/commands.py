"""The command table: every verb of both families, declared once.

Like Redis's command table, each entry says what the verb is and what it takes:
its family (which decides how a refusal reads: ``0 …`` or ``4xx …``), for a word
verb how many positional arguments and which ``name=value`` options, whether it may
be asked before ``auth``, whether it carries a secret that no log may show, and its
handler. The dispatcher
(:class:`elockd.protocol.connection.Connection`) reads nothing else. The table is handed to the
:class:`~elockd.protocol.connection.Service`; no module imports it behind the caller's back.

No verb belongs to both families, and every verb is answered by both backends: a
handler asks its backend through :class:`elockd.backend.interface.Backend`.
"""

from __future__ import annotations

from elockd.protocol import terse, word
from elockd.protocol.connection import TERSE, WORD, Command

ANY_NUMBER = 1 << 30  # mlock takes as many keys as --max-keys allows

TABLE: tuple[Command, ...] = (
    # The terse family: the rest of the line is the key (or the name, for iam/who).
    Command(b"g", TERSE, terse.cmd_g, holds=True),
    Command(b"r", TERSE, terse.cmd_r),
    Command(b"i", TERSE, terse.cmd_i, holds=True),
    Command(b"sg", TERSE, terse.cmd_sg, holds=True),
    Command(b"sr", TERSE, terse.cmd_sr),
    Command(b"si", TERSE, terse.cmd_si, holds=True),
    Command(b"q", TERSE, terse.cmd_q),
    Command(b"d", TERSE, terse.cmd_d, holds=True),
    Command(b"sd", TERSE, terse.cmd_sd, holds=True),
    Command(b"dump", TERSE, terse.cmd_dump, holds=True),
    Command(b"iam", TERSE, terse.cmd_iam),
    Command(b"who", TERSE, terse.cmd_who, holds=True),
    Command(b"me", TERSE, terse.cmd_me),
    # The word family: elock's verbs ...
    Command(
        b"lock",
        WORD,
        word.cmd_lock,
        arguments=2,
        options=word.TTL_OPTION,
        wait_reply=word.acquired_or_not,
        holds=True,
    ),
    Command(b"unlock", WORD, word.cmd_unlock, arguments=1),
    Command(b"unlock_all", WORD, word.cmd_unlock_all),
    Command(b"conn_id", WORD, word.cmd_conn_id, arguments=1, secret=True, holds=True),
    Command(b"set_timeout", WORD, word.cmd_set_timeout, arguments=1),
    Command(b"stats", WORD, word.cmd_stats),
    Command(b"quit", WORD, word.cmd_quit),
    # ... and this project's extensions, in the same style.
    Command(
        b"lock_shared",
        WORD,
        word.cmd_lock_shared,
        arguments=2,
        options=word.SHARED_OPTIONS,
        wait_reply=word.holders_after,
        holds=True,
    ),
    Command(b"unlock_shared", WORD, word.cmd_unlock_shared, arguments=1),
    Command(
        b"mlock",
        WORD,
        word.cmd_mlock,
        arguments=ANY_NUMBER,
        options=word.MLOCK_OPTIONS,
        wait_reply=word.acquired_or_keys,
        holds=True,
    ),
    Command(b"renew", WORD, word.cmd_renew, arguments=1, options=word.TTL_OPTION, holds=True),
    Command(b"token", WORD, word.cmd_token, arguments=1, holds=True),
    Command(b"info", WORD, word.cmd_info, arguments=1, holds=True),
    Command(
        b"throttle",
        WORD,
        word.cmd_throttle_line,
        raw=True,  # its common shape is parsed in one split; see cmd_throttle_line
        wait_reply=word.throttle_line,
    ),
    Command(b"ping", WORD, word.cmd_ping),
    # Operators (docs/protocol.md: Operators).
    Command(b"ls", WORD, word.cmd_ls, arguments=1, options=word.LS_OPTIONS, holds=True),
    Command(b"kill", WORD, word.cmd_kill, arguments=1),
    Command(b"auth", WORD, word.cmd_auth, needs_auth=False, raw=True, secret=True),
    # Operators (issue 28): watch.
    Command(b"watch", WORD, word.cmd_watch, arguments=1, holds=True),
)

#: The table by verb, as the dispatcher reads it.
COMMANDS: dict[bytes, Command] = {command.verb: command for command in TABLE}
assert len(COMMANDS) == len(TABLE), "a verb declared twice"
