"""A circuit breaker for the disk tier: repeated I/O errors switch the tier off for a cool-down.

A failing disk (EIO on every block, a full file system, reads slower than their deadline) would
otherwise cost every job its full I/O attempt and the engine a log line per block. After ``threshold``
consecutive errors the breaker opens: the ``DiskHandler`` fails jobs at once, without I/O, until
``cooldown_s`` has passed; then it closes and I/O is tried again. Opening and closing are logged once each.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class CircuitBreaker:
    """Counts consecutive errors; thread-safe (the I/O threads report to it concurrently)."""

    def __init__(self, threshold: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold <= 0:
            raise ValueError(f"CircuitBreaker threshold {threshold} must be positive")
        if cooldown_s <= 0:
            raise ValueError(f"CircuitBreaker cooldown_s {cooldown_s} must be positive")
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._errors = 0
        self._open_until: float | None = None
        self.trips = 0
        """How many times the breaker opened (for stats and tests)."""
        self.errors = 0
        """Errors reported in all (for stats and tests)."""

    def allow(self) -> bool:
        """True when I/O may be tried (closed, or the cool-down is over, which closes it)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._clock() < self._open_until:
                return False
            self._open_until = None
            self._errors = 0
        logger.warning("disk tier: cool-down over, switching the disk tier back on")
        return True

    def record(self, ok: bool) -> None:
        """Report one I/O outcome; the error that reaches the threshold opens the breaker."""
        with self._lock:
            if ok:
                self._errors = 0
                return
            self._errors += 1
            self.errors += 1
            if self._open_until is not None or self._errors < self._threshold:
                return
            self._open_until = self._clock() + self._cooldown_s
            self.trips += 1
            errors = self._errors
        logger.error("disk tier: %d consecutive I/O errors, switching the disk tier off for %.1f s",
                     errors, self._cooldown_s)

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None and self._clock() < self._open_until
