"""HostCopier: bytes land where the job says, on every layout; failures are results."""

from __future__ import annotations

import random
from collections.abc import Callable
from itertools import chain

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, Medium, TransferJob
from kvoffload.canonical import BlockRef, CanonicalKV, canonicalize
from kvoffload.testing.device_host_harness import FaultyDeviceHostHandler
from kvoffload.testing.layouts import ALL_LAYOUTS
from kvoffload.transfer import cpu_copy
from kvoffload.transfer.base import TransferResult
from kvoffload.transfer.host_copier import HostCopier
from kvoffload.transfer.host_pool import HostPool

STORE = (Medium.DEVICE, Medium.HOST)
LOAD = (Medium.HOST, Medium.DEVICE)


def _kv(name: str, num_blocks: int = 16, device: str = "cpu") -> CanonicalKV:
    layout, make = ALL_LAYOUTS[name](num_blocks=num_blocks, device=device)
    return canonicalize(layout, make())


def _run(handler: HostCopier, job: TransferJob) -> TransferResult:
    assert handler.submit(job)
    handler.wait([job.job_id])
    (result,) = handler.get_finished()
    return result


def _block(kv: CanonicalKV, group: int, block_id: int) -> torch.Tensor:
    return torch.cat([kv.views[r.view][block_id, :r.nbytes].cpu() for r in kv.group_refs[group]])


def _store_job(job_id: int, ids: list[list[int]], slots: list[list[int]]) -> TransferJob:
    return TransferJob(JobId(job_id), DeviceBlocks(tuple(chain(*ids)), tuple(map(len, ids))),
                       HostBlocks(tuple(chain(*slots)), tuple(map(len, slots))))


@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_store_then_load_restores_every_group_block_on_every_layout(name: str, factor: int) -> None:
    kv = _kv(name)
    groups = len(kv.group_refs)
    pool = HostPool(8, factor * kv.max_block_bytes)
    handler = HostCopier(kv, pool, factor)
    # Group g stores engine blocks [g*2f, g*2f + 2f) into 2 slots; the load brings them back to blocks 8 + ...
    ids = [list(range(g * 2 * factor, (g + 1) * 2 * factor)) for g in range(groups)]
    slots = [[2 * g + 1, 2 * g] for g in range(groups)]
    before = {(g, b): _block(kv, g, b) for g in range(groups) for b in ids[g]}
    stored = _run(handler, _store_job(1, ids, slots))
    assert stored.success and stored.transfer_type == STORE
    assert stored.bytes == sum(2 * factor * kv.group_block_bytes(g) for g in range(groups))
    targets = [[8 + b for b in group_ids] for group_ids in ids]
    load = _store_job(2, targets, slots)
    loaded = _run(handler, TransferJob(JobId(2), load.dst, load.src))
    assert loaded.success and loaded.transfer_type == LOAD and loaded.bytes == stored.bytes
    for g in range(groups):
        for b in ids[g]:
            assert torch.equal(_block(kv, g, 8 + b), before[(g, b)]), (name, g, b)
    handler.shutdown()


def test_load_with_skip_copies_only_the_sub_blocks_the_engine_lacks() -> None:
    kv = _kv("multi_group")
    pool = HostPool(4, 2 * kv.max_block_bytes)
    handler = HostCopier(kv, pool, factor=2)
    assert _run(handler, _store_job(1, [[0, 1, 2, 3], [4, 5]], [[0, 1], [2]])).success
    untouched = _block(kv, 0, 9)
    job = TransferJob(JobId(2), HostBlocks((0, 1, 2), (2, 1), skip_sub_blocks=1),
                      DeviceBlocks((10, 11, 12, 13), (3, 1)))
    result = _run(handler, job)
    assert result.bytes == 3 * kv.group_block_bytes(0) + kv.group_block_bytes(1)
    assert [torch.equal(_block(kv, 0, 10 + i), _block(kv, 0, 1 + i)) for i in range(3)] == [True] * 3
    assert torch.equal(_block(kv, 1, 13), _block(kv, 1, 5))
    assert torch.equal(_block(kv, 0, 9), untouched)
    handler.shutdown()


@settings(max_examples=25, deadline=None)
@given(data=st.data(), factor=st.integers(1, 3), threads=st.integers(1, 3))
def test_random_jobs_move_the_same_bytes_as_a_block_by_block_copy(
        data: st.DataObject, factor: int, threads: int) -> None:
    kv = _kv("mamba", num_blocks=24)
    pool = HostPool(8, factor * kv.max_block_bytes)
    m = data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=2), label="offload blocks per group")
    skip = data.draw(st.integers(0, factor - 1), label="skip")
    rng = random.Random(data.draw(st.integers(0, 1000), label="seed"))
    slots = rng.sample(range(8), sum(m))
    ids = rng.sample(range(24), sum(m) * factor)
    sizes = tuple(n * factor - skip if n else 0 for n in m)
    job = TransferJob(JobId(1), HostBlocks(tuple(slots), tuple(m), skip), DeviceBlocks(tuple(ids[:sum(sizes)]), sizes))
    pool.buffer.copy_(torch.randint(-128, 128, pool.buffer.shape, dtype=torch.int8))
    handler = HostCopier(kv, pool, factor, threads)
    assert _run(handler, job).success
    handler.shutdown()
    d = h = 0
    for g, (dn, hn) in enumerate(zip(sizes, m, strict=True)):
        gbb = kv.group_block_bytes(g)
        for k in range(dn):
            slot, sub = slots[h + (k + skip) // factor], (k + skip) % factor
            assert torch.equal(_block(kv, g, ids[d + k]), pool.buffer[slot, sub * gbb:(sub + 1) * gbb])
        d, h = d + dn, h + hn


def test_a_job_cut_into_pieces_mid_copy_lands_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_copy, "MIN_PIECE_BYTES", 100)  # many pieces, cut inside merged copies
    kv = _kv("cross_layer", num_blocks=32)
    pool = HostPool(32, kv.max_block_bytes)
    handler = HostCopier(kv, pool, factor=1, threads=3)
    ids = list(range(32))
    assert _run(handler, _store_job(1, [ids], [ids])).success
    assert torch.equal(pool.buffer, kv.views[0])
    handler.shutdown()


def test_plan_seconds_adds_up_the_planning_of_every_accepted_job() -> None:
    kv = _kv("attention")
    handler = HostCopier(kv, HostPool(4, kv.max_block_bytes), factor=1)
    assert handler.plan_seconds == 0.0
    assert _run(handler, _store_job(1, [[0, 1]], [[0, 1]])).success
    first = handler.plan_seconds
    assert first > 0
    assert _run(handler, _store_job(2, [[2]], [[2]])).success
    assert handler.plan_seconds > first
    handler.shutdown()


def test_an_exception_inside_a_copy_is_a_failed_result_and_later_jobs_still_run() -> None:
    kv = _kv("attention")
    handler = FaultyDeviceHostHandler(kv, HostPool(4, kv.max_block_bytes), 1, 2, failing={JobId(1)})
    failed = _run(handler, _store_job(1, [[0]], [[0]]))
    assert (failed.success, failed.bytes, failed.transfer_type) == (False, 0, STORE)
    assert _run(handler, _store_job(2, [[1]], [[1]])).success
    handler.shutdown()


def test_a_malformed_job_raises_at_submit_and_is_never_reported() -> None:
    kv = _kv("attention")
    handler = HostCopier(kv, HostPool(4, kv.max_block_bytes), factor=1)
    with pytest.raises(ValueError, match="do not match"):
        handler.submit(_store_job(1, [[0, 1]], [[0]]))
    handler.wait([JobId(1)])
    assert handler.get_finished() == []
    handler.shutdown()


def _attention_kv() -> CanonicalKV:
    return _kv("attention")


@pytest.mark.parametrize(("make", "culprit"), [
    (lambda kv: HostCopier(kv, HostPool(2, kv.max_block_bytes), factor=2), "slot_bytes"),
    (lambda kv: HostCopier(kv, HostPool(2, kv.max_block_bytes), factor=0), "factor"),
    (lambda kv: HostCopier(kv, HostPool(2, kv.max_block_bytes), factor=1, threads=0), "threads"),
    (lambda kv: HostCopier(CanonicalKV((kv.views[0].float(),), kv.group_refs[:1], 16),
                                  HostPool(2, kv.max_block_bytes), factor=1), "int8"),
    (lambda kv: HostCopier(CanonicalKV(kv.views, ((BlockRef(0, 10_000),),), 16),
                                  HostPool(2, 10_000), factor=1), "does not fit"),
])
def test_bad_construction_raises_value_error_naming_the_culprit(
        make: Callable[[CanonicalKV], HostCopier], culprit: str) -> None:
    with pytest.raises(ValueError, match=culprit):
        make(_attention_kv())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("factor", [1, 2])
def test_cuda_store_then_load_round_trips_through_pinned_memory(factor: int) -> None:
    kv = _kv("mamba", device="cuda")
    pool = HostPool(8, factor * kv.max_block_bytes, pin_memory=True)
    assert pool.buffer.is_pinned()
    handler = HostCopier(kv, pool, factor)
    ids = [list(range(2 * factor)), list(range(2 * factor, 4 * factor))]
    before = [_block(kv, g, b) for g in range(2) for b in ids[g]]
    stored = _run(handler, _store_job(1, ids, [[0, 1], [2, 3]]))
    assert stored.success and stored.seconds > 0
    load = _store_job(2, [[8 + b for b in ids[0]], [8 + b for b in ids[1]]], [[0, 1], [2, 3]])
    assert _run(handler, TransferJob(JobId(2), load.dst, load.src)).success
    after = [_block(kv, g, 8 + b) for g in range(2) for b in ids[g]]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    handler.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_store_sees_compute_stream_writes_made_before_submit() -> None:
    kv = _kv("attention", device="cuda")
    pool = HostPool(2, kv.max_block_bytes, pin_memory=True)
    handler = HostCopier(kv, pool, factor=1)
    torch.cuda._sleep(10_000_000)  # keep the compute stream busy so the fill below is still queued at submit
    kv.views[0][3].fill_(5)
    kv.views[1][3].fill_(5)
    assert _run(handler, _store_job(1, [[3]], [[1]])).success
    assert torch.all(pool.buffer[1] == 5)
    handler.shutdown()
