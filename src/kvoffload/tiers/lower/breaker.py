"""A circuit breaker for a lower tier: repeated I/O errors switch the tier off for a cool-down.

A failing disk (EIO on every block, a full file system, reads slower than their deadline) or an unreachable
remote server would otherwise cost every job its full I/O attempt and the engine a log line per block. After
``threshold`` consecutive errors (or one that every next attempt would meet: ``fail(at_once=True)``) the breaker
opens: the handler (``DiskHandler``, ``RemoteHandler``, ``ObjectHandler``) or the scheduler's probe of a shared store
fails at once, without I/O, until ``cooldown_s`` has passed; then it closes and I/O is tried again. Opening and
closing are logged once each, under the tier's name.
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
                 clock: Callable[[], float] = time.monotonic, tier: str = "disk tier") -> None:
        if threshold <= 0:
            raise ValueError(f"CircuitBreaker threshold {threshold} must be positive")
        if cooldown_s <= 0:
            raise ValueError(f"CircuitBreaker cooldown_s {cooldown_s} must be positive")
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._tier = tier
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
        logger.warning("%s: cool-down over, switching the %s back on", self._tier, self._tier)
        return True

    def record(self, ok: bool, since: int | None = None) -> None:
        """Report one I/O outcome; the error that reaches the threshold opens the breaker.

        Args:
            since: for a success, ``errors`` when its I/O began. I/O threads report in the order their I/O ends,
                not the order it happened: a success begun before the latest error says nothing of the tier now,
                so it does not reset the count (a slow read that started before a disk failed would otherwise
                keep the breaker from ever opening). None: the I/O began after every error reported.
        """
        with self._lock:
            if ok:
                if since is None or since == self.errors:
                    self._errors = 0
                return
            self._errors += 1
            self.errors += 1
            if self._open_until is not None or self._errors < self._threshold:
                return
            self._open_until = self._clock() + self._cooldown_s
            self.trips += 1
            errors = self._errors
        logger.error("%s: %d consecutive I/O errors, switching the %s off for %.1f s",
                     self._tier, errors, self._tier, self._cooldown_s)

    def fail(self, error: BaseException | str, at_once: bool = False) -> None:
        """Report one failure; ``at_once``: a failure every next attempt would meet too (a timeout that would cost
        the caller the same wait, a refusal), which opens the breaker now, logged with ``error``."""
        if not at_once:
            self.record(False)
            return
        with self._lock:
            self._errors += 1
            self.errors += 1
            opening = self._open_until is None or self._clock() >= self._open_until
        if opening:
            logger.error("%s: %s; switching the %s off for %.1f s", self._tier, error, self._tier, self._cooldown_s)
        self.trip()

    def trip(self) -> None:
        """Open now, for one cool-down (the caller logs why: e.g. a server that is down at start-up)."""
        with self._lock:
            if self._open_until is None:
                self.trips += 1
            self._open_until = self._clock() + self._cooldown_s

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None and self._clock() < self._open_until
