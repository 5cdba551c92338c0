"""The node tier's scheduler side: ``NodeIndex``, a ``BlockIndex`` over the index every engine shares.

It stands where the private host tier's ``SlotIndex`` stands (under ``TieredIndex`` when tiers sit below), and
means the same, with what sharing adds:

- ``lookup`` counts keys any engine stored; a key another engine is still storing is a miss, not ``pending`` (that
  engine may stop stepping before it finishes; only this engine's own stores are worth waiting for);
- ``prepare_load`` pins in the shared index. A key evicted by another engine since this engine's lookup gets
  epoch 0 in the spec, which the worker's ``NodeCheck`` fails without copying: a recompute, never a wrong
  block. Each slot's epoch goes with the spec (``HostBlocks.epochs``) so a worker also fails a load whose slot
  was rewritten under it;
- an engine's repeated pins of one key are counted here, once in the shared index;
- eviction is CLOCK over the whole pool (``_nodeindex.c``); ``eviction_policy`` applies to the tiers below; with
  tenants on, by the tenants' shares of the whole pool, every engine's blocks counted (``tenants``: the pool's
  table, who writes it, and ``tenant_book``, where the scheduler says whose each store's keys are); with hints on,
  retained blocks go last, whichever engine gave the hint (``retention``: deadlines kept in the shared index);
- ``reset`` drops only the blocks this engine wrote; ``usage`` is the whole pool's;
- at most once a ``RECLAIM_S`` the index releases what engines that died hold (pins, half-made stores), checks
  the shared index (and repairs it from its slots when damaged) and that the directory still holds this engine's
  files;
- no engine waits on another unboundedly: an operation that cannot have the index's lock within its wait
  (``_nodeindex.set_wait_ms``) answers a miss, skips the store or fails the load; completions and unpins owed
  then are settled, in order, before the next pin or store, by a lookup that finds this engine's own store
  still in flight, and once a step (``take_transfers``, which the connector calls every step): an owed
  completion left until this engine's next lookup kept its blocks in flight (a miss for every engine, a wait
  for its own requests) for as long as it looked nothing up;
- once it shares descriptions, an engine logs what it stores and evicts, and reports the others' (``announce``);
- an index that is damaged past repair, or whose files were removed or replaced, is left: the engine logs once
  and goes on without the pool (every lookup a miss; a load in flight is still checked by its worker, and a
  damaged index fails it). It keeps its attachment and lock until it exits, so no other engine reuses slots its
  workers may still write.

Not thread-safe, like every index; the shared index itself is safe across processes.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Sequence

from kvoffload import _nodeindex
from kvoffload.blocks import HostBlocks, Medium
from kvoffload.config import ConfigError, TenantConfig
from kvoffload.index.base import (
    EventKind,
    HostIndex,
    IntegrityError,
    LookupResult,
    OffloadEvent,
    PrepareStoreOutput,
    TierTransfer,
    TierUsage,
)
from kvoffload.index.retention import RetentionBook
from kvoffload.index.tenants import TenantBook
from kvoffload.keys import KEY_BYTES, OffloadKey
from kvoffload.tiers.node.announce import Announcements, Described
from kvoffload.tiers.node.calls import SharedCalls
from kvoffload.tiers.node.files import BoundFiles
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.retention import NodeRetention
from kvoffload.tiers.node.segment import MISSING_EPOCH, own_identity
from kvoffload.tiers.node.tenants import NodeTenants, Table

logger = logging.getLogger(__name__)

POOL_COUNTERS = ("capacity", "used", "stores", "evictions", "cross_hits", "repairs", "reclaimed", "attached",
                 "busy", "served")
"""What ``pool_counters`` reports (the engines' /metrics: ``vllm:kvoffload_node_pool``): the pool's counters, and
``served``, this engine's own: hits other engines took on blocks it stored."""
RECLAIM_S = 1.0
"""How often an engine looks for dead engines' pins and stores, damage and changed files: the bound on how long
any of them lasts."""
ATTACH_WAIT_S = 10.0
"""How long a starting engine waits for the index's lock (held by a frozen engine) before it goes without the
pool."""

class NodeIndex(SharedCalls, HostIndex):
    """One engine's view of the node pool's shared index.

    Args:
        segment: the mapped index (``files.open_index``).
        locks: this engine's handle on the pool's ``engines`` file (``liveness``): it locks its attachment's byte
            there for as long as it runs, and an attachment nobody locks is a dead engine's. Its own: the index
            closes it.
        files: the files this engine mapped (``files.open_index``), watched once a ``RECLAIM_S``; None: not
            watched (tests of the index alone).
        tenants: this engine's tenants' shares (``OffloadConfig.tenants``); None: tenants off (the engine offers
            no table, and its stores count for the shared tenant if another engine gave the pool one).
        book: where the scheduler assigns each store's keys to tenants (``tenant_book``); None: one is made from
            ``tenants``.
        retention: the engine's retention deadlines (the index registers as one of its tiers); None: hints off
            (its stores give no deadline; other engines' still count).
    Raises:
        ConfigError: every attachment of the pool is taken (``_nodeindex.MAX_ATTACH`` engines).
    """

    medium = Medium.HOST

    def __init__(self, segment: mmap.mmap, locks: EngineLocks, files: BoundFiles | None = None,
                 tenants: TenantConfig | None = None, book: TenantBook | None = None,
                 retention: RetentionBook | None = None) -> None:
        self._segment = segment
        self._locks = locks
        self._files = files
        SharedCalls.__init__(self)
        self._pins: dict[OffloadKey, list[int]] = {}  # key -> [slot, epoch, count] of this engine's pins
        self._in_flight: dict[OffloadKey, tuple[int, int]] = {}  # this engine's stores: key -> (slot, epoch)
        self._events: list[OffloadEvent] = []
        self.capacity: int = _nodeindex.stats(segment)["capacity"]
        self._last_reclaim = 0.0
        self.attachment: int = -1  # none yet: the reclaim below skips no one
        self._identity = (os.getpid(), own_identity()[0])
        self.announcements: Announcements | None = None  # made by the first share_descriptions
        self._tenants = NodeTenants(tenants, book, self.capacity)
        try:
            self._attach()
        except BaseException:
            locks.close()
            raise
        if self.attachment >= 0:
            self._tenants.writer = self._write_table
            self._tenants.join(self._call, self._mine)
        self.retention = None if retention is None else \
            NodeRetention(retention, self.capacity, self._call, lambda: self._mine)

    @property
    def tenant_book(self) -> TenantBook | None:
        """The book the scheduler assigns each store's keys to tenants in (``assign`` before ``prepare_store``,
        ``clear`` after), as in the private host tier's ``TenantPolicy.book``; None with tenants off."""
        return self._tenants.book

    def _attach(self) -> None:
        try:
            engines_inode = _nodeindex.files(self._segment)[1]
        except _nodeindex.Damaged as e:
            self._detach(str(e))
            return
        if engines_inode != self._locks.inode:
            self._detach("its engines file was replaced while this engine started")
            return
        self._reclaim(force=True)
        deadline = time.monotonic() + ATTACH_WAIT_S
        while True:
            try:
                with self._locks.attaching():  # nobody judges the attachment before its byte is locked
                    attachment = _nodeindex.attach(self._segment, self._locks.fd, os.getpid(), *own_identity())
                    if attachment >= 0:
                        self._hold(attachment)
                break
            except _nodeindex.Busy:
                if time.monotonic() > deadline:
                    self._detach(f"another engine held its index for over {ATTACH_WAIT_S:.0f} s")
                    return
            except _nodeindex.Damaged as e:
                self._detach(str(e))
                return
        if attachment < 0:
            raise ConfigError(f"host_scope node: {_nodeindex.MAX_ATTACH} engines already share this node pool")
        self.attachment = attachment

    def _hold(self, attachment: int) -> None:
        try:
            self._locks.hold(attachment)
        except BaseException:
            _nodeindex.release(self._segment, self._locks.fd, attachment, *self._identity, False)
            raise

    @property
    def _mine(self) -> tuple[mmap.mmap, int, int]:
        """What every call on the index that writes (or may lock) starts with: the segment, the lock's file, and
        this engine's attachment."""
        return self._segment, self._locks.fd, self.attachment

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        self._reclaim()
        if not self._lock_free():
            # A hit could not be pinned: its load would fail, and the engine would ask again, hit again and fail
            # again for as long as the lock is held (a real engine looped so). A miss is computed instead.
            return LookupResult(0)
        joined = b"".join(keys)
        hits, pending = self._call(_nodeindex.lookup, (0, False), *self._mine, joined)
        if pending and self._owed and self._settled():  # the store it waits for may be one whose completion is owed
            hits, pending = self._call(_nodeindex.lookup, (0, False), *self._mine, joined)
        return LookupResult(hits, pending)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> HostBlocks:
        pins = self._pins
        # A key whose pin was given up is pinned again: the loads still holding the failed pin fail (their specs
        # say so), this one and the later ones need not.
        new = [key for key in dict.fromkeys(keys) if key not in pins or pins[key][1] == MISSING_EPOCH]
        if new:
            missing = [(-1, MISSING_EPOCH)] * len(new)  # not pinned: the worker fails the load, no copy
            # Never before an owed unpin: run after this pin, it would take the pin away under the load.
            pinned = self._call(_nodeindex.pin, missing, *self._mine, b"".join(new)) if self._settled() else missing
            for key, (slot, epoch) in zip(new, pinned, strict=True):
                entry = pins.setdefault(key, [0, MISSING_EPOCH, 0])
                entry[0], entry[1] = max(slot, 0), epoch
        entries = [pins[key] for key in keys]
        for entry in entries:
            entry[2] += 1
        return HostBlocks(tuple(e[0] for e in entries), (len(entries),), epochs=tuple(e[1] for e in entries))

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._call(_nodeindex.touch, None, self._segment, b"".join(keys))

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
            self._owe(_nodeindex.unpin, *self._mine, [e[0] for e in done], [e[1] for e in done],
                      not success)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        self._reclaim()
        if not self._settled():
            return None  # the lock was busy just now: skipped without a second wait
        unique = list(dict.fromkeys(keys))
        hints = () if self.retention is None else self.retention.reserve_args(unique)
        out = self._call(_nodeindex.reserve, None, *self._mine, b"".join(unique), self._tenants.positions(unique),
                         *hints)
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
        if not self._owe(_nodeindex.complete, *self._mine, [e[0] for _, e in done],
                         [e[1] for _, e in done], success) or not success:
            return []  # owed (ready once settled: no event) or left with the pool
        stored = [key for key, _ in done]
        self._emit(EventKind.STORED, stored)
        return stored

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        if self.announcements is not None and self.detached is None:
            events += self.announcements.learn(self.medium, events)  # logs this engine's evictions first
        return events

    def share_descriptions(self, medium: Medium, described: Described) -> None:
        if medium == self.medium and self.detached is None and self._files is not None and self.attachment >= 0:
            self.announcements = self.announcements or Announcements.start(self._files.directory, *self._mine)
            self.announcements.share(described)  # the first call (even with none) starts reading the others'

    def take_transfers(self) -> list[TierTransfer]:
        """None (a single tier); called every step, so what is owed is settled even when no request comes."""
        self._settle()
        return []

    def reset(self) -> None:
        self._settle()
        dropped = self._call(_nodeindex.reset, 0, *self._mine)
        if dropped:
            logger.info("reset node tier: dropped the %d blocks this engine wrote", dropped)

    def check_integrity(self) -> None:
        """The shared index's laws (``_nodeindex.check``), and this engine's: a pin count is positive. An index
        this engine left, or one busy past the wait, is not judged."""
        problem = self._call(_nodeindex.check, None, *self._mine)
        if problem is not None:
            raise IntegrityError(f"node tier: {problem}")
        if any(entry[2] <= 0 for entry in self._pins.values()):
            raise IntegrityError("node tier: a pin count of this engine is not positive")

    def usage(self) -> list[TierUsage]:
        stats = self._stats()
        return [TierUsage(self.medium, stats.get("used", 0), self.capacity)]

    def pool_counters(self) -> dict[str, int]:
        """``POOL_COUNTERS``, read from the shared index now: the whole pool's capacity, used, stores, evictions,
        hits across engines, repairs, engines reclaimed (found dead) and attached, waits given up (busy); and
        this engine's ``served``. Zeros once this engine left the pool."""
        stats = self._stats()
        if stats and self.attachment >= 0:
            stats["served"] = self._call(_nodeindex.served, 0, self._segment, self.attachment)
        return {name: int(stats.get(name, 0)) for name in POOL_COUNTERS}

    def tenant_counts(self) -> dict[str, dict[str, int]]:
        """Per tenant of the pool's table, read now: {name: {"resident", "stores", "evictions"}}, the whole pool's
        (every engine's blocks); "other" is every tenant the table does not name. Empty when the pool has no
        tenant table, or this engine left it."""
        if self.detached is not None:
            return {}
        self._tenants.read(self._call, self._segment)
        return self._tenants.counts() if self._tenants.on else {}

    def set_tenant_shares(self, names: Sequence[str], default: float, shares: Sequence[float]) -> bool:
        """Rewrite the pool's tenant table: ``names`` with ``shares`` (validated fractions, as ``tenant_quota``'s),
        every tenant not named ``default``; it applies to every engine sharing the pool from its next store. A
        tenant kept keeps its blocks; one dropped leaves its blocks to "other". This engine's ``tenant_book`` is
        given the new quotas too (``TenantBook.set_quota``: its other tiers' shares change with the pool's). Whether
        it was written (False: this engine left the pool, or another held the index's lock past the wait: it is
        tried again at each look, once a ``RECLAIM_S``).

        Raises:
            ValueError: more than 16 names, a name twice, or shares of more than the whole pool.
        """
        table = Table.of(names, default, shares)  # validates before the book changes
        book = self._tenants.book
        if book is None:
            return self._write_table(names, table)
        book.set_quota(default, tuple(zip(names, shares, strict=True)))  # the book's tiers regroup: this writes
        return self._tenants.written

    def _write_table(self, names: Sequence[str], table: Table) -> bool:
        return self._tenants.set_shares(self._call, self._mine, names, table)

    def pool_directory(self) -> str | None:
        """The namespace's directory, while this engine uses the pool."""
        return str(self._files.directory) if self._files is not None and self.detached is None else None

    def close(self) -> None:
        """Detach: this engine's pins and unfinished stores go (an engine that dies is reclaimed instead)."""
        if self.attachment >= 0 and self.detached is None:
            self._settle()
            self._call(_nodeindex.release, False, *self._mine, *self._identity, False)
        self.attachment = -1
        if self.announcements is not None:
            self.announcements.close()  # the log stays: a late joiner still learns the blocks it announced
        self._locks.close()  # after the release: a lock gone first would let another engine reclaim this one

    def _stats(self) -> dict[str, int]:
        if self.detached is not None:
            return {}
        empty: dict[str, int] = {}
        return dict(self._call(_nodeindex.stats, empty, self._segment))

    def _reclaim(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.detached is not None or (not force and now - self._last_reclaim < RECLAIM_S):
            return
        self._last_reclaim = now
        self._settle()
        problem = self._files.problem(self._segment) if self._files is not None else None
        if problem is not None:
            self._detach(problem)
            return
        repaired = self._call(_nodeindex.check, None, *self._mine, True)
        if repaired is not None:
            logger.warning("node tier: repaired the shared index from its slots (%s)", repaired)
        if self.attachment >= 0:
            self._tenants.refresh(self._call, self._mine)  # a table reset after damage is written back
        with self._locks.looking() as may:
            if not may:
                return  # an engine is attaching: look again at the next reclaim
            none: list[tuple[int, int, int, int]] = []
            for attachment, pid, start, _ in self._call(_nodeindex.attachments, none, self._segment):
                if attachment != self.attachment and not self._locks.held(attachment) and \
                        self._call(_nodeindex.release, False, self._segment, self._locks.fd, attachment, pid,
                                   start, True):
                    logger.warning("node tier: engine process %d died; released its pins and unfinished stores",
                                   pid)

    def _emit(self, kind: EventKind, keys: Sequence[OffloadKey]) -> None:
        self._events.append(OffloadEvent(kind, tuple(keys), self.medium))
