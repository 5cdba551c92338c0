"""``NodeCheck``: a job reading node pool slots runs only if they still hold the blocks the scheduler pinned, and
fails if they changed before it is reported; it keeps every rule of a transfer handler (the conformance suite
over a real ``HostCopier``)."""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path

import pytest
from tests.tiers.node.pools import keys, locks_in, segment_in

from kvoffload.blocks import HostBlocks, JobId, TransferJob
from kvoffload.keys import OffloadKey
from kvoffload.testing.conformance import ALL_CHECKS, Check, HandlerHarness
from kvoffload.testing.device_host_harness import DeviceHostHarness
from kvoffload.tiers.node.handler import NodeCheck
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.transfer.base import TransferHandler, TransferResult


def reserve_every_slot(node_path: Path, inner: DeviceHostHarness,
                       layout: str) -> tuple[mmap.mmap, NodeIndex, dict[int, int], list[OffloadKey]]:
    """A node index with as many slots as ``inner``'s pool, every one reserved (in flight) by one engine: the
    segment, the engine, each slot's epoch, and the keys reserved."""
    slots = inner.pool.num_slots
    segment = segment_in(node_path, slots, layout=layout)
    index = NodeIndex(segment, locks_in(node_path, layout=layout))
    out = index.prepare_store(keys(slots))
    assert out is not None and isinstance(out.store_spec, HostBlocks)
    epochs = dict(zip(out.store_spec.slots, out.store_spec.epochs, strict=True))
    return segment, index, epochs, list(out.keys_to_store)


class NodeLoadHarness(HandlerHarness):
    """``DeviceHostHarness`` loads whose every pool slot holds a ready block of a node index, at its epoch."""

    def __init__(self, node_path: Path) -> None:
        self.inner = DeviceHostHarness(store=False)
        self.segment, self.index, self.epoch, stored = reserve_every_slot(node_path, self.inner, "node-handler")
        self.index.complete_store(stored)

    def pinned(self, job: TransferJob) -> TransferJob:
        src = job.src
        assert isinstance(src, HostBlocks)
        return dataclasses.replace(job, src=dataclasses.replace(src, epochs=tuple(self.epoch[s] for s in src.slots)))

    def new_handler(self) -> TransferHandler:
        return NodeCheck(self.inner.new_handler(), self.segment)

    def make_job(self, job_id: JobId) -> TransferJob:
        return self.pinned(self.inner.make_job(job_id))

    def make_same_destination_jobs(self, first: JobId, second: JobId) -> tuple[TransferJob, TransferJob]:
        a, b = self.inner.make_same_destination_jobs(first, second)
        return self.pinned(a), self.pinned(b)

    def make_failing_job(self, job_id: JobId) -> TransferJob:
        return self.pinned(self.inner.make_failing_job(job_id))

    def verify(self, job: TransferJob) -> bool:
        return self.inner.verify(job)

    def job_bytes(self, job: TransferJob) -> int:
        return self.inner.job_bytes(job)


def run(handler: TransferHandler, job: TransferJob) -> TransferResult:
    assert handler.submit(job)
    handler.wait([job.job_id])
    (result,) = handler.get_finished()
    return result


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_node_check_keeps_every_rule_of_a_handler(check: Check, node_path: Path) -> None:
    check(NodeLoadHarness(node_path))


def test_a_load_of_intact_slots_copies(node_path: Path) -> None:
    harness = NodeLoadHarness(node_path)
    handler = harness.new_handler()
    job = harness.make_job(JobId(1))
    assert run(handler, job).success and harness.verify(job)


def test_a_load_of_a_block_gone_before_it_ran_is_refused_without_copying(node_path: Path) -> None:
    harness = NodeLoadHarness(node_path)
    handler = harness.new_handler()
    job = harness.make_job(JobId(1))
    assert isinstance(job.src, HostBlocks)
    stale = dataclasses.replace(job, src=dataclasses.replace(job.src, epochs=(0, *job.src.epochs[1:])))
    result = run(handler, stale)
    assert not result.success and not harness.verify(job)  # the device blocks were not written
    assert isinstance(handler, NodeCheck) and handler.refused == 1


def test_a_load_whose_slots_changed_before_it_was_reported_fails(node_path: Path) -> None:
    harness = NodeLoadHarness(node_path)
    handler = harness.new_handler()
    job = harness.make_job(JobId(1))
    assert handler.submit(job)
    handler.wait([job.job_id])
    harness.index.reset()  # the blocks go (as if another engine evicted them while they were copied)
    (result,) = handler.get_finished()
    assert not result.success and isinstance(handler, NodeCheck) and handler.refused == 1


def test_a_job_without_epochs_is_not_checked(node_path: Path) -> None:
    harness = NodeLoadHarness(node_path)
    handler = harness.new_handler()
    job = harness.inner.make_job(JobId(1))  # a private pool's load: nothing to check it against
    harness.index.reset()
    assert run(handler, job).success and harness.verify(job)


class NodeStoreHarness:
    """``DeviceHostHarness`` stores whose every pool slot is in flight for this engine in a node index."""

    def __init__(self, node_path: Path) -> None:
        self.inner = DeviceHostHarness(store=True)
        self.segment, self.index, self.epoch, _ = reserve_every_slot(node_path, self.inner, "node-handler-store")

    def job(self, job_id: JobId, shift: int = 0) -> TransferJob:
        job = self.inner.make_job(job_id)
        dst = job.dst
        assert isinstance(dst, HostBlocks)
        epochs = tuple(self.epoch[s] + shift for s in dst.slots)
        return dataclasses.replace(job, dst=dataclasses.replace(dst, epochs=epochs))


def test_a_store_into_slots_in_flight_at_their_epochs_copies(node_path: Path) -> None:
    harness = NodeStoreHarness(node_path)
    job = harness.job(JobId(1))
    assert run(NodeCheck(harness.inner.new_handler(), harness.segment), job).success and harness.inner.verify(job)


def test_a_store_into_slots_of_another_generation_is_refused_without_writing(node_path: Path) -> None:
    """A worker whose index is not its scheduler's (the set was made anew between their start-ups) must not write
    into slots its scheduler never reserved in it: they may be ready blocks of other engines."""
    harness = NodeStoreHarness(node_path)
    before = harness.inner.pool.buffer.clone()
    handler = NodeCheck(harness.inner.new_handler(), harness.segment)
    result = run(handler, harness.job(JobId(1), shift=1 << 40))
    assert not result.success and handler.refused == 1
    assert bool((harness.inner.pool.buffer == before).all())  # nothing written


def test_a_slot_past_the_pool_fails_the_job_instead_of_raising_from_submit(node_path: Path) -> None:
    harness = NodeLoadHarness(node_path)
    handler = harness.new_handler()
    job = harness.make_job(JobId(1))
    assert isinstance(job.src, HostBlocks)
    past = dataclasses.replace(job, src=dataclasses.replace(job.src, slots=(10**6, *job.src.slots[1:])))
    result = run(handler, past)  # ValueError out of the worker's submit, before
    assert not result.success and isinstance(handler, NodeCheck) and handler.refused == 1


def test_every_job_on_a_lost_pool_fails(node_path: Path) -> None:
    harness = NodeLoadHarness(node_path)
    lost = [False]
    handler = NodeCheck(harness.inner.new_handler(), harness.segment, lambda: lost[0])
    assert run(handler, harness.make_job(JobId(1))).success
    lost[0] = True  # the pool file was truncated under the engine: its pages now read zeros
    assert not run(handler, harness.make_job(JobId(2))).success
