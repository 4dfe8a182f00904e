"""Rate-limited log lines: a condition that repeats (out of descriptors, clients
refused at a limit, sessions ending with locks) is logged a bounded number of times
per interval with a count, never once per event.

A server under a connection flood hits the same condition thousands of times a
second; one line each would fill the disk and cost more than the refusals. Every
line a client can cause again and again goes through one of these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping


class LogThrottle:
    """Log through ``logger`` at ``level`` at most ``burst`` times per ``interval``
    seconds.

    The first event logs at once and opens a window of ``interval`` seconds; up to
    ``burst`` events in it are logged, the rest are counted, and the first line that
    gets through after the window says how many were held back.
    """

    __slots__ = (
        "_clock",
        "_sent",
        "_suppressed",
        "_window_end",
        "burst",
        "interval",
        "level",
        "logger",
    )

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        burst: int = 1,
    ) -> None:
        self.logger = logger
        self.level = level
        self.interval = interval
        self.burst = burst
        self._clock = clock
        self._window_end = -float("inf")
        self._sent = 0
        self._suppressed = 0

    @property
    def held_back(self) -> int:
        """Events counted but not logged yet (told with the next line logged)."""
        return self._suppressed

    def __call__(
        self, message: str, *args: object, fields: Mapping[str, object] | None = None
    ) -> bool:
        """Log ``message % args`` unless ``burst`` lines went out in the current
        window; True when it was logged. ``fields`` become the record's structured
        fields (``extra``); with them, the count of lines held back is a field too
        (``held_back``) rather than words added to the message."""
        now = self._clock()
        if now >= self._window_end:
            self._window_end = now + self.interval
            self._sent = 0
        if self._sent >= self.burst:
            self._suppressed += 1
            return False
        self._sent += 1
        extra = dict(fields or {})
        if self._suppressed:
            if fields is None:
                message += " (%d more like this in the last %.0f s)"
                args = (*args, self._suppressed, self.interval)
            else:  # the event stays one constant string for log pipelines
                extra["held_back"] = self._suppressed
                extra["held_back_seconds"] = self.interval
            self._suppressed = 0
        self.logger.log(self.level, message, *args, extra=extra)
        return True
