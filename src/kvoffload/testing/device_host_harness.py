"""The conformance harness of ``HostCopier``: checkable store or load jobs over a realistic KV cache.

The KV cache is the hybrid layout of ``testing.layouts.mamba_layout``: two groups of different block sizes
sharing padded buffers, so jobs exercise multi-ref blocks, padding and per-group slot offsets. Block ids and slots
are shuffled, so jobs copy scattered blocks. Jobs are cut from ``MAX_OUTSTANDING + 3`` disjoint regions taken in
turn; a load job with an odd id skips the first sub-block of each group, and one whose id is a multiple of 3 has a
hole (``NO_BLOCK``, the engine's null block) at the start of each group. ``verify`` re-derives the mapping of a
job block by block, independently of the handler's vectorized plan. Other handlers' harnesses can follow the
same shape: a region allocator, fresh source bytes per job, an independent oracle and a fault-injecting
subclass.
"""

from __future__ import annotations

import random

import torch

from kvoffload.blocks import NO_BLOCK, DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.canonical import CanonicalKV, canonicalize
from kvoffload.testing.conformance import MAX_OUTSTANDING, HandlerHarness
from kvoffload.testing.layouts import mamba_layout
from kvoffload.transfer.base import TransferHandler
from kvoffload.transfer.host_copier import HostCopier
from kvoffload.transfer.host_pool import HostPool

OFFLOAD_BLOCKS = (2, 1)
"""Offload blocks per group in each job."""
REGIONS = MAX_OUTSTANDING + 3


class InjectedFault(RuntimeError):
    """Raised inside a copy by ``FaultyDeviceHostHandler``."""


class FaultyDeviceHostHandler(HostCopier):
    """A ``HostCopier`` whose jobs listed in ``failing`` raise inside their copy."""

    def __init__(self, kv: CanonicalKV, pool: HostPool, factor: int, threads: int, failing: set[JobId]) -> None:
        super().__init__(kv, pool, factor, threads)
        self._failing = failing

    def _before_copy(self, job_id: JobId) -> None:
        if job_id in self._failing:
            raise InjectedFault(f"injected fault in job {job_id}")


class DeviceHostHarness(HandlerHarness):
    """Store (``store=True``, device -> host) or load (host -> device) jobs for ``HostCopier``."""

    def __init__(
        self, store: bool, device: str = "cpu", factor: int = 2, threads: int = 2, seed: int = 0
    ) -> None:
        self.store, self.factor, self.threads = store, factor, threads
        per_region = sum(OFFLOAD_BLOCKS) * factor
        num_blocks, num_slots = REGIONS * per_region, REGIONS * sum(OFFLOAD_BLOCKS)
        layout, make = mamba_layout(num_blocks=num_blocks, device=device, seed=seed)
        self.kv = canonicalize(layout, make())
        self.pool = HostPool(num_slots, factor * self.kv.max_block_bytes, pin_memory=device != "cpu")
        self.pool.buffer.zero_()
        rng = random.Random(seed)
        blocks, slots = rng.sample(range(num_blocks), num_blocks), rng.sample(range(num_slots), num_slots)
        self._block_regions = [blocks[r * per_region:(r + 1) * per_region] for r in range(REGIONS)]
        self._slot_regions = [slots[r * len(slots) // REGIONS:(r + 1) * len(slots) // REGIONS]
                              for r in range(REGIONS)]
        self._next_region = 0
        self._failing: set[JobId] = set()
        self._random = torch.Generator().manual_seed(seed)

    def new_handler(self) -> TransferHandler:
        self._failing = set()  # job ids restart with each handler
        return FaultyDeviceHostHandler(self.kv, self.pool, self.factor, self.threads, failing=self._failing)

    def make_job(self, job_id: JobId) -> TransferJob:
        region = self._take_region()
        return self._job(job_id, region, region, self._skip(job_id))

    def make_same_destination_jobs(self, first: JobId, second: JobId) -> tuple[TransferJob, TransferJob]:
        a, b, shared = self._take_region(), self._take_region(), self._take_region()
        skip = self._skip(first)
        if self.store:  # the destination is the slots
            return self._job(first, a, shared, skip), self._job(second, b, shared, skip)
        return self._job(first, shared, a, skip), self._job(second, shared, b, skip)

    def make_failing_job(self, job_id: JobId) -> TransferJob:
        self._failing.add(job_id)
        return self.make_job(job_id)

    def verify(self, job: TransferJob) -> bool:
        return all(torch.equal(self.kv.views[view][block, :nbytes].cpu(), self.pool.buffer[slot, at:at + nbytes])
                   for view, block, nbytes, slot, at in self._mapping(job))

    def job_bytes(self, job: TransferJob) -> int:
        return sum(nbytes for _, _, nbytes, _, _ in self._mapping(job))

    def _take_region(self) -> int:
        region = self._next_region
        self._next_region = (region + 1) % REGIONS
        return region

    def _skip(self, job_id: JobId) -> int:
        return 1 if not self.store and self.factor > 1 and job_id % 2 else 0

    def _job(self, job_id: JobId, block_region: int, slot_region: int, skip: int) -> TransferJob:
        """A job between the blocks of one region and the slots of another, its source filled with fresh bytes."""
        blocks, slots = self._block_regions[block_region], self._slot_regions[slot_region]
        block_ids: list[int] = []
        start = 0
        for m in OFFLOAD_BLOCKS:
            group = blocks[start:start + m * self.factor - skip]
            if not self.store and job_id % 3 == 0:
                group[0] = NO_BLOCK
            block_ids += group
            start += m * self.factor
        device = DeviceBlocks(tuple(block_ids), tuple(m * self.factor - skip for m in OFFLOAD_BLOCKS))
        host = HostBlocks(tuple(slots), OFFLOAD_BLOCKS, skip_sub_blocks=skip)
        job = TransferJob(job_id, device, host) if self.store else TransferJob(job_id, host, device)
        self._fill_source(job)
        return job

    def _fill_source(self, job: TransferJob) -> None:
        for view, block, nbytes, slot, at in self._mapping(job):
            fresh = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=self._random)
            if self.store:
                self.kv.views[view][block, :nbytes] = fresh.to(self.kv.views[view].device)
            else:
                self.pool.buffer[slot, at:at + nbytes] = fresh

    def _mapping(self, job: TransferJob) -> list[tuple[int, int, int, int, int]]:
        """(view, block id, nbytes, slot, byte offset in slot) for every ref of every device block of ``job``
        (holes copy nothing)."""
        device, host = (job.src, job.dst) if self.store else (job.dst, job.src)
        assert isinstance(device, DeviceBlocks) and isinstance(host, HostBlocks)
        out = []
        d0 = h0 = 0
        for g, (dn, hn) in enumerate(zip(device.group_sizes, host.group_sizes, strict=True)):
            for k in range(dn):
                if device.block_ids[d0 + k] == NO_BLOCK:
                    continue
                position = k + host.skip_sub_blocks
                slot = host.slots[h0 + position // self.factor]
                at = (position % self.factor) * self.kv.group_block_bytes(g)
                for ref in self.kv.group_refs[g]:
                    out.append((ref.view, device.block_ids[d0 + k], ref.nbytes, slot, at))
                    at += ref.nbytes
            d0, h0 = d0 + dn, h0 + hn
        return out
