"""DiskHandler against the transfer-handler conformance suite, in both directions: stores land at their slots of
engine 0's slot file (read back and verified there), loads read blocks the harness wrote at theirs."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.testing.conformance import ALL_CHECKS, MAX_OUTSTANDING, HandlerHarness
from kvoffload.tiers.disk.engine_files import prepare_engine
from kvoffload.tiers.disk.file_io import FileOps, SlotFile, open_slot_file, read_run, write_run
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.paths import rank_directory, slot_file_path
from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, PAGE, location, split_location
from kvoffload.tiers.lower.block_format import file_bytes
from kvoffload.transfer.base import TransferHandler
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="conformance")
ENTRY = 4096
BLOCKS_PER_JOB = 2
PLACES = 4 * MAX_OUTSTANDING * BLOCKS_PER_JOB
"""Slots of the slot file, handed to fresh keys in turn (no two of the last ``MAX_OUTSTANDING`` jobs share one)."""


class DiskHarness(HandlerHarness):
    """Even jobs write host slots to the slots of new keys, odd jobs read blocks the harness wrote into host slots."""

    def __init__(self, root: Path) -> None:
        self.config = DiskTierConfig(path=root, io_threads=2,
                                     capacity_bytes=2 * PAGE + PLACES * (file_bytes(ENTRY) + ENTRY_BYTES))
        assert prepare_engine(self.config, NS, file_bytes(ENTRY)).capacity == PLACES  # the scheduler's part
        self.pool = HostPool(2 * MAX_OUTSTANDING * BLOCKS_PER_JOB + 2, ENTRY)
        self.directory = rank_directory(root, NS)
        self._keys = (offload_key(i.to_bytes(8, "little"), 0) for i in itertools.count())  # type: ignore[arg-type]
        self._slot = itertools.cycle(range(self.pool.num_slots))
        self._place = itertools.cycle(range(PLACES))
        self._places: dict[OffloadKey, int] = {}
        self._expected: dict[JobId, list[bytes]] = {}

    def new_handler(self) -> TransferHandler:
        return DiskHandler(self.config, self.pool, NS, (ENTRY,))

    def make_job(self, job_id: JobId) -> TransferJob:
        slots = tuple(next(self._slot) for _ in range(BLOCKS_PER_JOB))
        keys = self._new_keys(BLOCKS_PER_JOB)
        return self._write_job(job_id, slots, keys) if job_id % 2 == 0 else self._read_job(job_id, keys, slots)

    def make_same_destination_jobs(self, first: JobId, second: JobId) -> tuple[TransferJob, TransferJob]:
        keys = self._new_keys(BLOCKS_PER_JOB)
        jobs = [self._write_job(j, tuple(next(self._slot) for _ in keys), keys) for j in (first, second)]
        return jobs[0], jobs[1]

    def make_failing_job(self, job_id: JobId) -> TransferJob:
        missing = self._new_keys(1)  # never written: its slot holds nothing, or another key's block
        return TransferJob(job_id, self._spec(missing), HostBlocks((next(self._slot),), (1,)))

    def verify(self, job: TransferJob) -> bool:
        if job.transfer_type == (Medium.HOST, Medium.DISK):
            assert isinstance(job.dst, TierBlocks) and job.dst.medium == Medium.DISK
            return self._blocks(job.dst.keys) == self._expected[job.job_id]
        assert isinstance(job.dst, HostBlocks)
        return [bytes(self.pool.buffer[s].numpy()) for s in job.dst.slots] == self._expected[job.job_id]

    def job_bytes(self, job: TransferJob) -> int:
        return ENTRY * sum(job.dst.group_sizes)

    def _new_keys(self, n: int) -> tuple[OffloadKey, ...]:
        keys = tuple(next(self._keys) for _ in range(n))
        for key in keys:
            self._places[key] = location(0, next(self._place))
        return keys

    def _spec(self, keys: tuple[OffloadKey, ...]) -> TierBlocks:
        return TierBlocks(Medium.DISK, keys, (len(keys),), tuple(self._places[k] for k in keys))

    def _write_job(self, job_id: JobId, slots: tuple[int, ...], keys: tuple[OffloadKey, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in slots]
        for slot, data in zip(slots, fresh, strict=True):
            self.pool.buffer[slot] = torch.frombuffer(bytearray(data), dtype=torch.int8)
        self._expected[job_id] = fresh
        return TransferJob(job_id, HostBlocks(slots, (len(slots),)), self._spec(keys))

    def _read_job(self, job_id: JobId, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in keys]
        with self._file() as (ops, file):
            for key, data in zip(keys, fresh, strict=True):
                write_run(ops, file, split_location(self._places[key])[1], [key], [memoryview(data)], NS.fingerprint())
        self._expected[job_id] = fresh
        return TransferJob(job_id, self._spec(keys), HostBlocks(slots, (len(slots),)))

    def _blocks(self, keys: tuple[OffloadKey, ...]) -> list[bytes]:
        """Each key's payload as read (and verified) at its slot; [] when one is not there."""
        out: list[bytes] = []
        with self._file() as (ops, file):
            for key in keys:
                (put,) = read_run(ops, file, split_location(self._places[key])[1], [key], ENTRY, NS.fingerprint())
                if not callable(put):
                    return []
                buf = memoryview(bytearray(ENTRY))
                put(buf)
                out.append(bytes(buf))
        return out

    @contextlib.contextmanager
    def _file(self) -> Iterator[tuple[FileOps, SlotFile]]:
        ops = FileOps()
        file = open_slot_file(ops, slot_file_path(self.directory, 0))
        try:
            yield ops, file
        finally:
            ops.close(file.fd)


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_disk_handler_conforms(check: Callable[[HandlerHarness], None], tmp_path: Path) -> None:
    check(DiskHarness(tmp_path))
