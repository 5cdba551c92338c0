"""Copy plans: job validation, the block -> slot mapping, coalescing, and splitting across threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.canonical import BlockRef, CanonicalKV
from kvoffload.specs import NO_BLOCK, DeviceBlocks, DiskBlocks, HostBlocks, JobId, TransferJob
from kvoffload.transfer.copy_plan import CopyPlan, PlanLayout, _coalesce, build_plan, validate_job

PAGE = 64


def _layout(factor: int = 1, padded: bool = False, num_blocks: int = 16, num_slots: int = 8) -> PlanLayout:
    base = torch.zeros((num_blocks, PAGE + (16 if padded else 0)), dtype=torch.int8)
    kv = CanonicalKV((base[:, :PAGE],), ((BlockRef(0, PAGE),),), num_blocks)
    return PlanLayout.of(kv, num_slots, slot_stride=factor * PAGE, factor=factor)


def _store(ids: tuple[int, ...], slots: tuple[int, ...]) -> TransferJob:
    return TransferJob(JobId(1), DeviceBlocks(ids, (len(ids),)), HostBlocks(slots, (len(slots),)))


def _copies(plan: CopyPlan) -> list[tuple[int, int, int, int]]:
    return list(zip(plan.view.tolist(), plan.view_offset.tolist(), plan.pool_offset.tolist(),
                    plan.size.tolist(), strict=True))


def test_consecutive_blocks_into_consecutive_slots_become_one_copy() -> None:
    plan = build_plan(_layout(), _store((4, 5, 6), (2, 3, 4)))
    assert _copies(plan) == [(0, 4 * PAGE, 2 * PAGE, 3 * PAGE)]


def test_scattered_blocks_stay_separate_copies() -> None:
    plan = build_plan(_layout(), _store((4, 9, 5), (2, 3, 4)))
    assert sorted(_copies(plan)) == [(0, 4 * PAGE, 2 * PAGE, PAGE), (0, 5 * PAGE, 4 * PAGE, PAGE),
                                     (0, 9 * PAGE, 3 * PAGE, PAGE)]


def test_a_store_reads_its_source_in_address_order_and_a_load_too() -> None:
    layout = _layout()
    store = build_plan(layout, _store((9, 4, 7), (1, 5, 3)))
    assert store.view_offset.tolist() == [4 * PAGE, 7 * PAGE, 9 * PAGE]
    load = build_plan(layout, TransferJob(JobId(2), HostBlocks((5, 1, 3), (3,)), DeviceBlocks((9, 4, 7), (3,))))
    assert load.pool_offset.tolist() == [1 * PAGE, 3 * PAGE, 5 * PAGE]


def test_padded_rows_are_never_merged() -> None:
    plan = build_plan(_layout(padded=True), _store((4, 5), (2, 3)))
    assert _copies(plan) == [(0, 4 * (PAGE + 16), 2 * PAGE, PAGE), (0, 5 * (PAGE + 16), 3 * PAGE, PAGE)]


def test_sub_blocks_fill_a_slot_in_order_and_a_load_skips_the_held_ones() -> None:
    layout = _layout(factor=2)
    store = TransferJob(JobId(1), DeviceBlocks((7, 3, 5, 1), (4,)), HostBlocks((6, 0), (2,)))
    assert sorted((vo // PAGE, po) for _, vo, po, _ in _copies(build_plan(layout, store))) == [
        (1, PAGE), (3, 13 * PAGE), (5, 0), (7, 12 * PAGE)]
    load = TransferJob(JobId(2), HostBlocks((6, 0), (2,), skip_sub_blocks=1), DeviceBlocks((8, 10, 9), (3,)))
    assert sorted((vo // PAGE, po) for _, vo, po, _ in _copies(build_plan(layout, load))) == [
        (8, 13 * PAGE), (9, PAGE), (10, 0)]


@pytest.mark.parametrize(("job", "culprit"), [
    (TransferJob(JobId(1), DeviceBlocks((1, 2), (2,)), HostBlocks((0,), (1,))), "do not match"),
    (TransferJob(JobId(1), DeviceBlocks((16,), (1,)), HostBlocks((0,), (1,))), "block id"),
    (TransferJob(JobId(1), DeviceBlocks((1,), (1,)), HostBlocks((8,), (1,))), "slot"),
    (TransferJob(JobId(1), DeviceBlocks((1,), (1,)), HostBlocks((0,), (1,), skip_sub_blocks=1)), "store cannot"),
    (TransferJob(JobId(1), HostBlocks((0,), (1,), skip_sub_blocks=1), DeviceBlocks((), (0,))), "below the factor"),
    (TransferJob(JobId(1), DeviceBlocks((1,), (1, 0)), HostBlocks((0,), (1, 0))), "must have 1 entries"),
    (TransferJob(JobId(1), HostBlocks((0,), (1,)), DiskBlocks((), ())), "not device<->host"),
    (TransferJob(JobId(1), DeviceBlocks((1, NO_BLOCK), (2,)), HostBlocks((0, 1), (2,))), "store has a hole"),
    (TransferJob(JobId(1), HostBlocks((0,), (1,)), DeviceBlocks((-2,), (1,))), "block id"),
])
def test_malformed_jobs_raise_value_error_naming_the_problem(job: TransferJob, culprit: str) -> None:
    layout = _layout()
    with pytest.raises(ValueError, match=culprit):
        validate_job(layout, job)  # shapes and sizes
        build_plan(layout, job)  # block ids and slots, on the arrays the plan is built from


def test_a_load_of_an_empty_group_copies_nothing_for_it() -> None:
    kv = CanonicalKV((torch.zeros((8, PAGE), dtype=torch.int8),),
                     ((BlockRef(0, PAGE),), (BlockRef(0, PAGE // 2),)), 8)
    layout = PlanLayout.of(kv, 4, 2 * PAGE, factor=2)
    job = TransferJob(JobId(1), HostBlocks((1, 2), (0, 2), skip_sub_blocks=1), DeviceBlocks((3, 4, 5), (0, 3)))
    validate_job(layout, job)
    assert build_plan(layout, job).nbytes == 3 * PAGE // 2


def test_a_load_copies_nothing_to_or_from_its_holes() -> None:
    layout = _layout(factor=2)
    load = TransferJob(JobId(2), HostBlocks((6, 0), (2,)), DeviceBlocks((NO_BLOCK, 3, NO_BLOCK, 5), (4,)))
    validate_job(layout, load)
    plan = build_plan(layout, load)
    # Holes keep their positions: block 3 is sub-block 1 of slot 6, block 5 sub-block 1 of slot 0.
    assert sorted(_copies(plan)) == [(0, 3 * PAGE, 13 * PAGE, PAGE), (0, 5 * PAGE, PAGE, PAGE)]
    assert plan.nbytes == 2 * PAGE


def test_a_load_group_of_only_holes_copies_nothing() -> None:
    kv = CanonicalKV((torch.zeros((8, PAGE), dtype=torch.int8),),
                     ((BlockRef(0, PAGE),), (BlockRef(0, PAGE // 2),)), 8)
    layout = PlanLayout.of(kv, 4, 2 * PAGE, factor=2)
    job = TransferJob(JobId(1), HostBlocks((1, 2, 3), (2, 1), skip_sub_blocks=1),
                      DeviceBlocks((4, 5, 6, NO_BLOCK), (3, 1)))
    validate_job(layout, job)
    plan = build_plan(layout, job)
    assert _copies(plan) == [(0, 4 * PAGE, 3 * PAGE, 3 * PAGE)]  # slot 1 sub-block 1, then slot 2: one run
    assert plan.nbytes == 3 * PAGE


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), parts=st.integers(1, 9))
def test_split_covers_the_same_bytes_in_order(sizes: list[int], parts: int) -> None:
    n = len(sizes)
    size = np.array(sizes, dtype=np.int64)
    offsets = np.arange(n, dtype=np.int64) * 100  # gaps: no two copies merge
    plan = CopyPlan(np.zeros(n, dtype=np.int64), offsets, offsets + 7, size)
    pieces = plan.split(parts)
    assert len(pieces) <= parts
    assert sum(p.nbytes for p in pieces) == plan.nbytes
    joined = _coalesce(*(np.concatenate([getattr(p, f) for p in pieces])
                         for f in ("view", "view_offset", "pool_offset", "size")))
    assert _copies(joined) == _copies(plan)
