"""Warnings that repeat (one per dead letter, one per failed batch) logged at most once per
interval per kind, with how many were held back; metrics count every one of them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, kind: str, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``message`` unless ``kind`` was logged less than ``interval_s`` ago; returns
        whether it was logged. A logged line says how many of its kind were held back."""
        now = self.clock()
        if now - self._last.get(kind, float("-inf")) < self.interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        held = self._held.pop(kind, 0)
        suffix = f" (and {held} more like it in the last {self.interval_s:g} s)" if held else ""
        self._last[kind] = now
        self.logger.log(level, message + suffix, *args, exc_info=exc_info)
        return True
