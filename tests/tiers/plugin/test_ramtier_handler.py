"""The ram tier's handler against the transfer-handler conformance suite, in both directions, and its own rule:
a load whose tier slot holds another key fails without writing the host slot."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.keys import BlockHash, OffloadKey, offload_key
from kvoffload.testing.conformance import ALL_CHECKS, MAX_OUTSTANDING, HandlerHarness
from kvoffload.transfer.base import TransferHandler
from kvoffload.transfer.host_pool import HostPool

ENTRY = 512
BLOCKS_PER_JOB = 2
SLOTS = 2 * MAX_OUTSTANDING * BLOCKS_PER_JOB + 2


def make_key(i: int) -> OffloadKey:
    return offload_key(BlockHash(i.to_bytes(8, "little")), 0)


def fresh_bytes(n: int) -> torch.Tensor:
    return torch.randint(-128, 128, (n, ENTRY), dtype=torch.int8)


class RamHarness(HandlerHarness):
    """Even jobs store host slots into tier slots, odd jobs load tier slots the harness filled into host slots.

    The harness owns both memories (the host pool and the tier's ``RamSlots``); each handler it makes moves bytes
    between those two.
    """

    def __init__(self) -> None:
        from ramtier.handler import RamSlots

        self.pool = HostPool(SLOTS, ENTRY)
        self.slots = RamSlots(SLOTS, ENTRY)
        self._keys = (make_key(i) for i in itertools.count())
        self._host = itertools.cycle(range(SLOTS))
        self._tier = itertools.cycle(range(SLOTS))
        self._expected: dict[JobId, torch.Tensor] = {}

    def new_handler(self) -> TransferHandler:
        from ramtier.handler import RamHandler

        return RamHandler(self.pool, self.slots)

    def make_job(self, job_id: JobId) -> TransferJob:
        host, tier = self._take(self._host), self._take(self._tier)
        keys = tuple(next(self._keys) for _ in range(BLOCKS_PER_JOB))
        return self._store_job(job_id, host, tier, keys) if job_id % 2 == 0 else self._load_job(job_id, tier, host,
                                                                                               keys)

    def make_same_destination_jobs(self, first: JobId, second: JobId) -> tuple[TransferJob, TransferJob]:
        tier = self._take(self._tier)
        keys = tuple(next(self._keys) for _ in tier)
        return (self._store_job(first, self._take(self._host), tier, keys),
                self._store_job(second, self._take(self._host), tier, keys))

    def make_failing_job(self, job_id: JobId) -> TransferJob:
        tier, host = self._take(self._tier, 1), self._take(self._host, 1)
        from ramtier import MEDIUM

        self.slots.keys[tier[0]] = next(self._keys)  # the slot holds another block than the job's
        return TransferJob(job_id, TierBlocks(MEDIUM, (next(self._keys),), (1,), tier), HostBlocks(host, (1,)))

    def verify(self, job: TransferJob) -> bool:
        expected = self._expected[job.job_id]
        if job.transfer_type[1] == Medium.HOST:
            assert isinstance(job.dst, HostBlocks)
            return torch.equal(self.pool.buffer[list(job.dst.slots)], expected)
        assert isinstance(job.dst, TierBlocks)
        return (torch.equal(self.slots.buffer[list(job.dst.slots)], expected)
                and [self.slots.keys[s] for s in job.dst.slots] == list(job.dst.keys))

    def job_bytes(self, job: TransferJob) -> int:
        return ENTRY * sum(job.dst.group_sizes)

    def _take(self, cycle: itertools.cycle[int], n: int = BLOCKS_PER_JOB) -> tuple[int, ...]:
        return tuple(next(cycle) for _ in range(n))

    def _store_job(self, job_id: JobId, host: tuple[int, ...], tier: tuple[int, ...],
                   keys: tuple[OffloadKey, ...]) -> TransferJob:
        from ramtier import MEDIUM

        data = fresh_bytes(len(host))
        self.pool.buffer[list(host)] = data
        self._expected[job_id] = data
        return TransferJob(job_id, HostBlocks(host, (len(host),)), TierBlocks(MEDIUM, keys, (len(tier),), tier))

    def _load_job(self, job_id: JobId, tier: tuple[int, ...], host: tuple[int, ...],
                  keys: tuple[OffloadKey, ...]) -> TransferJob:
        from ramtier import MEDIUM

        data = fresh_bytes(len(tier))
        self.slots.buffer[list(tier)] = data
        for slot, key in zip(tier, keys, strict=True):
            self.slots.keys[slot] = key
        self._expected[job_id] = data
        return TransferJob(job_id, TierBlocks(MEDIUM, keys, (len(tier),), tier), HostBlocks(host, (len(host),)))


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_ram_handler_conforms(check: Callable[[HandlerHarness], None], ramtier_installed: Path) -> None:
    check(RamHarness())


def test_a_load_of_a_slot_holding_another_key_fails_and_leaves_the_host_slot(ramtier_installed: Path) -> None:
    harness = RamHarness()
    handler = harness.new_handler()
    store = harness.make_job(JobId(0))
    assert isinstance(store.dst, TierBlocks)
    handler.submit(store)
    overwrite = harness.make_job(JobId(2))  # another block into the same tier slots would be the scheduler's reuse
    assert isinstance(overwrite.dst, TierBlocks)
    reused = TransferJob(JobId(4), overwrite.src, TierBlocks(store.dst.medium, overwrite.dst.keys,
                                                             store.dst.group_sizes, store.dst.slots))
    handler.submit(reused)
    before = harness.pool.buffer[[60, 61]].clone()
    stale = TransferJob(JobId(6), store.dst, HostBlocks((60, 61), (2,)))  # asks for the first block's keys
    handler.submit(stale)
    results = {r.job_id: r for r in handler.get_finished()}
    assert results[JobId(0)].success and results[JobId(4)].success
    assert not results[JobId(6)].success and results[JobId(6)].bytes == 0
    assert torch.equal(harness.pool.buffer[[60, 61]], before)


def test_jobs_the_handler_does_not_serve_are_refused_as_malformed(ramtier_installed: Path) -> None:
    harness = RamHarness()
    handler = harness.new_handler()
    with pytest.raises(ValueError, match="does not move"):
        handler.submit(TransferJob(JobId(1), HostBlocks((0,), (1,)), HostBlocks((1,), (1,))))
    from ramtier import MEDIUM

    with pytest.raises(ValueError, match="outside"):
        handler.submit(TransferJob(JobId(2), HostBlocks((0,), (1,)), TierBlocks(MEDIUM, (make_key(0),), (1,),
                                                                                (SLOTS,))))
