"""``SharedCalls``: how a ``NodeIndex`` calls the index every engine shares without ever waiting unboundedly.

A call that cannot have the index's lock within its wait (``_nodeindex.Busy``) answers its default; an unpin or a
completion that cannot is owed, in order, and settled before the next operation; an index found damaged past repair
(``_nodeindex.Damaged``) makes the engine leave the pool (``detached``): every later call answers its default.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from typing import Any, TypeVar

from kvoffload import _nodeindex

logger = logging.getLogger("kvoffload.tiers.node.index")  # the index's lines, whichever half of it logs them

_T = TypeVar("_T")

_LOCKING = frozenset({_nodeindex.pin, _nodeindex.unpin, _nodeindex.complete, _nodeindex.reserve, _nodeindex.reset,
                      _nodeindex.release, _nodeindex.set_tenants})
"""The index's operations that take its lock (lookups read without it): one that returns had the lock."""


class SharedCalls:
    """The calling half of ``NodeIndex`` (which gives ``_mine``: the segment, the lock's file and its attachment)."""

    def __init__(self) -> None:
        self.detached: str | None = None
        """Why this engine left the pool (None while it uses it): every lookup is then a miss."""
        self._owed: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []  # unpins and completions not yet had
        self._locked_out = False  # a write gave its wait for the lock up, and none has had it since

    @property
    def _mine(self) -> tuple[mmap.mmap, int, int]:
        raise NotImplementedError

    def _lock_free(self) -> bool:
        """Whether this engine may have the index's lock now: at once while no wait was given up; else one try
        (no wait: the lock's outage, ``_nodeindex``), which ends the outage when it has the lock."""
        if self._locked_out:
            nothing: list[tuple[int, int]] = []
            self._call(_nodeindex.pin, nothing, *self._mine, b"")  # locks, pins nothing
        return not self._locked_out

    def _call(self, operation: Callable[..., _T], default: _T, *args: Any) -> _T:
        """``operation(*args)`` on the shared index; ``default`` when this engine left the pool, when the lock
        was busy past the wait, or when the index is found damaged past repair (then this engine leaves it)."""
        if self.detached is not None:
            return default
        try:
            result = operation(*args)
        except _nodeindex.Busy:
            self._locked_out = True
            return default
        except _nodeindex.Damaged as e:
            self._detach(str(e))
            return default
        if operation in _LOCKING:
            self._locked_out = False
        return result

    def _owe(self, operation: Callable[..., None], *args: Any) -> bool:
        """Run an unpin or a completion now, or owe it (settled at the next operation) when the lock is busy:
        a pin or an in-flight slot never stays forever. Whether it ran now."""
        self._settle()
        if self._owed or not self._run(operation, args):
            self._owed.append((operation, args))
            return False
        return True

    def _settle(self) -> None:
        while self._owed:
            owed = self._owed.pop(0)  # taken first: a run that leaves the pool clears what is owed
            if not self._run(*owed):
                self._owed.insert(0, owed)  # the lock is busy: it stays first, in order
                return

    def _settled(self) -> bool:
        """Settle what is owed; whether nothing is owed now (False: the lock was busy past the wait)."""
        self._settle()
        return not self._owed

    def _run(self, operation: Callable[..., None], args: tuple[Any, ...]) -> bool:
        """Whether ``operation`` is done with: ran, or will never run (this engine left the pool, or it failed
        otherwise than on a busy lock: kept, it would hold up everything owed after it for good)."""
        if self.detached is not None:
            self._owed.clear()
            return True
        try:
            operation(*args)
        except _nodeindex.Busy:
            self._locked_out = True
            return False
        except _nodeindex.Damaged as e:
            self._detach(str(e))
        except Exception:
            logger.exception("node tier: an owed %s failed; dropped, so that what is owed after it settles",
                             getattr(operation, "__name__", operation))
        else:
            self._locked_out = False  # owed work is unpins and completions: it had the lock
        return True

    def _detach(self, reason: str) -> None:
        if self.detached is None:
            self.detached = reason
            logger.warning("node tier: %s; this engine goes on without the node pool (misses) until it restarts",
                           reason)
