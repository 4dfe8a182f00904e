"""The word family's arguments: blank-separated tokens, the key one token, then
``name=value`` options after the positional arguments.

Each word verb declares how many positional arguments and which options it takes
(:mod:`elockd.protocol.commands`); the dispatcher splits a request into :class:`Args` by
that declaration before the verb's handler runs, so a request with an unknown
option, too many arguments or a bad number gets ``400 Bad Request: REASON`` and
changes nothing. Numbers are decimal and finite, durations at most ``--max-ttl``.
"""

from __future__ import annotations

import math
import re


class BadRequest(Exception):
    """Bad arguments to a known verb; becomes ``400 Bad Request: REASON``."""


_NUMBER = re.compile(rb"(?:\d+(?:\.\d*)?|\.\d+)\Z")


class Args:
    """A word request's tokens, split into positional arguments and options."""

    __slots__ = ("max_seconds", "options", "positional")

    def __init__(
        self,
        rest: bytes,
        allowed: frozenset[bytes],
        max_positional: int,
        max_seconds: float = math.inf,
    ) -> None:
        """``max_seconds`` bounds every duration the request gives (``--max-ttl``)."""
        self.max_seconds = max_seconds
        tokens = [t for t in rest.replace(b"\t", b" ").split(b" ") if t]
        self.positional: list[bytes] = []
        self.options: dict[bytes, bytes] = {}
        for index, token in enumerate(tokens):
            if index > 0 and b"=" in token:
                name, _, value = token.partition(b"=")
                if name not in allowed:
                    raise BadRequest(f"unknown option {name.decode(errors='replace')}")
                if name in self.options:
                    raise BadRequest(f"option {name.decode()} given twice")
                self.options[name] = value
            elif self.options:
                raise BadRequest("options must follow the arguments")
            else:
                self.positional.append(token)
        if len(self.positional) > max_positional:
            raise BadRequest("too many arguments")

    def key(self) -> bytes:
        if not self.positional:
            raise BadRequest("missing key")
        return self.positional[0]

    def seconds(self, index: int, what: str) -> float | None:
        """Positional ``index`` as non-negative seconds, or None when absent."""
        if len(self.positional) <= index:
            return None
        return parse_seconds(self.positional[index], what, self.max_seconds)

    def option_seconds(self, name: bytes) -> float | None:
        """A ``name=S`` option; it must be above zero (a 0 s lease is no lease)."""
        value = self.options.get(name)
        if value is None:
            return None
        seconds = parse_seconds(value, name.decode(), self.max_seconds)
        if seconds <= 0:
            raise BadRequest(f"{name.decode()} must be above 0")
        return seconds

    def limit(self) -> int | None:
        """``limit=N``: a whole number above 0, or None when absent."""
        value = self.options.get(b"limit")
        return None if value is None else parse_whole(value, "limit", 1)


def parse_whole(token: bytes, what: str, least: int) -> int:
    """A whole number of at least ``least`` (0 or 1): no signs, no decimals."""
    if not token.isdigit():
        raise BadRequest(f"{what} must be a whole number" + (" above 0" if least else ""))
    digits = token.lstrip(b"0")
    if len(digits) > 18:
        # int() refuses more than 4,300 digits (reachable with a large --max-line),
        # and its ValueError would end the server; no count reaches 10**18 anyway.
        return 10**18
    value = int(digits or b"0")
    if value < least:
        raise BadRequest(f"{what} must be a whole number above 0")
    return value


def parse_number(token: bytes, what: str) -> float:
    """Decimal, non-negative, finite: ``2``, ``2.5``, ``.5``. No signs, exponents,
    ``inf`` or ``nan``; 400 digits are a float too large to be finite: refused."""
    if not _NUMBER.match(token):
        raise BadRequest(f"{what} must be a non-negative number")
    value = float(token)
    if value == math.inf:
        raise BadRequest(f"{what} is too large")
    return value


def parse_seconds(token: bytes, what: str, most: float) -> float:
    """A duration in seconds, at most ``most`` (``--max-ttl``): a deadline a day
    away is a lease; one a million years away is a session nobody will ever free."""
    value = parse_number(token, what)
    if value > most:
        raise BadRequest(f"{what} above --max-ttl ({most:g} s)")
    return value
