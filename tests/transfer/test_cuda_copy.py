"""CudaCopier on a real GPU: both paths round-trip, stores see the compute stream's writes, poll never waits.

Every test but the first needs CUDA and skips (with its reason, shown by ``-rs``) without it; ``make gpu-check``
runs them on a GPU machine and counts any skip there as a failure.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.canonical import BlockRef, CanonicalKV
from kvoffload.transfer import cuda_batch
from kvoffload.transfer.base import TransferResult
from kvoffload.transfer.copy_plan import LOAD, STORE, PlanLayout, build_plan
from kvoffload.transfer.cuda_copy import CudaCopier
from kvoffload.transfer.host_pool import HostPool

KIB, MIB = 1 << 10, 1 << 20


class Rig:
    """``layers`` CUDA views of ``num_blocks`` pages, a pinned pool of one-block slots, a copier over them."""

    def __init__(self, layers: int, page: int, num_blocks: int, batching: bool = True,
                 staging_bytes: int = cuda_batch.STAGING_BYTES, fail: frozenset[int] = frozenset()) -> None:
        self.views = tuple(torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, device="cuda")
                           for _ in range(layers))
        kv = CanonicalKV(self.views, (tuple(BlockRef(v, page) for v in range(layers)),), num_blocks)
        self.pool = HostPool(num_blocks, layers * page, pin_memory=True)
        assert self.pool.buffer.is_pinned()
        self.layout = PlanLayout.of(kv, num_blocks, int(self.pool.buffer.stride(0)), 1)
        self.copier = CudaCopier(self.views, self.pool.buffer, self._before, batching, staging_bytes)
        self._fail = fail

    def _before(self, job_id: JobId) -> None:
        if job_id in self._fail:
            raise RuntimeError(f"injected fault in job {job_id}")

    def start(self, job_id: int, ids: list[int], slots: list[int], store: bool) -> None:
        device, host = DeviceBlocks(tuple(ids), (len(ids),)), HostBlocks(tuple(slots), (len(slots),))
        job = TransferJob(JobId(job_id), device, host) if store else TransferJob(JobId(job_id), host, device)
        self.copier.start(job.job_id, STORE if store else LOAD, build_plan(self.layout, job))

    def run(self, job_id: int, ids: list[int], slots: list[int], store: bool) -> TransferResult:
        self.start(job_id, ids, slots, store)
        self.copier.wait({JobId(job_id)})
        (result,) = self.copier.get_finished()
        return result

    def block(self, block_id: int) -> torch.Tensor:
        return torch.cat([v[block_id].cpu() for v in self.views])


def test_a_staging_buffer_smaller_than_a_large_copy_is_refused() -> None:
    views = (torch.zeros((4, 4096), dtype=torch.int8),)
    with pytest.raises(ValueError, match="staging_bytes"):
        CudaCopier(views, torch.zeros((4, 4096), dtype=torch.int8), lambda job_id: None, staging_bytes=4096)


def cuda_only(test: Callable[..., None]) -> Callable[..., None]:
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def _blocks(n: int, dense_slots: bool, seed: int) -> tuple[list[int], list[int], list[int]]:
    """A quarter of the blocks at random, their slots (a shuffled range, or every fourth slot) and load targets."""
    rng = random.Random(seed)
    k = n // 4
    slots = rng.sample(range(k, 2 * k), k) if dense_slots else rng.sample(range(0, n, 4), k)
    return rng.sample(range(n // 2), k), slots, rng.sample(range(n // 2, n), k)


@cuda_only
@pytest.mark.parametrize(("layers", "page", "dense_slots", "batching", "batched_jobs"), [
    (8, 4 * KIB, False, True, 2),  # per-layer pages: a slot's layers are one pool run
    (1, 16 * KIB, True, True, 2),  # one layer, adjacent slots in random order: few runs
    (1, 16 * KIB, False, True, 0),  # one layer, slots apart: every run one copy, nothing to save
    (8, 4 * KIB, False, False, 0),  # batching off
    (2, 2 * MIB, True, True, 0),  # large copies are issued one by one
])
def test_store_then_load_round_trips_on_the_path_the_plan_calls_for(
        layers: int, page: int, dense_slots: bool, batching: bool, batched_jobs: int) -> None:
    num_blocks = 64 if page >= MIB else 1024
    # A staging buffer of 1 MiB: the 8 MiB jobs of small pages need several chunks.
    rig = Rig(layers, page, num_blocks, batching, staging_bytes=cuda_batch.LARGE_COPY_BYTES)
    ids, slots, targets = _blocks(num_blocks, dense_slots, seed=layers)
    before = [rig.block(b) for b in ids]
    stored = rig.run(1, ids, slots, store=True)
    loaded = rig.run(2, targets, slots, store=False)
    assert stored.success and loaded.success and stored.bytes == loaded.bytes == len(ids) * layers * page
    assert stored.seconds > 0 and loaded.seconds > 0
    assert rig.copier.batched_jobs == batched_jobs
    assert all(torch.equal(rig.block(t), b) for t, b in zip(targets, before, strict=True))
    rig.copier.shutdown()


@cuda_only
def test_a_batched_store_sees_compute_stream_writes_queued_before_it() -> None:
    rig = Rig(8, 4 * KIB, 256)
    ids, slots, _ = _blocks(256, dense_slots=True, seed=1)
    index = torch.tensor(ids, device="cuda")
    torch.cuda._sleep(100_000_000)  # keep the compute stream busy so the writes below are still queued at start
    for v in rig.views:
        v.index_fill_(0, index, 7)
    assert rig.run(1, ids, slots, store=True).success
    assert rig.copier.batched_jobs == 1
    assert torch.all(rig.pool.buffer[slots] == 7)


@cuda_only
def test_poll_does_not_wait_for_a_job_still_queued_and_reports_it_once_done() -> None:
    rig = Rig(8, 4 * KIB, 256)
    _, slots, targets = _blocks(256, dense_slots=True, seed=2)
    rig.pool.buffer[slots] = 9
    torch.cuda._sleep(200_000_000)  # the copy stream waits for this before the load's copies
    rig.start(1, targets, slots, store=False)
    assert rig.copier.get_finished() == []
    rig.copier.wait({JobId(1)})
    (result,) = rig.copier.get_finished()
    assert result.success and rig.copier.batched_jobs == 1
    # Once reported, the loaded blocks are what the compute stream reads.
    assert all(bool(torch.all(v[targets] == 9)) for v in rig.views)


@cuda_only
def test_a_job_that_fails_to_start_is_a_failed_result_and_the_next_job_runs() -> None:
    rig = Rig(8, 4 * KIB, 256, fail=frozenset({1}))
    ids, slots, _ = _blocks(256, dense_slots=True, seed=3)
    rig.start(1, ids, slots, store=True)
    rig.start(2, ids, slots, store=True)
    rig.copier.wait({JobId(1), JobId(2)})
    assert [(r.job_id, r.success) for r in rig.copier.get_finished()] == [(1, False), (2, True)]
    assert all(torch.equal(rig.pool.buffer[s].cpu(), rig.block(b)) for b, s in zip(ids, slots, strict=True))
