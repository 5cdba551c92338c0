"""Worker side of the ram tier: its memory (``RamSlots``) and the handler copying host slots to and from it.

``RamSlots`` is preallocated at start-up: ``capacity_blocks`` rows of ``max(entry_bytes)`` bytes (the largest
group's entry, which is what a host slot holds), and the key each row holds. ``RamHandler`` serves
(HOST, ramtier) and (ramtier, HOST) jobs, synchronously inside ``submit`` (a memory copy is cheaper than a thread
hand-off); their results still come from ``get_finished``. A load checks every entry's key against the key its
slot holds before it copies anything: a slot reused for another block (or never written) fails the job, so the
engine recomputes instead of reading wrong bytes.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvoffload.tiers import (
    HostBlocks,
    HostPool,
    JobId,
    Medium,
    OffloadKey,
    TierBlocks,
    TransferHandler,
    TransferJob,
    TransferResult,
)
from ramtier import MEDIUM

STORE = (Medium.HOST, MEDIUM)
LOAD = (MEDIUM, Medium.HOST)


class RamSlots:
    """The tier's memory in one worker: ``num_slots`` rows of ``entry_bytes`` bytes, and each row's key.

    Raises:
        ValueError: ``num_slots`` or ``entry_bytes`` is not positive.
    """

    def __init__(self, num_slots: int, entry_bytes: int) -> None:
        if num_slots <= 0 or entry_bytes <= 0:
            raise ValueError(f"RamSlots: {num_slots} slots of {entry_bytes} bytes: both must be positive")
        self.buffer = torch.zeros((num_slots, entry_bytes), dtype=torch.int8)
        self.keys: list[OffloadKey | None] = [None] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self.keys)

    @property
    def entry_bytes(self) -> int:
        return int(self.buffer.shape[1])


@dataclass(frozen=True)
class _Pair:
    """One entry of a job: host slot <-> tier slot, and the key the tier slot holds (or must hold)."""

    host: int
    tier: int
    key: OffloadKey


class RamHandler(TransferHandler):
    """Host pool <-> ``RamSlots``, both ways.

    Args:
        pool: this worker's host pool.
        slots: the tier's memory in this worker.
        corrupt_loads: fault injection (the tests that show a wrong load is caught): every load flips one byte.
    Raises:
        ValueError: a tier entry does not fit a host slot.
    """

    def __init__(self, pool: HostPool, slots: RamSlots, corrupt_loads: bool = False) -> None:
        if slots.entry_bytes > pool.slot_bytes:
            raise ValueError(f"RamHandler: entries of {slots.entry_bytes} bytes do not fit host slots of "
                             f"{pool.slot_bytes}")
        self._host = pool.buffer
        self._slots = slots
        self._corrupt = corrupt_loads
        self._finished: list[TransferResult] = []
        self._closed = False

    def submit(self, job: TransferJob) -> bool:
        if self._closed:
            return False
        pairs = self._plan(job)
        start = time.perf_counter()
        ok = self._store(pairs) if job.transfer_type == STORE else self._load(pairs)
        copied = len(pairs) * self._slots.entry_bytes if ok else 0
        self._finished.append(TransferResult(job.job_id, ok, copied, time.perf_counter() - start,
                                             job.transfer_type))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Collection[JobId]) -> None:
        """Every accepted job finished inside ``submit``: nothing to wait for."""

    def shutdown(self) -> None:
        self._closed = True

    def _plan(self, job: TransferJob) -> list[_Pair]:
        """The entries of a job (a malformed job is a scheduler bug: ValueError)."""
        if job.transfer_type == STORE:
            host, tier = job.src, job.dst
        elif job.transfer_type == LOAD:
            host, tier = job.dst, job.src
        else:
            raise ValueError(f"job {job.job_id}: RamHandler does not move {job.transfer_type}")
        if not isinstance(host, HostBlocks) or not isinstance(tier, TierBlocks):
            raise ValueError(f"job {job.job_id}: wants HostBlocks and TierBlocks, got {job.src} -> {job.dst}")
        if host.skip_sub_blocks or len(host.slots) != len(tier.slots):
            raise ValueError(f"job {job.job_id}: {len(host.slots)} host slots (skipping {host.skip_sub_blocks} "
                             f"sub-blocks) for {len(tier.slots)} tier entries")
        if any(not 0 <= s < self._host.shape[0] for s in host.slots) or \
                any(not 0 <= s < self._slots.num_slots for s in tier.slots):
            raise ValueError(f"job {job.job_id}: a slot is outside the host pool or the tier")
        return [_Pair(h, t, k) for h, t, k in zip(host.slots, tier.slots, tier.keys, strict=True)]

    def _store(self, pairs: list[_Pair]) -> bool:
        width, keys = self._slots.entry_bytes, self._slots.keys
        for pair in pairs:
            keys[pair.tier] = None  # while its bytes change, the slot holds no block
            self._slots.buffer[pair.tier].copy_(self._host[pair.host, :width])
            keys[pair.tier] = pair.key
        return True

    def _load(self, pairs: list[_Pair]) -> bool:
        keys = self._slots.keys
        if any(keys[pair.tier] != pair.key for pair in pairs):
            return False  # reused for another block, or never written: a miss, never wrong bytes
        width = self._slots.entry_bytes
        for pair in pairs:
            self._host[pair.host, :width].copy_(self._slots.buffer[pair.tier])
            if self._corrupt:
                self._host[pair.host, 0] ^= 1
        return True
