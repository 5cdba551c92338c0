"""A ``HandlerHarness`` for the handler of a store that names each block by its key (the remote and object tiers,
or a third party's of the same kind), to run the conformance suite (``testing.conformance``) against a real server.

Even jobs store host slots of fresh bytes as new blocks; odd jobs load blocks the harness wrote into the store
itself, in the tier's own encoding (``tiers.lower.block_codec``, plain), into host slots. The same-destination pair
is two loads into one host slot: a store writes a name whose content is its key (two writers hold the same bytes),
and the ordering rule the check guards is about slots, which only loads write. A tier supplies its handler, its
block spec of keys, and how to write and read one stored value by key::

    class MyHarness(KeyedStoreHarness):
        medium = Medium("mytier")
        def new_handler(self): ...
        def tier_blocks(self, keys): ...
        def put(self, key, value): ...
        def get(self, key): ...
"""

from __future__ import annotations

import itertools
import os
from abc import abstractmethod
from collections.abc import Sequence

import torch

from kvoffload.blocks import BlockSpec, HostBlocks, JobId, Medium, TransferJob
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.testing.conformance import MAX_OUTSTANDING, HandlerHarness
from kvoffload.tiers.lower.block_codec import encode_value, open_into
from kvoffload.tiers.lower.block_format import PLAIN, CorruptBlockError
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="conformance")
"""The namespace of every handler a harness makes."""
ENTRY = 4096
"""Payload bytes of one block (one KV-cache group)."""
BLOCKS_PER_JOB = 2


class KeyedStoreHarness(HandlerHarness):
    """Stores and loads of blocks named by key; the subclass binds the store."""

    medium: Medium
    """The tier's medium."""

    def __init__(self) -> None:
        self.pool = HostPool(2 * MAX_OUTSTANDING * BLOCKS_PER_JOB + 2, ENTRY)
        self._keys = (offload_key(i.to_bytes(8, "little"), 0) for i in itertools.count())  # type: ignore[arg-type]
        self._slot = itertools.cycle(range(self.pool.num_slots))
        self._expected: dict[JobId, list[bytes]] = {}

    @abstractmethod
    def tier_blocks(self, keys: tuple[OffloadKey, ...]) -> BlockSpec:
        """The tier's block spec naming ``keys`` (one group)."""

    @abstractmethod
    def put(self, key: OffloadKey, value: bytes) -> None:
        """Write ``value`` where the tier's handler of ``NS`` reads ``key``'s block."""

    @abstractmethod
    def get(self, key: OffloadKey) -> bytes | None:
        """What the store holds where the handler of ``NS`` writes ``key``'s block; None if nothing."""

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
        return TransferJob(job_id, self.tier_blocks(missing), HostBlocks((next(self._slot),), (1,)))

    def verify(self, job: TransferJob) -> bool:
        if job.transfer_type == (Medium.HOST, self.medium):
            return self.payloads(self._keys_of(job.dst)) == self._expected[job.job_id]
        assert isinstance(job.dst, HostBlocks)
        return [bytes(self.pool.buffer[s].numpy()) for s in job.dst.slots] == self._expected[job.job_id]

    def job_bytes(self, job: TransferJob) -> int:
        return ENTRY * sum(job.dst.group_sizes)

    def payloads(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        """The payloads stored for ``keys``; [] if one is missing or fails its checks."""
        out: list[bytes] = []
        for key in keys:
            value = self.get(key)
            payload = bytearray(ENTRY)
            if value is None:
                return []
            try:
                open_into(PLAIN, NS.fingerprint(), key, value, memoryview(payload))
            except CorruptBlockError:
                return []
            out.append(bytes(payload))
        return out

    def _store_job(self, job_id: JobId, slots: tuple[int, ...], keys: tuple[OffloadKey, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in slots]
        for slot, data in zip(slots, fresh, strict=True):
            self.pool.buffer[slot] = torch.frombuffer(bytearray(data), dtype=torch.int8)
        self._expected[job_id] = fresh
        return TransferJob(job_id, HostBlocks(slots, (len(slots),)), self.tier_blocks(keys))

    def _load_job(self, job_id: JobId, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]) -> TransferJob:
        fresh = [os.urandom(ENTRY) for _ in keys]
        for key, data in zip(keys, fresh, strict=True):
            self.put(key, encode_value(PLAIN, NS.fingerprint(), key, memoryview(data)))
        self._expected[job_id] = fresh
        return TransferJob(job_id, self.tier_blocks(keys), HostBlocks(slots, (len(slots),)))

    @staticmethod
    def _keys_of(spec: BlockSpec) -> tuple[OffloadKey, ...]:
        keys: tuple[OffloadKey, ...] = getattr(spec, "keys")  # noqa: B009 (every keyed spec has them)
        return keys
