"""What the disk handler's tests build jobs and handlers with: keys, a host pool of random bytes, store and load
jobs, running one to its result, and where a key's block file lies."""

from __future__ import annotations

from pathlib import Path

import torch

from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.specs import DiskBlocks, HostBlocks, JobId, TransferJob
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.paths import block_path, rank_directory
from kvoffload.transfer.base import TransferResult
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
ENTRY = (48, 32)  # two KV-cache groups with different block sizes
SLOT = 64


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, salt: int = 0) -> tuple[OffloadKey, ...]:
    return tuple(offload_key(bytes([salt, i]) * 8, 0) for i in range(n))  # type: ignore[arg-type]


def make_pool(slots: int = 8) -> HostPool:
    pool = HostPool(slots, SLOT)
    pool.buffer.copy_(torch.randint(-128, 128, (slots, SLOT), dtype=torch.int8))
    return pool


_ids = iter(range(1, 1 << 30))


Groups = tuple[int, ...] | None


def store(slots: tuple[int, ...], ks: tuple[OffloadKey, ...], groups: Groups = None) -> TransferJob:
    groups = groups or (len(slots),)
    return TransferJob(JobId(next(_ids)), HostBlocks(slots, groups), DiskBlocks(ks, groups))


def load(ks: tuple[OffloadKey, ...], slots: tuple[int, ...], groups: Groups = None) -> TransferJob:
    groups = groups or (len(slots),)
    return TransferJob(JobId(next(_ids)), DiskBlocks(ks, groups), HostBlocks(slots, groups))


def run(handler: DiskHandler, job: TransferJob) -> TransferResult:
    assert handler.submit(job)
    handler.wait([job.job_id])
    (result,) = [r for r in handler.get_finished() if r.job_id == job.job_id]
    return result


def path_of(config: DiskTierConfig, key: OffloadKey, ns: Namespace = NS) -> Path:
    return Path(block_path(rank_directory(config.path, ns), key))


class DiskHandlerContext:
    """A handler over a fresh pool, shut down on exit."""

    def __init__(self, config: DiskTierConfig, ns: Namespace, **kwargs: object) -> None:
        self.handler = DiskHandler(config, make_pool(), ns, ENTRY, **kwargs)  # type: ignore[arg-type]

    def __enter__(self) -> DiskHandler:
        return self.handler

    def __exit__(self, *exc: object) -> None:
        self.handler.shutdown()
