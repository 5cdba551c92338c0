"""Copy plans: job validation, the block -> slot mapping, the order of copies and coalescing."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.blocks import NO_BLOCK, DeviceBlocks, HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.canonical import BlockRef, CanonicalKV
from kvoffload.transfer.copy_plan import CopyPlan, PlanLayout, build_plan, validate_job

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
    (TransferJob(JobId(1), HostBlocks((0,), (1,)), TierBlocks(Medium.DISK, (), ())), "not device<->host"),
    (TransferJob(JobId(1), DeviceBlocks((1, NO_BLOCK), (2,)), HostBlocks((0, 1), (2,))), "store has a hole"),
    (TransferJob(JobId(1), HostBlocks((0,), (1,)), DeviceBlocks((-2,), (1,))), "block id"),
])
def test_malformed_jobs_raise_value_error_naming_the_problem(job: TransferJob, culprit: str) -> None:
    layout = _layout()
    with pytest.raises(ValueError, match=culprit):
        validate_job(layout, job)  # shapes and sizes
        build_plan(layout, job)  # block ids and slots, on the arrays the plan is built from


def test_the_planner_refuses_sizes_that_validation_would_have_caught() -> None:
    # The planner writes through the sizes it is given, so it checks them even though validate_job comes first.
    job = TransferJob(JobId(1), DeviceBlocks((1, 2, 3), (3,)), HostBlocks((0,), (1,)))
    with pytest.raises(ValueError, match="job 1: more block ids than the slots hold"):
        build_plan(_layout(), job)


def test_a_plan_reports_the_bytes_of_its_copies() -> None:
    plan = build_plan(_layout(), _store((3, 4, 9), (0, 1, 5)))
    assert plan.nbytes == int(plan.size.sum()) == 3 * PAGE
    assert len(plan) == 2


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


def test_copies_of_different_views_are_never_merged_even_when_their_offsets_continue() -> None:
    # Group 0 copies row 0 of view 0 into slot 0, group 1 row 1 of view 1 into slot 1: the offsets continue on
    # both sides (0..PAGE, PAGE..2 PAGE), the views differ.
    views = tuple(torch.zeros((4, PAGE), dtype=torch.int8) for _ in range(2))
    layout = PlanLayout.of(CanonicalKV(views, ((BlockRef(0, PAGE),), (BlockRef(1, PAGE),)), 4), 4, PAGE, 1)
    job = TransferJob(JobId(1), DeviceBlocks((0, 1), (1, 1)), HostBlocks((0, 1), (1, 1)))
    assert _copies(build_plan(layout, job)) == [(0, 0, 0, PAGE), (1, PAGE, PAGE, PAGE)]


def test_a_store_reads_each_view_in_address_order_and_a_load_each_slot_in_turn() -> None:
    views = tuple(torch.zeros((8, PAGE), dtype=torch.int8) for _ in range(2))
    kv = CanonicalKV(views, ((BlockRef(0, PAGE), BlockRef(1, PAGE // 2)),), 8)
    layout = PlanLayout.of(kv, 8, 2 * PAGE, 1)
    store = build_plan(layout, _store((5, 2), (1, 6)))
    assert [(v, vo // PAGE) for v, vo, _, _ in _copies(store)] == [(0, 2), (0, 5), (1, 2), (1, 5)]
    load = build_plan(layout, TransferJob(JobId(2), HostBlocks((6, 1), (2,)), DeviceBlocks((3, 4), (2,))))
    assert [(po // (2 * PAGE), v) for v, _, po, _ in _copies(load)] == [(1, 0), (1, 1), (6, 0), (6, 1)]


def test_ids_past_one_byte_are_sorted_right() -> None:
    plan = build_plan(_layout(num_blocks=1024), _store((513, 256, 7), (0, 1, 2)))
    assert plan.view_offset.tolist() == [7 * PAGE, 256 * PAGE, 513 * PAGE]


def test_a_cache_of_more_than_65536_blocks_is_sorted_right_too() -> None:
    layout = _layout(num_blocks=70_000, num_slots=4)
    plan = build_plan(layout, _store((69_999, 3, 65_536), (0, 1, 2)))
    assert _copies(plan) == [(0, 3 * PAGE, PAGE, PAGE), (0, 65_536 * PAGE, 2 * PAGE, PAGE),
                             (0, 69_999 * PAGE, 0, PAGE)]


@pytest.mark.parametrize("ids", [(1, 2.5), (1, 1 << 63)])
def test_block_ids_that_are_not_int64_values_raise_value_error_naming_the_job(ids: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="job 1: block ids and slots must be int64"):
        build_plan(_layout(), _store(ids, (0, 1)))


# A naive reference: every (engine block, ref) copied on its own, straight from the spec's rules.

@st.composite
def _plan_cases(draw: st.DrawFn) -> tuple[CanonicalKV, torch.Tensor, tuple[torch.Tensor, ...], int, TransferJob]:
    """A random layout (views with or without padding, groups of refs), factor, pool and job; distinct block ids
    and slots, so no two copies write the same bytes."""
    num_blocks = draw(st.sampled_from([32, 70_000]), label="num_blocks")
    pages = draw(st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=3), label="view pages")
    bases = tuple(torch.randint(-128, 128, (num_blocks, page + draw(st.sampled_from([0, 8]))), dtype=torch.int8)
                  for page in pages)
    views = tuple(base[:, :page] for base, page in zip(bases, pages, strict=True))
    groups = draw(st.lists(st.lists(st.integers(0, len(views) - 1), min_size=1, max_size=3), min_size=1,
                           max_size=3), label="each group's ref views")
    refs = tuple(tuple(BlockRef(v, draw(st.integers(1, pages[v]))) for v in g) for g in groups)
    kv = CanonicalKV(views, refs, num_blocks)
    factor = draw(st.integers(1, 3), label="factor")
    store = draw(st.booleans(), label="store")
    skip = 0 if store else draw(st.integers(0, factor - 1), label="skip")
    m = draw(st.lists(st.integers(0, 3), min_size=len(groups), max_size=len(groups)), label="offload blocks")
    sizes = tuple(n * factor - skip if n else 0 for n in m)
    num_slots = max(sum(m), 1) + 2
    slots = draw(st.permutations(range(num_slots)), label="slots")[:sum(m)]
    # Block ids: a run of consecutive ids sometimes (so copies merge), else random ones; holes only in loads.
    start = draw(st.integers(0, num_blocks - sum(sizes)), label="first id")
    ids = list(range(start, start + sum(sizes)))
    if draw(st.booleans(), label="shuffle ids"):
        ids = draw(st.permutations(ids), label="ids")
    if not store:
        ids = [NO_BLOCK if draw(st.integers(0, 4), label="hole") == 0 else b for b in ids]
    device, host = DeviceBlocks(tuple(ids), sizes), HostBlocks(tuple(slots), tuple(m), skip)
    job = TransferJob(JobId(1), device, host) if store else TransferJob(JobId(1), host, device)
    pool = torch.randint(-128, 128, (num_slots, factor * kv.max_block_bytes), dtype=torch.int8)
    return kv, pool, bases, factor, job


def _block_by_block(kv: CanonicalKV, pool: torch.Tensor, factor: int, job: TransferJob) -> None:
    store = job.transfer_type == (Medium.DEVICE, Medium.HOST)
    device, host = (job.src, job.dst) if store else (job.dst, job.src)
    assert isinstance(device, DeviceBlocks) and isinstance(host, HostBlocks)
    d = h = 0
    for g, (dn, hn) in enumerate(zip(device.group_sizes, host.group_sizes, strict=True)):
        for k in range(dn):
            block, pos = device.block_ids[d + k], k + host.skip_sub_blocks
            if block == NO_BLOCK:
                continue
            at = pos % factor * kv.group_block_bytes(g)
            for r in kv.group_refs[g]:
                device_bytes = kv.views[r.view][block, :r.nbytes]
                host_bytes = pool[host.slots[h + pos // factor], at:at + r.nbytes]
                (host_bytes if store else device_bytes).copy_(device_bytes if store else host_bytes)
                at += r.nbytes
        d, h = d + dn, h + hn


def _apply(plan: CopyPlan, bases: tuple[torch.Tensor, ...], pool: torch.Tensor, store: bool) -> None:
    flat_pool = pool.view(-1)
    for v, vo, po, n in _copies(plan):
        device_bytes, host_bytes = bases[v].view(-1)[vo:vo + n], flat_pool[po:po + n]
        (host_bytes if store else device_bytes).copy_(device_bytes if store else host_bytes)


@settings(max_examples=150, deadline=None)
@given(case=_plan_cases())
def test_a_plan_moves_the_same_bytes_as_a_block_by_block_copy_in_fewest_copies(
        case: tuple[CanonicalKV, torch.Tensor, tuple[torch.Tensor, ...], int, TransferJob]) -> None:
    kv, pool, bases, factor, job = case
    store = job.transfer_type == (Medium.DEVICE, Medium.HOST)
    layout = PlanLayout.of(kv, pool.shape[0], pool.shape[1], factor)
    validate_job(layout, job)
    plan = build_plan(layout, job)
    expected_pool, expected_bases = pool.clone(), tuple(b.clone() for b in bases)
    expected_kv = CanonicalKV(tuple(b[:, :v.shape[1]] for b, v in zip(expected_bases, kv.views, strict=True)),
                              kv.group_refs, kv.num_blocks)
    _block_by_block(expected_kv, expected_pool, factor, job)
    _apply(plan, bases, pool, store)
    assert torch.equal(pool, expected_pool)
    assert all(torch.equal(b, e) for b, e in zip(bases, expected_bases, strict=True))
    # Fewest copies: no copy continues the one before it on both sides of one view.
    copies = _copies(plan)
    assert not any(v == pv and vo == pvo + pn and po == ppo + pn
                   for (pv, pvo, ppo, pn), (v, vo, po, _) in itertools.pairwise(copies))
    device = job.src if store else job.dst
    assert isinstance(device, DeviceBlocks)
    assert plan.nbytes == sum(kv.group_block_bytes(g) * sum(b != NO_BLOCK for b in device.block_ids[d0:d0 + n])
                              for g, (d0, n) in enumerate(_starts(device.group_sizes)))


def _starts(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(sum(sizes[:g]), n) for g, n in enumerate(sizes)]
