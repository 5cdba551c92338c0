"""ObjectHandler against the transfer-handler conformance suite, in both directions, on a real Ceph RGW.

It fits as the remote handler's harness does: the same-destination pair is two loads into one host slot. A PUT
replaces an object whole, so two stores of one key would also leave the second's bytes; but a name is the content's
key (two writers hold the same bytes), and the ordering rule the check guards is about slots, which only loads
write. The harness plants the objects its loads read, and reads back those its stores wrote, with the
administrator's client and the tier's own codec.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvoffload.config import ObjectTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.specs import HostBlocks, JobId, Medium, ObjectBlocks, TransferJob
from kvoffload.testing.conformance import ALL_CHECKS, MAX_OUTSTANDING, HandlerHarness
from kvoffload.tiers.lower.block_codec import encode_value, open_into
from kvoffload.tiers.lower.block_format import PLAIN, CorruptBlockError
from kvoffload.tiers.object.client import rank_prefix
from kvoffload.tiers.object.handler import ObjectHandler
from kvoffload.transfer.base import TransferHandler
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="conformance")
ENTRY = 4096
BLOCKS_PER_JOB = 2


class ObjectHarness(HandlerHarness):
    """Even jobs store host slots as new objects, odd jobs load objects the harness planted into host slots."""

    def __init__(self, config: ObjectTierConfig, s3: Any) -> None:
        self.config = config
        self.s3 = s3
        self.pool = HostPool(2 * MAX_OUTSTANDING * BLOCKS_PER_JOB + 2, ENTRY)
        self._prefix = rank_prefix(config, NS, PLAIN)
        self._keys = (offload_key(i.to_bytes(8, "little"), 0) for i in itertools.count())  # type: ignore[arg-type]
        self._slot = itertools.cycle(range(self.pool.num_slots))
        self._expected: dict[JobId, list[bytes]] = {}

    def new_handler(self) -> TransferHandler:
        return ObjectHandler(self.config, self.pool, NS, (ENTRY,))

    def make_job(self, job_id: JobId) -> TransferJob:
        slots = tuple(next(self._slot) for _ in range(BLOCKS_PER_JOB))
        keys = tuple(next(self._keys) for _ in range(BLOCKS_PER_JOB))
        return self._store_job(job_id, slots, keys) if job_id % 2 == 0 else self._load_job(job_id, keys, slots)

    def make_same_destination_jobs(self, first: JobId, second: JobId) -> tuple[TransferJob, TransferJob]:
        slots = tuple(next(self._slot) for _ in range(BLOCKS_PER_JOB))
        jobs = [self._load_job(j, tuple(next(self._keys) for _ in slots), slots) for j in (first, second)]
        return jobs[0], jobs[1]

    def make_failing_job(self, job_id: JobId) -> TransferJob:
        missing = (next(self._keys),)  # never written: the load misses
        return TransferJob(job_id, ObjectBlocks(missing, (1,)), HostBlocks((next(self._slot),), (1,)))

    def verify(self, job: TransferJob) -> bool:
        if job.transfer_type == (Medium.HOST, Medium.OBJECT):
            assert isinstance(job.dst, ObjectBlocks)
            return self._objects(job.dst.keys) == self._expected[job.job_id]
        assert isinstance(job.dst, HostBlocks)
        return [bytes(self.pool.buffer[s].numpy()) for s in job.dst.slots] == self._expected[job.job_id]

    def job_bytes(self, job: TransferJob) -> int:
        return ENTRY * sum(job.dst.group_sizes)

    def _store_job(self, job_id: JobId, slots: tuple[int, ...], keys: tuple[OffloadKey, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in slots]
        for slot, data in zip(slots, fresh, strict=True):
            self.pool.buffer[slot] = torch.frombuffer(bytearray(data), dtype=torch.int8)
        self._expected[job_id] = fresh
        return TransferJob(job_id, HostBlocks(slots, (len(slots),)), ObjectBlocks(keys, (len(keys),)))

    def _load_job(self, job_id: JobId, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in keys]
        for key, data in zip(keys, fresh, strict=True):
            value = encode_value(PLAIN, NS.fingerprint(), key, memoryview(data))
            self.s3.put_object(Bucket=self.config.bucket, Key=self._prefix + PLAIN.name(key), Body=value)
        self._expected[job_id] = fresh
        return TransferJob(job_id, ObjectBlocks(keys, (len(keys),)), HostBlocks(slots, (len(slots),)))

    def _objects(self, keys: tuple[OffloadKey, ...]) -> list[bytes]:
        """The payloads of ``keys``' objects; [] if one is missing or fails its checks."""
        out: list[bytes] = []
        for key in keys:
            try:
                value = self.s3.get_object(Bucket=self.config.bucket, Key=self._prefix + PLAIN.name(key))["Body"]
            except self.s3.exceptions.NoSuchKey:
                return []
            payload = bytearray(ENTRY)
            try:
                open_into(PLAIN, NS.fingerprint(), key, value.read(), memoryview(payload))
            except CorruptBlockError:
                return []
            out.append(bytes(payload))
        return out


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_object_handler_conforms(check: Callable[[HandlerHarness], None], config: ObjectTierConfig,
                                 s3: Any) -> None:
    """``config``'s bucket is fresh: each check's harness counts its keys from 0 again."""
    check(ObjectHarness(config, s3))


def test_the_harness_catches_a_store_that_wrote_other_bytes(config: ObjectTierConfig, s3: Any) -> None:
    """The control: a stored object whose payload differs from the slot's fails ``verify``, so the checks above
    would catch a handler that wrote wrong bytes."""
    harness = ObjectHarness(config, s3)
    handler = harness.new_handler()
    try:
        job = harness.make_job(JobId(2))  # a store
        assert handler.submit(job)
        handler.wait([job.job_id])
        assert [r.success for r in handler.get_finished()] == [True] and harness.verify(job)
        assert isinstance(job.dst, ObjectBlocks)
        key = job.dst.keys[0]
        junk = encode_value(PLAIN, NS.fingerprint(), key, memoryview(os.urandom(ENTRY)))
        s3.put_object(Bucket=config.bucket, Key=rank_prefix(config, NS, PLAIN) + PLAIN.name(key), Body=junk)
        assert not harness.verify(job)
    finally:
        handler.shutdown()
