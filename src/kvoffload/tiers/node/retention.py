"""Retention hints in the node pool: one engine's side of the deadlines the shared index keeps (``_nodeindex.c``).

A hinted request's blocks must outlive the other blocks of the pool, whichever engine's stores press on them, so
the deadline lives in the shared index, one per slot (milliseconds of CLOCK_MONOTONIC, the clock of
``RetentionBook``), not in the engine's book: a store carries the deadlines the book has for its keys, and the
book's ``hold`` raises the deadlines of keys already in the pool (``NodeRetention.retain``, this engine's
``RetainTier`` on the book). The index's sweeps pass retained slots while any other victim is left, then take them
oldest deadline first (docs/node.md, "Retention hints").

The cap is this engine's: ``share`` of the pool's slots, sent with every call that gives deadlines (engines with
other shares each enforce theirs when they give one). The figures are the pool's, every engine's blocks counted.
"""

from __future__ import annotations

import math
import mmap
from array import array
from collections.abc import Callable, Sequence

from kvoffload import _nodeindex
from kvoffload.index.retention import RetainCounts, RetentionBook
from kvoffload.keys import OffloadKey
from kvoffload.tiers.node.tenants import Call

Mine = Callable[[], tuple[mmap.mmap, int, int]]
"""The index's segment, lock file and attachment, as they are now (``NodeIndex._mine``)."""


class NodeRetention:
    """The node pool on ``book`` (registered as one of its tiers): deadlines into the shared index.

    Args:
        book: the engine's retention deadlines.
        capacity: the pool's slots (the cap is ``book.share`` of them).
        call: ``NodeIndex._call`` (a busy lock or a pool left answers the default: a hint lost, never an error).
        mine: ``NodeIndex._mine``.
    """

    tier = "host"

    def __init__(self, book: RetentionBook, capacity: int, call: Call, mine: Mine) -> None:
        self._book = book
        self.cap = math.floor(book.share * capacity)
        self._call = call
        self._mine = mine
        book.tiers.append(self)

    def reserve_args(self, keys: Sequence[OffloadKey]) -> tuple[bytes, int] | tuple[()]:
        """What ``_nodeindex.reserve`` takes after the tenants for ``keys``: their deadlines and the cap, or nothing
        while none has one (the call is then the one hints off makes)."""
        deadlines = self._deadlines(keys)
        return (deadlines, self.cap) if deadlines else ()

    def retain(self, keys: Sequence[OffloadKey]) -> None:
        deadlines = self._deadlines(keys)
        if deadlines:
            self._call(_nodeindex.retain, 0, *self._mine(), b"".join(keys), deadlines, self.cap)

    def retained(self) -> int:
        return self._figures()[0]

    def counts(self) -> RetainCounts:
        _, hits, demoted, evicted = self._figures()
        return RetainCounts(hits, demoted, evicted)

    def _figures(self) -> tuple[int, int, int, int]:
        return self._call(_nodeindex.retention, (0, 0, 0, 0), self._mine()[0])

    def _deadlines(self, keys: Sequence[OffloadKey]) -> bytes:
        """Each key's live deadline in ms (0: none), 8 bytes a key; empty when no key has one (or the cap is 0)."""
        book = self._book
        if not book.active or self.cap == 0:
            return b""
        ms = array("Q", (math.ceil(d * 1000) if (d := book.deadline(key)) is not None else 0 for key in keys))
        return ms.tobytes() if any(ms) else b""


__all__ = ["NodeRetention"]
