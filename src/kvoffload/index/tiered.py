"""The host tier over the tiers below it behind one ``BlockIndex`` face: the scheduler half's index.

Below host sit the disk tier (``DiskIndex``), the remote tier (``RemoteIndex``), the object tier
(``ObjectIndex``), or several of them, in that order: anything with the ``LowerIndex`` interface. Host RAM is the
hub: every lower tier moves blocks only to and from the host pool, and the lower tiers sit *beside* each other
under it, not in a chain (docs/remote.md says why: a remote write never waits on a disk read, and a remote hit
never passes through the disk).

Only host blocks load to the device. A block found only below is promoted first: ``lookup`` reserves host slots,
pins the lower tiers' entries, queues one lower -> HOST ``TierTransfer`` per run of blocks a tier holds (a prefix
may begin on disk and go on in the remote tier) and answers ``pending``; the connector ships them
(``take_transfers``) and reports their outcomes (``complete_transfer``). A failed promotion drops the host
reservation and the lower tier's entry (a missing or corrupt block is a miss: the engine recomputes). The
lower tiers are asked in order, so a block on disk is read from disk even when the remote tier has it too. A
block promoted from a tier is then written to the tiers before it (from the remote or object tier to the disk), so
the next hit on it is nearer.

Blocks reach each lower tier by its write policy:

- write-through (default, and always for the shared tiers, remote and object): every block whose host store
  completes is written below at once. The host entries stay pinned while the write runs, so their slots are not
  reused under it.
- on-evict (one tier at most: the disk): only blocks about to leave the host are written. A block fresh on the
  host is *dirty*: it stays pinned on the host (so the host policy cannot evict it) until it is written. When
  dirty blocks exceed ``capacity - low_water`` host slots, the least recently used dirty blocks are written; once
  written they are unpinned and become ordinary, evictable host blocks. So the host only ever evicts blocks that
  are already below (or whose write failed), and at least ``low_water`` host slots stay evictable for new
  stores. A written block that becomes hot again stays on the host: "on evict" means "ahead of eviction".

Not thread-safe, like every index: the scheduler half calls it from one thread.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.blocks import BlockSpec, HostBlocks, Medium
from kvoffload.config import WritePolicy
from kvoffload.index.base import (
    NO_STORE_COUNTS,
    BlockDescription,
    BlockIndex,
    HostIndex,
    IntegrityError,
    LoadAdvisor,
    LookupResult,
    LowerIndex,
    OffloadEvent,
    PrepareStoreOutput,
    StoreCounts,
    TierTransfer,
    TierUsage,
)
from kvoffload.index.policies.base import Policy
from kvoffload.keys import OffloadKey


class _Kind(enum.Enum):
    PROMOTE = "promote"
    WRITE = "write"


@dataclass(frozen=True)
class _Transfer:
    kind: _Kind
    below: int  # position in ``TieredIndex.below``
    keys: tuple[OffloadKey, ...]


@dataclass(frozen=True)
class _Run:
    """Keys ``[start, end)`` of a lookup, read from lower tier ``tier``."""

    tier: int
    start: int
    end: int


@dataclass(frozen=True)
class Below:
    """A tier under host, and when blocks are written to it."""

    index: LowerIndex
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH


class TieredIndex(BlockIndex):
    """The host tier with the tiers below it.

    Args:
        host: the host tier's index (its capacity is the host pool's slot count): a ``SlotIndex`` or a ``NodeIndex``.
        below: the lower tiers, fastest first (lookups ask them in this order), each with its write policy.
        low_water: on-evict only: host slots kept evictable (default: an eighth of the host, at least 1).
    Raises:
        ValueError: ``below`` is empty, holds two tiers of one medium or two on-evict tiers, or ``low_water`` is
            not in [1, host capacity).
    """

    def __init__(self, host: HostIndex, below: Sequence[Below], low_water: int | None = None) -> None:
        media = [b.index.medium for b in below]
        if not below or len(set(media)) != len(media):
            raise ValueError(f"TieredIndex: needs lower tiers of distinct media, got {media}")
        on_evict = [i for i, b in enumerate(below) if b.write_policy is WritePolicy.ON_EVICT]
        if len(on_evict) > 1:
            raise ValueError("TieredIndex: one lower tier at most may be written on evict")
        low_water = max(1, host.capacity // 8) if low_water is None else low_water
        if on_evict and not 1 <= low_water < host.capacity:
            raise ValueError(f"TieredIndex: low_water {low_water} must be in [1, {host.capacity})")
        self.host = host
        self.below = tuple(below)
        self.lower_indexes = tuple(b.index for b in below)
        self._on_evict = on_evict[0] if on_evict else None
        self._dirty_max = host.capacity - low_water
        self._dirty: dict[OffloadKey, int] = {}  # on-evict: host-pinned, not yet written below; oldest first
        self._transfers: dict[TierTransfer, _Transfer] = {}
        self._queued: list[TierTransfer] = []
        self._advisor: LoadAdvisor | None = None

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        found = self.host.lookup(keys)
        if found.pending or found.hits == len(keys):
            return found
        runs = self._runs_below(keys, found.hits)
        if runs is None:
            return LookupResult(found.hits, pending=True)  # a tier's answer is on its way: nothing promoted yet
        # The host hits go along so that the promotion's evictions cannot take them (they are held).
        if runs and self._promote(keys[:runs[-1].end], runs):
            return LookupResult(found.hits, pending=True)
        return LookupResult(found.hits)

    def _runs_below(self, keys: Sequence[OffloadKey], start: int) -> list[_Run] | None:
        """The runs of ``keys[start:]``, each from the first lower tier that holds it, up to the first miss; None
        when a tier asked has not answered yet (a store searched in the background: ask again later).

        A run a tier holds but would load slower than the engine recomputes it ends the hit: the engine computes
        it and what follows. The tier that held the previous run is not asked next: it misses that key.
        """
        runs: list[_Run] = []
        last = -1
        while start < len(keys):
            for i, tier in enumerate(self.lower_indexes):
                if i == last:
                    continue
                found = tier.lookup(keys[start:])
                if found.pending:
                    return None
                hits = found.hits
                if hits:
                    break
            else:
                break
            if not self._worth_loading(tier.medium, hits):
                break
            runs.append(_Run(i, start, start + hits))
            start, last = start + hits, i
        return runs

    def set_load_cost(self, advisor: LoadAdvisor) -> None:
        self._advisor = advisor

    def _worth_loading(self, medium: Medium, blocks: int) -> bool:
        return self._advisor is None or self._advisor.worth_loading(medium, blocks)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        return self.host.prepare_load(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.host.touch(keys)
        for tier in self.lower_indexes:
            tier.touch(keys)
        dirty = self._dirty
        if dirty:
            for key in keys:
                if key in dirty:
                    dirty[key] = dirty.pop(key)  # most recently used last

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self.host.complete_load(keys, success)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        return self.host.prepare_store(keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        stored = self.host.complete_store_keys(keys, success)
        if stored:
            self._write_below(stored, len(self.lower_indexes))

    def take_transfers(self) -> list[TierTransfer]:
        # Called every step: the host tier's own per-step work (the node pool settles what a busy lock left owed)
        # runs there; a host tier queues no transfers of its own.
        host_transfers = self.host.take_transfers()
        if host_transfers:
            raise IntegrityError(f"tiered: the host tier queued {len(host_transfers)} transfers of its own")
        queued, self._queued = self._queued, []
        return queued

    def complete_transfer(self, done: TierTransfer, success: bool) -> None:
        transfer = self._transfers.pop(done, None)
        if transfer is None:
            raise KeyError(f"unknown tier transfer {done}")
        tier = self.lower_indexes[transfer.below]
        if transfer.kind is _Kind.PROMOTE:
            self.host.complete_store(transfer.keys, success)
            tier.complete_load(transfer.keys, success)
            if success and transfer.below:
                self._write_below(transfer.keys, transfer.below)  # keep it in the faster tiers too
        else:
            tier.complete_store(transfer.keys, success)
            self.host.complete_load(transfer.keys)  # the host copy is intact either way

    def take_events(self) -> list[OffloadEvent]:
        events = self.host.take_events()
        for tier in self.lower_indexes:
            events += tier.take_events()
        return events

    def reset(self) -> None:
        dropped, self._dirty = list(self._dirty), {}
        self.host.complete_load(dropped, success=False)  # dirty pins go, and their blocks with them
        self.host.reset()
        for tier in self.lower_indexes:
            tier.reset()

    def check_integrity(self) -> None:
        """Every tier's laws, and: a key is in at most one transfer per lower tier, a promoted key in no other
        transfer, and a dirty key in no transfer of the on-evict tier."""
        self.host.check_integrity()
        for tier in self.lower_indexes:
            tier.check_integrity()
        per_tier = [(t.below, k) for t in self._transfers.values() for k in t.keys]
        if len(per_tier) != len(set(per_tier)):
            raise IntegrityError("tiered: a key is in two transfers of one tier at once")
        promoted = [k for t in self._transfers.values() if t.kind is _Kind.PROMOTE for k in t.keys]
        written = {k for t in self._transfers.values() if t.kind is _Kind.WRITE for k in t.keys}
        if len(promoted) != len(set(promoted)) or not written.isdisjoint(promoted):
            raise IntegrityError("tiered: a key being promoted is in another transfer")
        if any(t.below == self._on_evict and not self._dirty.keys().isdisjoint(t.keys)
               for t in self._transfers.values()):
            raise IntegrityError("tiered: a dirty key is also in a transfer of the on-evict tier")

    def usage(self) -> list[TierUsage]:
        usage = self.host.usage()
        for tier in self.lower_indexes:
            usage += tier.usage()
        return usage

    @property
    def host_policy(self) -> Policy | None:
        return self.host.host_policy

    def pool_counters(self) -> dict[str, int]:
        return self.host.pool_counters()

    def store_counts(self) -> StoreCounts:
        counts = NO_STORE_COUNTS  # returned as it is without a tier below: compared by identity every step
        for tier in self.lower_indexes:
            counts += tier.store_counts()
        return counts

    def pool_directory(self) -> str | None:
        return self.host.pool_directory()

    def share_descriptions(self, medium: Medium, described: Sequence[tuple[OffloadKey, BlockDescription]]) -> None:
        if medium == self.host.medium:
            self.host.share_descriptions(medium, described)

    def close(self) -> None:
        self.host.close()
        for tier in self.lower_indexes:
            tier.close()

    def _promote(self, keys: Sequence[OffloadKey], runs: Sequence[_Run]) -> bool:
        """Queue a lower -> HOST copy per run of the keys not on the host (those are ready below).

        False when the host has no room for them.
        """
        out = self.host.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return False
        assert isinstance(out.store_spec, HostBlocks)
        slot_of = dict(zip(out.keys_to_store, out.store_spec.slots, strict=True))
        for run in runs:
            moving = tuple(k for k in keys[run.start:run.end] if k in slot_of)
            if moving:
                slots = tuple(slot_of[k] for k in moving)
                src = self.lower_indexes[run.tier].prepare_load(moving)
                self._queue(_Kind.PROMOTE, run.tier, moving, src, HostBlocks(slots, (len(slots),)))
        return True

    def _write_below(self, keys: Sequence[OffloadKey], tiers: int) -> None:
        """Write host blocks ``keys`` to the first ``tiers`` lower tiers, each by its write policy."""
        for i in range(tiers):
            if i == self._on_evict:
                self._mark_dirty(keys)
            else:
                self._write_through(i, keys)

    def _write_through(self, tier: int, keys: Sequence[OffloadKey]) -> None:
        out = self.lower_indexes[tier].prepare_store(keys)
        if out is None or not out.keys_to_store:
            return  # The lower tier is full of pinned or in-flight blocks, or off: these stay above it.
        moving = out.keys_to_store
        self._queue(_Kind.WRITE, tier, moving, self.host.prepare_load(moving), out.store_spec)

    def _mark_dirty(self, keys: Sequence[OffloadKey]) -> None:
        spec = self.host.prepare_load(keys)  # The dirty pin: not evictable until written below.
        assert isinstance(spec, HostBlocks)
        for key, slot in zip(keys, spec.slots, strict=True):
            self._dirty[key] = slot
        self._flush_dirty()

    def _flush_dirty(self) -> None:
        """Write the least recently used dirty blocks when they crowd the host below its low-water mark."""
        excess = len(self._dirty) - self._dirty_max
        if excess <= 0 or self._on_evict is None:
            return
        batch = list(itertools.islice(self._dirty, excess))  # dirty keys being written left ``_dirty``
        out = self.lower_indexes[self._on_evict].prepare_store(batch)
        if out is None:
            return  # The lower tier has no evictable room now; try again after the next store.
        moving = set(out.keys_to_store)
        held = [k for k in batch if k not in moving]  # already written below: clean without a copy
        for key in held:
            del self._dirty[key]
        self.host.complete_load(held)
        if moving:
            slots = tuple(self._dirty.pop(k) for k in out.keys_to_store)
            spec = HostBlocks(slots, (len(slots),))
            self._queue(_Kind.WRITE, self._on_evict, out.keys_to_store, spec, out.store_spec)

    def _queue(self, kind: _Kind, tier: int, keys: tuple[OffloadKey, ...], src: BlockSpec,
               dst: BlockSpec) -> None:
        transfer = TierTransfer(src, dst)
        self._transfers[transfer] = _Transfer(kind, tier, keys)
        self._queued.append(transfer)
