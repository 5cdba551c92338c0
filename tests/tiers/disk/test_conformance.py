"""DiskHandler against the transfer-handler conformance suite, in both directions."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.testing.conformance import ALL_CHECKS, MAX_OUTSTANDING, HandlerHarness
from kvoffload.tiers.disk.file_io import FileOps, read_block, write_block
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.paths import block_path, rank_directory
from kvoffload.transfer.base import TransferHandler
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="conformance")
ENTRY = 4096
BLOCKS_PER_JOB = 2


class DiskHarness(HandlerHarness):
    """Even jobs write host slots to new files, odd jobs read files the harness wrote into host slots."""

    def __init__(self, root: Path) -> None:
        self.config = DiskTierConfig(path=root, io_threads=2)
        self.pool = HostPool(2 * MAX_OUTSTANDING * BLOCKS_PER_JOB + 2, ENTRY)
        self.directory = rank_directory(root, NS)
        self._keys = (offload_key(i.to_bytes(8, "little"), 0) for i in itertools.count())  # type: ignore[arg-type]
        self._slot = itertools.cycle(range(self.pool.num_slots))
        self._expected: dict[JobId, list[bytes]] = {}

    def new_handler(self) -> TransferHandler:
        return DiskHandler(self.config, self.pool, NS, (ENTRY,))

    def make_job(self, job_id: JobId) -> TransferJob:
        slots = tuple(next(self._slot) for _ in range(BLOCKS_PER_JOB))
        keys = tuple(next(self._keys) for _ in range(BLOCKS_PER_JOB))
        return self._write_job(job_id, slots, keys) if job_id % 2 == 0 else self._read_job(job_id, keys, slots)

    def make_same_destination_jobs(self, first: JobId, second: JobId) -> tuple[TransferJob, TransferJob]:
        keys = tuple(next(self._keys) for _ in range(BLOCKS_PER_JOB))
        jobs = [self._write_job(j, tuple(next(self._slot) for _ in keys), keys) for j in (first, second)]
        return jobs[0], jobs[1]

    def make_failing_job(self, job_id: JobId) -> TransferJob:
        missing = (next(self._keys),)  # never written: the read fails
        return TransferJob(job_id, TierBlocks(Medium.DISK, missing, (1,)), HostBlocks((next(self._slot),), (1,)))

    def verify(self, job: TransferJob) -> bool:
        if job.transfer_type == (Medium.HOST, Medium.DISK):
            assert isinstance(job.dst, TierBlocks) and job.dst.medium == Medium.DISK
            return self._files(job.dst.keys) == self._expected[job.job_id]
        assert isinstance(job.dst, HostBlocks)
        return [bytes(self.pool.buffer[s].numpy()) for s in job.dst.slots] == self._expected[job.job_id]

    def job_bytes(self, job: TransferJob) -> int:
        return ENTRY * sum(job.dst.group_sizes)

    def _write_job(self, job_id: JobId, slots: tuple[int, ...], keys: tuple[OffloadKey, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in slots]
        for slot, data in zip(slots, fresh, strict=True):
            self.pool.buffer[slot] = torch.frombuffer(bytearray(data), dtype=torch.int8)
        self._expected[job_id] = fresh
        return TransferJob(job_id, HostBlocks(slots, (len(slots),)), TierBlocks(Medium.DISK, keys, (len(keys),)))

    def _read_job(self, job_id: JobId, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in keys]
        for key, data in zip(keys, fresh, strict=True):
            path = block_path(self.directory, key)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_block(FileOps(), path, NS.fingerprint(), key, memoryview(data))
        self._expected[job_id] = fresh
        return TransferJob(job_id, TierBlocks(Medium.DISK, keys, (len(keys),)), HostBlocks(slots, (len(slots),)))

    def _files(self, keys: tuple[OffloadKey, ...]) -> list[bytes]:
        out: list[bytes] = []
        for key in keys:
            buf = memoryview(bytearray(ENTRY))
            try:
                read_block(FileOps(), block_path(self.directory, key), NS.fingerprint(), key, buf)
            except (OSError, ValueError):
                return []
            out.append(bytes(buf))
        return out


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_disk_handler_conforms(check: Callable[[HandlerHarness], None], tmp_path: Path) -> None:
    check(DiskHarness(tmp_path))
