"""Rate-limited log lines: a condition that repeats (out of descriptors, clients
refused at a limit) is logged once per interval with a count, never once per event.

A server under a connection flood hits the same condition thousands of times a
second; one line each would fill the disk and cost more than the refusals.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping


class LogThrottle:
    """Log through ``logger`` at ``level`` at most once per ``interval`` seconds.

    The first event logs at once; events within the interval after it are counted,
    and the next line that gets through says how many were held back.
    """

    __slots__ = ("_clock", "_next_at", "_suppressed", "interval", "level", "logger")

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self.interval = interval
        self._clock = clock
        self._next_at = -float("inf")
        self._suppressed = 0

    def __call__(
        self, message: str, *args: object, fields: Mapping[str, object] | None = None
    ) -> bool:
        """Log ``message % args`` unless a line went out less than ``interval`` ago;
        True when it was logged. ``fields`` become the record's structured fields
        (``extra``); with them, the count of lines held back is a field too
        (``held_back``) rather than words added to the message."""
        now = self._clock()
        if now < self._next_at:
            self._suppressed += 1
            return False
        extra = dict(fields or {})
        if self._suppressed:
            if fields is None:
                message += " (%d more like this in the last %.0f s)"
                args = (*args, self._suppressed, self.interval)
            else:  # the event stays one constant string for log pipelines
                extra["held_back"] = self._suppressed
                extra["held_back_seconds"] = self.interval
            self._suppressed = 0
        self._next_at = now + self.interval
        self.logger.log(self.level, message, *args, extra=extra)
        return True
