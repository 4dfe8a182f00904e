"""The two reply styles of the terse family, ``--replies elockd`` and ``--replies glockd``.

elockd's replies are fixed lines, so they are prebuilt once; glockd's name the key.
Both classes answer the same questions, so the command handlers never branch on
the style.
"""

from __future__ import annotations

from typing import Protocol


class TerseReplies(Protocol):
    def got(self, key: bytes) -> bytes: ...
    def cannot_get(self, key: bytes) -> bytes: ...
    def released(self, key: bytes) -> bytes: ...
    def cannot_release(self, key: bytes) -> bytes: ...
    def locked(self, key: bytes) -> bytes: ...
    def not_locked(self, key: bytes) -> bytes: ...
    def shared_got(self, count: int, key: bytes) -> bytes: ...
    def shared_released(self, key: bytes) -> bytes: ...
    def shared_cannot_release(self, key: bytes) -> bytes: ...
    def shared_locked(self, count: int, key: bytes) -> bytes: ...
    def shared_not_locked(self, key: bytes) -> bytes: ...


class ElockdReplies:
    """The default: short fixed texts; lockd clients read the leading integer."""

    def got(self, key: bytes) -> bytes:
        return b"1 Got Lock\r\n"

    def cannot_get(self, key: bytes) -> bytes:
        return b"0 Cannot Get Lock\r\n"

    def released(self, key: bytes) -> bytes:
        return b"1 Released Lock\r\n"

    def cannot_release(self, key: bytes) -> bytes:
        return b"0 Cannot Release Lock\r\n"

    def locked(self, key: bytes) -> bytes:
        return b"1 Locked\r\n"

    def not_locked(self, key: bytes) -> bytes:
        return b"0 Not Locked\r\n"

    def shared_got(self, count: int, key: bytes) -> bytes:
        return b"%d Got Lock\r\n" % count

    def shared_released(self, key: bytes) -> bytes:
        return b"1 Released Lock\r\n"

    def shared_cannot_release(self, key: bytes) -> bytes:
        return b"0 Cannot Release Lock\r\n"

    def shared_locked(self, count: int, key: bytes) -> bytes:
        return b"%d Locked\r\n" % count

    def shared_not_locked(self, key: bytes) -> bytes:
        return b"0 Not Locked\r\n"


class GlockdReplies:
    """glockd's texts, which repeat the key."""

    def got(self, key: bytes) -> bytes:
        return b"1 Lock Get Success: %s\r\n" % key

    def cannot_get(self, key: bytes) -> bytes:
        return b"0 Lock Get Failure: %s\r\n" % key

    def released(self, key: bytes) -> bytes:
        return b"1 Lock Release Success: %s\r\n" % key

    def cannot_release(self, key: bytes) -> bytes:
        return b"0 Lock Release Failure: %s\r\n" % key

    def locked(self, key: bytes) -> bytes:
        return b"1 Lock Is Locked: %s\r\n" % key

    def not_locked(self, key: bytes) -> bytes:
        return b"0 Lock Not Locked: %s\r\n" % key

    def shared_got(self, count: int, key: bytes) -> bytes:
        return b"%d Shared Lock Get Success: %s\r\n" % (count, key)

    def shared_released(self, key: bytes) -> bytes:
        return b"1 Shared Lock Release Success: %s\r\n" % key

    def shared_cannot_release(self, key: bytes) -> bytes:
        return b"0 Shared Lock Release Failure: %s\r\n" % key

    def shared_locked(self, count: int, key: bytes) -> bytes:
        return b"%d Shared Lock Is Locked: %s\r\n" % (count, key)

    def shared_not_locked(self, key: bytes) -> bytes:
        return b"0 Shared Lock Not Locked: %s\r\n" % key


STYLES: dict[str, TerseReplies] = {"elockd": ElockdReplies(), "glockd": GlockdReplies()}
