"""Faults of a shared tier's jobs, each kind logged once per outage.

A server that is down fails every job the same way, so ``FaultLog`` logs the first fault of each kind at warning
level and later ones at debug level, until a job succeeds again (then it says so once, and the next outage is
logged afresh). The remote tier (``tiers.remote.faults``) and the object tier (``tiers.object.faults``) name
their own kinds.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)



class TierFault(enum.Enum):
    """The base of a shared tier's fault kinds (``tiers.remote.faults.Fault``, ``tiers.object.faults.Fault``): an
    enum with an ``ERROR`` member (the unknown kind) and a ``TIMEOUT`` member (a job past its budget), whose members
    say whether they count towards the tier's breaker."""

    @property
    def is_server_fault(self) -> bool:
        """The server, or the way to it, is failing: counts towards the breaker."""
        raise NotImplementedError


FaultT = TypeVar("FaultT", bound=TierFault)


class FaultLog(Generic[FaultT]):
    """Logs each kind of fault once per outage; thread-safe (both lanes of a handler report to it).

    Args:
        where: the server, as the log names it (never with a password).
        kinds: the tier's fault kinds; its ``ERROR`` member is the unknown kind, whose first one is logged with
            its traceback (it may be our bug).
        tier: the tier's name in the log.
    """

    def __init__(self, where: str, kinds: type[FaultT], tier: str = "remote tier") -> None:
        self._where = where
        self._tier = tier
        self._unknown = kinds["ERROR"]
        self._lock = threading.Lock()
        self._seen: set[FaultT] = set()
        self.counts: dict[FaultT, int] = dict.fromkeys(kinds, 0)
        """Faults of each kind so far (for stats and tests)."""

    def note(self, fault: FaultT, error: BaseException | str,
             consequence: str = "the jobs that meet it fail (loads are recomputed, stores skipped)") -> None:
        with self._lock:
            self.counts[fault] += 1
            first = fault not in self._seen
            self._seen.add(fault)
        if first:
            # An error of no known kind may be our bug: its first one comes with the traceback.
            logger.warning("%s (%s): %s: %s; %s; later ones are logged at debug level", self._tier, self._where,
                           fault.value, error, consequence,
                           exc_info=error if fault is self._unknown and isinstance(error, BaseException) else None)
        else:
            logger.debug("%s (%s): %s: %s", self._tier, self._where, fault.value, error)

    @property
    def noted(self) -> int:
        """Faults noted so far, of every kind (a job's answer ends an outage only if none came after it began)."""
        with self._lock:
            return sum(self.counts.values())

    def recovered(self) -> None:
        """A job succeeded: if faults were logged, say once that the tier serves again."""
        with self._lock:
            if not self._seen:
                return
            self._seen.clear()
        logger.warning("%s (%s): serving again", self._tier, self._where)
