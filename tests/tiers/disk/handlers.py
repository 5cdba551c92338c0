"""What the disk handler's tests build jobs and handlers with: keys, a host pool of random bytes, store and load
jobs (each key at a fixed slot of engine 0's slot file, ``place``; at that slot of another engine's file,
``at_engine``; or where a test says, ``at_places``), running one to its result, and where a key's block and table
entry lie in a slot file (``block_at``, ``read_block``, ``read_entry``, ``names``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tests.tiers.jobs import Groups, TierJobs, run

from kvoffload.blocks import Medium
from kvoffload.config import DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.disk.engine_files import prepare_engine
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.paths import rank_directory, slot_file_path
from kvoffload.tiers.disk.slot_file import ENTRY_BYTES, Layout, encode_entry, location, split_location
from kvoffload.tiers.lower.block_format import BlockFormat
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
ENTRY = (48, 32)  # two KV-cache groups with different block sizes
SLOT = 64
BUDGET = 256 << 10
"""The tests' ``disk_bytes``: a slot file of a few thousand slots (the default budget would make a huge table)."""


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


_places: dict[OffloadKey, int] = {}


def place(key: OffloadKey) -> int:
    """``key``'s place in the tests' jobs: its own slot of engine 0's file (the same key always the same slot)."""
    return location(0, _places.setdefault(key, len(_places) % 1024))


__all__ = ["Groups", "load", "run", "store"]  # the shared job builders, bound to this tier (tests/tiers/jobs.py)

_jobs = TierJobs(Medium.DISK, place)
store, load = _jobs.store, _jobs.load


def at_engine(engine: int) -> TierJobs:
    """Jobs whose keys sit at their ``place`` slot, but in engine ``engine``'s file (another engine's blocks)."""
    return TierJobs(Medium.DISK, lambda key: location(engine, split_location(place(key))[1]))


def at_places(places: dict[OffloadKey, int]) -> TierJobs:
    """Jobs whose keys sit at the ``location``s given (a test choosing slots a key shares with another)."""
    return TierJobs(Medium.DISK, places.__getitem__)


def prepare(config: DiskTierConfig, ns: Namespace = NS, engine: int = 0) -> Layout:
    """Make ``engine``'s slot files for ``config`` as a scheduler would before any job (a handler alone needs it)."""
    return prepare_engine(config, ns, BlockFormat.of(config.secret).file_bytes(max(ENTRY)), engine)


@dataclass(frozen=True)
class BlockAt:
    """Where a key's block and its table entry lie in the slot file (``place``)."""

    path: Path
    offset: int
    nbytes: int
    entry_offset: int


def block_at(config: DiskTierConfig, key: OffloadKey, ns: Namespace = NS, engine: int | None = None) -> BlockAt:
    """Where ``key``'s block (at ``place``) lies: in engine 0's file, or ``engine``'s at the same slot."""
    fmt = BlockFormat.of(config.secret)
    own, slot = split_location(place(key))
    engine = own if engine is None else engine
    layout = Layout.for_budget(config.capacity_bytes, fmt.file_bytes(max(ENTRY)))
    assert layout is not None
    path = Path(slot_file_path(rank_directory(config.path, ns, fmt), engine))
    return BlockAt(path, layout.slot_offset(slot), layout.stride, layout.entry_offset(slot))


def read_block(config: DiskTierConfig, key: OffloadKey, ns: Namespace = NS, engine: int | None = None) -> bytes:
    at = block_at(config, key, ns, engine)
    with open(at.path, "rb") as f:
        f.seek(at.offset)
        return f.read(at.nbytes)


def read_entry(config: DiskTierConfig, key: OffloadKey, ns: Namespace = NS, engine: int | None = None) -> bytes:
    """The raw table entry of ``key``'s slot (``place``)."""
    at = block_at(config, key, ns, engine)
    with open(at.path, "rb") as f:
        f.seek(at.entry_offset)
        return f.read(ENTRY_BYTES)


def names(config: DiskTierConfig, key: OffloadKey, ns: Namespace = NS, engine: int | None = None) -> bool:
    """Whether the table entry of ``key``'s slot names ``key`` (so a rebuilt index, or another engine, finds it)."""
    fmt = BlockFormat.of(config.secret)
    slot = split_location(place(key))[1]
    return read_entry(config, key, ns, engine) == encode_entry(bytes.fromhex(fmt.name(key)), slot)


def mode_of(path: Path | str) -> int:
    return os.stat(path, follow_symlinks=False).st_mode & 0o7777


def write_at(path: Path, offset: int, data: bytes) -> None:
    """Damage a slot file in place (what a disk, a crash or another user could do)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


class DiskHandlerContext:
    """A handler over a fresh pool (its slot files prepared), shut down on exit."""

    def __init__(self, config: DiskTierConfig, ns: Namespace, **kwargs: object) -> None:
        prepare(config, ns)
        self.handler = DiskHandler(config, make_pool(), ns, ENTRY, **kwargs)  # type: ignore[arg-type]

    def __enter__(self) -> DiskHandler:
        return self.handler

    def __exit__(self, *exc: object) -> None:
        self.handler.shutdown()
