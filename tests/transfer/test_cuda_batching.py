"""cuda_batch: the batched form of a plan moves exactly the bytes the per-copy path moves (run on CPU tensors)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.canonical import BlockRef, CanonicalKV
from kvoffload.transfer import cuda_batch
from kvoffload.transfer.copy_plan import CopyPlan, PlanLayout, build_plan
from kvoffload.transfer.cuda_copy import flat_bytes

KIB = 1 << 10


class Case:
    """``layers`` views of ``num_blocks`` pages (with row padding), a pool of ``factor``-block slots, one job."""

    def __init__(self, layers: int, page: int, num_blocks: int, blocks: int, factor: int, store: bool,
                 seed: int, slot_spacing: int = 1) -> None:
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.store = store
        # Padded rows (stride page + 256) and an offset start, as canonical views of a real engine have.
        self.bases = tuple(torch.randint(-128, 128, (num_blocks, page + 256), dtype=torch.int8, generator=gen)
                           for _ in range(layers))
        self.views = _views(self.bases)
        kv = CanonicalKV(self.views, (tuple(BlockRef(v, page) for v in range(layers)),), num_blocks)
        num_slots = slot_spacing * blocks + 3
        self.pool = torch.randint(-128, 128, (num_slots, factor * layers * page), dtype=torch.int8, generator=gen)
        ids = tuple(rng.sample(range(num_blocks), blocks * factor))
        slots = tuple(rng.sample(range(0, num_slots, slot_spacing), blocks))
        device, host = DeviceBlocks(ids, (len(ids),)), HostBlocks(slots, (blocks,))
        job = TransferJob(JobId(1), device, host) if store else TransferJob(JobId(1), host, device)
        self.plan = build_plan(PlanLayout.of(kv, num_slots, int(self.pool.stride(0)), factor), job)

    def copy_each(self) -> tuple[torch.Tensor, ...]:
        """The per-copy path's result (views and pool), on copies of the inputs."""
        views, pool = _views(tuple(b.clone() for b in self.bases)), self.pool.clone()
        cuda_batch.copy_each([flat_bytes(v) for v in views], flat_bytes(pool), self.plan, self.store)
        return (*views, pool)

    def batched(self, batched: cuda_batch.BatchedPlan, staging_bytes: int) -> tuple[torch.Tensor, ...]:
        views, pool = _views(tuple(b.clone() for b in self.bases)), self.pool.clone()
        flat_views, flat_pool = [flat_bytes(v) for v in views], flat_bytes(pool)
        staging, scratch = torch.empty(staging_bytes, dtype=torch.int8), torch.empty(staging_bytes, dtype=torch.int8)
        cuda_batch.copy_each(flat_views, flat_pool, batched.direct, self.store)
        cuda_batch.BatchRunner(flat_views, flat_pool, staging, scratch, torch.from_numpy).run(batched, self.store)
        return (*views, pool)


def _views(bases: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(b[:, 256:] for b in bases)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), page_units=st.integers(1, 8), blocks=st.integers(1, 24),
       factor=st.integers(1, 3), store=st.booleans(), staging_units=st.integers(8, 40), seed=st.integers(0, 9999))
def test_batched_plan_moves_the_same_bytes_as_copy_by_copy(layers: int, page_units: int, blocks: int, factor: int,
                                                           store: bool, staging_units: int, seed: int) -> None:
    page = page_units * 256
    case = Case(layers, page, 4 * blocks * factor, blocks, factor, store, seed)
    staging_bytes = staging_units * 256
    # Copies below 1-4 pages are small here, so plans mix direct and staged copies and need several chunks.
    batched = cuda_batch.split(case.plan, staging_bytes, large_bytes=min(staging_bytes, 4 * 256), min_saved=1)
    if batched is None:
        return  # nothing to batch (checked by the tests of split below)
    assert batched.copies + len(batched.direct) == len(case.plan)
    assert _same(case.batched(batched, staging_bytes), case.copy_each())


@pytest.mark.parametrize("store", [True, False])
def test_many_layers_of_small_pages_go_batched_one_copy_per_slot(store: bool) -> None:
    case = Case(layers=8, page=4 * KIB, num_blocks=512, blocks=128, factor=1, store=store, seed=3)
    batched = cuda_batch.split(case.plan)
    assert batched is not None and len(batched.chunks) == 1
    assert batched.copies == len(case.plan) == 8 * 128
    assert batched.runs <= 128  # the 8 layers of a slot are one pool run (adjacent slots merge further)
    assert batched.unit == 256 and len(batched.direct) == 0  # gcd of the pages and their padded row stride
    assert _same(case.batched(batched, cuda_batch.STAGING_BYTES), case.copy_each())


def test_a_job_larger_than_the_staging_buffer_is_cut_into_chunks_that_fit() -> None:
    case = Case(layers=4, page=4 * KIB, num_blocks=512, blocks=200, factor=1, store=True, seed=4)
    staging_bytes = 100 * KIB
    batched = cuda_batch.split(case.plan, staging_bytes, large_bytes=64 * KIB)
    assert batched is not None and len(batched.chunks) == -(-200 * 16 * KIB // staging_bytes)
    assert all(c.nbytes <= staging_bytes for c in batched.chunks)
    assert sum(c.nbytes for c in batched.chunks) == case.plan.nbytes
    assert _same(case.batched(batched, staging_bytes), case.copy_each())


@pytest.mark.parametrize("store", [True, False])
def test_one_layer_in_scattered_blocks_and_nearly_all_slots_goes_batched_in_a_few_runs(store: bool) -> None:
    # Random block ids in a random order of slots, but 256 of 259 slots: at most 4 runs of adjacent slots.
    case = Case(layers=1, page=4 * KIB, num_blocks=256, blocks=256, factor=1, store=store, seed=5)
    batched = cuda_batch.split(case.plan)
    assert batched is not None and batched.copies == 256 and batched.runs <= 4
    assert _same(case.batched(batched, cuda_batch.STAGING_BYTES), case.copy_each())


def test_one_layer_in_slots_apart_from_each_other_stays_copy_by_copy() -> None:
    # Every pool run is a single copy: staging would add a kernel and save no copy.
    case = Case(layers=1, page=4 * KIB, num_blocks=512, blocks=256, factor=1, store=True, seed=5, slot_spacing=2)
    assert cuda_batch.split(case.plan) is None


def test_few_copies_stay_copy_by_copy() -> None:
    case = Case(layers=4, page=4 * KIB, num_blocks=64, blocks=3, factor=1, store=True, seed=6)
    assert len(case.plan) == 12 and cuda_batch.split(case.plan) is None


def test_copies_of_a_megabyte_or_more_stay_direct() -> None:
    case = Case(layers=2, page=4 * KIB, num_blocks=1024, blocks=16, factor=1, store=False, seed=7)
    big = CopyPlan(np.array([0]), np.array([0]), np.array([0]), np.array([cuda_batch.LARGE_COPY_BYTES]),
                   cuda_batch.LARGE_COPY_BYTES)
    plan = _concat(case.plan, big)
    batched = cuda_batch.split(plan, min_saved=1)
    assert batched is not None and len(batched.direct) == 1 and batched.copies == len(case.plan)


def test_copies_in_rows_too_small_to_index_stay_copy_by_copy() -> None:
    n, size = 64, 200  # one pool run, but rows of 200 bytes: an 8-byte index per 200 bytes moved
    offsets = np.arange(n, dtype=np.int64)[::-1] * size
    plan = CopyPlan(np.zeros(n, dtype=np.int64), offsets, np.arange(n, dtype=np.int64) * size,
                    np.full(n, size, dtype=np.int64), size * n)
    assert cuda_batch.split(plan) is None
    assert cuda_batch.split(CopyPlan(plan.view, offsets * 2, plan.pool_offset * 2, plan.size * 2, 2 * size * n))


def test_ragged_arange_matches_its_loop() -> None:
    starts, counts = np.array([5, 0, 9, 3], dtype=np.int64), np.array([2, 0, 3, 1], dtype=np.int64)
    expected = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
    assert np.array_equal(cuda_batch._ragged_arange(starts, counts), expected)


def test_an_off_by_one_in_the_index_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above is strict enough to see a one-row shift (a mutant of the index builder)."""
    case = Case(layers=8, page=4 * KIB, num_blocks=512, blocks=64, factor=1, store=True, seed=8)
    real = cuda_batch._ragged_arange

    def shifted(starts: cuda_batch.Int64Array, counts: cuda_batch.Int64Array) -> cuda_batch.Int64Array:
        return real(starts + 1, counts)

    monkeypatch.setattr(cuda_batch, "_ragged_arange", shifted)
    batched = cuda_batch.split(case.plan)
    assert batched is not None
    assert not _same(case.batched(batched, cuda_batch.STAGING_BYTES), case.copy_each())


def _concat(a: CopyPlan, b: CopyPlan) -> CopyPlan:
    return CopyPlan(*(np.concatenate((x, y)) for x, y in ((a.view, b.view), (a.view_offset, b.view_offset),
                                                           (a.pool_offset, b.pool_offset), (a.size, b.size))),
                    a.nbytes + b.nbytes)


def test_staging_smaller_than_the_largest_staged_copy_is_refused() -> None:
    plan = CopyPlan(*(np.zeros(0, dtype=np.int64) for _ in range(4)), 0)
    with pytest.raises(ValueError, match="copies up to 2048 bytes go through staging, which holds only 1024"):
        cuda_batch.split(plan, staging_bytes=1024, large_bytes=2048)


def test_scratch_smaller_than_staging_is_refused() -> None:
    with pytest.raises(ValueError, match=r"scratch \(16 bytes\) must be as large as staging \(32 bytes\)"):
        cuda_batch.BatchRunner([], torch.zeros(8, dtype=torch.int8), torch.zeros(32, dtype=torch.int8),
                               torch.zeros(16, dtype=torch.int8), torch.from_numpy)
