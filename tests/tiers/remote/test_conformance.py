"""RemoteHandler against the transfer-handler conformance suite, in both directions, on a real redis-server.

It fits as the disk handler's harness does, with one difference: the same-destination pair is two loads into one
host slot, not two stores of one key. A remote value is written once (``SET NX``: a name is the content's key, so
a second writer holds the same bytes), so two stores of one key with different bytes leave the first; the
ordering rule the check guards is about slots, which only loads write.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvoffload.config import RemoteTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.specs import HostBlocks, JobId, Medium, RemoteBlocks, TransferJob
from kvoffload.testing.conformance import ALL_CHECKS, MAX_OUTSTANDING, HandlerHarness
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.lower.block_codec import encode_value, open_into
from kvoffload.tiers.lower.block_format import HEADER_BYTES, PLAIN, CorruptBlockError
from kvoffload.tiers.remote.client import value_name
from kvoffload.tiers.remote.handler import RemoteHandler
from kvoffload.transfer.base import TransferHandler
from kvoffload.transfer.host_pool import HostPool

redis = pytest.importorskip("redis")

NS = Namespace(model="m", dtype="bf16", layout="conformance")
ENTRY = 4096
BLOCKS_PER_JOB = 2


class RemoteHarness(HandlerHarness):
    """Even jobs store host slots as new values, odd jobs load values the harness wrote into host slots."""

    def __init__(self, url: str, client: Any) -> None:
        self.config = RemoteTierConfig(urls=(url,))
        self.client = client
        self.pool = HostPool(2 * MAX_OUTSTANDING * BLOCKS_PER_JOB + 2, ENTRY)
        self._keys = (offload_key(i.to_bytes(8, "little"), 0) for i in itertools.count())  # type: ignore[arg-type]
        self._slot = itertools.cycle(range(self.pool.num_slots))
        self._expected: dict[JobId, list[bytes]] = {}

    def new_handler(self) -> TransferHandler:
        return RemoteHandler(self.config, self.pool, NS, (ENTRY,))

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
        return TransferJob(job_id, RemoteBlocks(missing, (1,)), HostBlocks((next(self._slot),), (1,)))

    def verify(self, job: TransferJob) -> bool:
        if job.transfer_type == (Medium.HOST, Medium.REMOTE):
            assert isinstance(job.dst, RemoteBlocks)
            return self._values(job.dst.keys) == self._expected[job.job_id]
        assert isinstance(job.dst, HostBlocks)
        return [bytes(self.pool.buffer[s].numpy()) for s in job.dst.slots] == self._expected[job.job_id]

    def job_bytes(self, job: TransferJob) -> int:
        return ENTRY * sum(job.dst.group_sizes)

    def _store_job(self, job_id: JobId, slots: tuple[int, ...], keys: tuple[OffloadKey, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in slots]
        for slot, data in zip(slots, fresh, strict=True):
            self.pool.buffer[slot] = torch.frombuffer(bytearray(data), dtype=torch.int8)
        self._expected[job_id] = fresh
        return TransferJob(job_id, HostBlocks(slots, (len(slots),)), RemoteBlocks(keys, (len(keys),)))

    def _load_job(self, job_id: JobId, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in keys]
        for key, data in zip(keys, fresh, strict=True):
            self.client.set(value_name(NS, PLAIN, key), encode_value(PLAIN, NS.fingerprint(), key, memoryview(data)))
        self._expected[job_id] = fresh
        return TransferJob(job_id, RemoteBlocks(keys, (len(keys),)), HostBlocks(slots, (len(slots),)))

    def _values(self, keys: tuple[OffloadKey, ...]) -> list[bytes]:
        out: list[bytes] = []
        for key in keys:
            value = self.client.get(value_name(NS, PLAIN, key))
            if value is None or len(value) < HEADER_BYTES:
                return []
            payload = bytearray(ENTRY)
            try:
                open_into(PLAIN, NS.fingerprint(), key, value, memoryview(payload))
            except CorruptBlockError:
                return []
            out.append(bytes(payload))
        return out


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_remote_handler_conforms(check: Callable[[HandlerHarness], None], server: RedisServer, client: Any) -> None:
    """``server`` is emptied first: each check's harness counts its keys from 0 again."""
    check(RemoteHarness(server.url, client))
