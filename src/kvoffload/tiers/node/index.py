"""The node tier's scheduler side: ``NodeIndex``, a ``ResidencyManager`` over the index every engine shares.

It stands where the private host tier's ``SlotIndex`` stands (under ``TieredManager`` when tiers sit below), and
means the same, with what sharing adds:

- ``lookup`` counts keys any engine stored; a key another engine is still storing is a miss, not ``pending`` (that
  engine may stop stepping before it finishes; only this engine's own stores are worth waiting for);
- ``prepare_load`` pins in the shared index. A key evicted by another engine since this engine's lookup gets
  epoch 0 in the spec, which the worker's ``NodeCheck`` fails without copying: a recompute, never a wrong
  block. Each slot's epoch goes with the spec (``HostBlocks.epochs``) so a worker also fails a load whose slot
  was rewritten under it;
- an engine's repeated pins of one key are counted here, once in the shared index;
- eviction is CLOCK over the whole pool (``_nodeindex.c``); ``eviction_policy`` applies to the tiers below;
- ``reset`` drops only the blocks this engine wrote; ``usage`` is the whole pool's;
- at most once a ``RECLAIM_S`` the index releases what engines that died hold (pins, half-made stores).

Not thread-safe, like every manager; the shared index itself is safe across processes.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Sequence

from kvoffload import _nodeindex
from kvoffload.config import ConfigError
from kvoffload.keys import KEY_BYTES, OffloadKey
from kvoffload.manager.base import (
    EventKind,
    IntegrityError,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    ResidencyManager,
    TierUsage,
)
from kvoffload.specs import HostBlocks, Medium
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.segment import MISSING_EPOCH, own_identity

logger = logging.getLogger(__name__)

POOL_COUNTERS = ("capacity", "used", "stores", "evictions", "cross_hits", "repairs", "reclaimed", "attached",
                 "served")
"""What ``pool_counters`` reports (the engines' /metrics: ``vllm:kvoffload_node_pool``): the pool's counters, and
``served``, this engine's own: hits other engines took on blocks it stored."""
RECLAIM_S = 1.0
"""How often an engine looks for dead engines' pins and stores: the bound on how long they block anything."""


class NodeIndex(ResidencyManager):
    """One engine's view of the node pool's shared index.

    Args:
        segment: the mapped index (``segment.open_index``).
        locks: this engine's handle on the pool's ``engines`` file (``liveness``): it locks its attachment's byte
            there for as long as it runs, and an attachment nobody locks is a dead engine's. Its own: the index
            closes it.
    Raises:
        ConfigError: every attachment of the pool is taken (``_nodeindex.MAX_ATTACH`` engines).
    """

    medium = Medium.HOST

    def __init__(self, segment: mmap.mmap, locks: EngineLocks) -> None:
        self._segment = segment
        self._locks = locks
        stats = _nodeindex.stats(segment)
        self.capacity: int = stats["capacity"]
        self._last_reclaim = 0.0
        self.attachment: int = -1  # none yet: the reclaim below skips no one
        self._reclaim(force=True)
        start, pidns = own_identity()
        self._identity = (os.getpid(), start)
        try:
            with locks.attaching():  # nobody judges the attachment before its byte is locked
                attachment = _nodeindex.attach(segment, os.getpid(), start, pidns)
                if attachment < 0:
                    raise ConfigError(
                        f"host_scope node: {_nodeindex.MAX_ATTACH} engines already share this node pool")
                try:
                    locks.hold(attachment)
                except BaseException:
                    _nodeindex.release(segment, attachment, *self._identity, False)
                    raise
        except BaseException:
            locks.close()
            raise
        self.attachment = attachment
        self._pins: dict[OffloadKey, list[int]] = {}  # key -> [slot, epoch, count] of this engine's pins
        self._in_flight: dict[OffloadKey, tuple[int, int]] = {}  # this engine's stores: key -> (slot, epoch)
        self._events: list[OffloadEvent] = []

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        self._reclaim()
        hits, pending = _nodeindex.lookup(self._segment, self.attachment, b"".join(keys))
        return LookupResult(hits, pending)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> HostBlocks:
        pins = self._pins
        new = [key for key in dict.fromkeys(keys) if key not in pins]
        if new:
            pinned = _nodeindex.pin(self._segment, self.attachment, b"".join(new))
            for key, (slot, epoch) in zip(new, pinned, strict=True):
                pins[key] = [max(slot, 0), epoch, 0]
        entries = [pins[key] for key in keys]
        for entry in entries:
            entry[2] += 1
        return HostBlocks(tuple(e[0] for e in entries), (len(entries),), epochs=tuple(e[1] for e in entries))

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        _nodeindex.touch(self._segment, b"".join(keys))

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        pins = self._pins
        done: list[list[int]] = []
        for key in keys:
            entry = pins.get(key)
            if entry is None:
                continue  # not pinned: a repeated completion
            entry[2] -= 1
            if entry[2] == 0:
                del pins[key]
                if entry[1] != MISSING_EPOCH:
                    done.append(entry)
        if done:
            _nodeindex.unpin(self._segment, self.attachment, [e[0] for e in done], [e[1] for e in done],
                             not success)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        self._reclaim()
        unique = list(dict.fromkeys(keys))
        out = _nodeindex.reserve(self._segment, self.attachment, b"".join(unique))
        if out is None:
            return None
        positions, slots, epochs, evicted = out
        new = tuple(unique[i] for i in positions)
        self._in_flight.update(zip(new, zip(slots, epochs, strict=True), strict=True))
        evicted_keys = tuple(OffloadKey(evicted[i:i + KEY_BYTES]) for i in range(0, len(evicted), KEY_BYTES))
        if evicted_keys:
            self._emit(EventKind.REMOVED, evicted_keys)
        return PrepareStoreOutput(new, HostBlocks(tuple(slots), (len(slots),), epochs=tuple(epochs)), evicted_keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self.complete_store_keys(keys, success)

    def complete_store_keys(self, keys: Sequence[OffloadKey], success: bool = True) -> list[OffloadKey]:
        """``complete_store``, answering the keys that became ready (this engine's in-flight ones, once each)."""
        done = [(key, entry) for key in keys if (entry := self._in_flight.pop(key, None)) is not None]
        if not done:
            return []
        _nodeindex.complete(self._segment, self.attachment, [e[0] for _, e in done], [e[1] for _, e in done],
                            success)
        if not success:
            return []
        stored = [key for key, _ in done]
        self._emit(EventKind.STORED, stored)
        return stored

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        dropped = _nodeindex.reset(self._segment, self.attachment)
        if dropped:
            logger.info("reset node tier: dropped the %d blocks this engine wrote", dropped)

    def check_integrity(self) -> None:
        """The shared index's laws (``_nodeindex.check``), and this engine's: a pin count is positive."""
        problem = _nodeindex.check(self._segment, self.attachment)
        if problem is not None:
            raise IntegrityError(f"node tier: {problem}")
        if any(entry[2] <= 0 for entry in self._pins.values()):
            raise IntegrityError("node tier: a pin count of this engine is not positive")

    def usage(self) -> list[TierUsage]:
        stats = _nodeindex.stats(self._segment)
        return [TierUsage(self.medium, stats["used"], stats["capacity"])]

    def pool_counters(self) -> dict[str, int]:
        """``POOL_COUNTERS``: the whole pool's capacity, used, stores, evictions, hits across engines, repairs after
        a crash, engines reclaimed (found dead) and attached; and this engine's ``served``."""
        stats = _nodeindex.stats(self._segment)
        stats["served"] = _nodeindex.served(self._segment, self.attachment) if self.attachment >= 0 else 0
        return {name: int(stats[name]) for name in POOL_COUNTERS}

    def close(self) -> None:
        """Detach: this engine's pins and unfinished stores go (an engine that dies is reclaimed instead)."""
        if self.attachment >= 0:
            _nodeindex.release(self._segment, self.attachment, *self._identity, False)
            self.attachment = -1
            self._locks.close()  # after the release: a lock gone first would let another engine reclaim this one

    def _reclaim(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_reclaim < RECLAIM_S:
            return
        self._last_reclaim = now
        with self._locks.looking() as may:
            if not may:
                return  # an engine is attaching: look again at the next reclaim
            for attachment, pid, start, _ in _nodeindex.attachments(self._segment):
                if attachment != self.attachment and not self._locks.held(attachment) and \
                        _nodeindex.release(self._segment, attachment, pid, start, True):
                    logger.warning("node tier: engine process %d died; released its pins and unfinished stores",
                                   pid)

    def _emit(self, kind: EventKind, keys: Sequence[OffloadKey]) -> None:
        self._events.append(OffloadEvent(kind, tuple(keys), self.medium))
