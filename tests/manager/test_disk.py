"""DiskTierManager: the scheduler's index of block files (rebuild, budget, adoption, file removal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.disk_format import block_path, file_bytes, rank_directory
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.manager.base import EventKind
from kvoffload.manager.disk import DiskTierManager
from kvoffload.specs import DiskBlocks, Medium

NS = Namespace(model="m", dtype="bf16", layout="pages=64", rank=0, world_size=2)
FILE = file_bytes(1000)


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i % 256, i // 256]) * 4, 0) for i in range(n)]  # type: ignore[arg-type]


def make(tmp_path: Path, blocks: int = 4) -> DiskTierManager:
    return DiskTierManager.create(DiskTierConfig(path=tmp_path, capacity_bytes=blocks * FILE), NS, FILE)


def plant(tmp_path: Path, key: OffloadKey, rank: int = 0) -> Path:
    """A block file as a worker of ``rank`` would leave it (the index reads names only)."""
    ns = Namespace(model="m", dtype="bf16", layout="pages=64", rank=rank, world_size=2)
    path = Path(block_path(rank_directory(tmp_path, ns), key))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def stored(manager: DiskTierManager, root: Path, ks: list[OffloadKey], success: bool = True) -> None:
    """Store ``ks`` as the connector would: reserve, every rank's worker writes its file, complete."""
    out = manager.prepare_store(ks)
    assert out is not None
    for key in out.keys_to_store:
        plant(root, key, 0)
        plant(root, key, 1)
    manager.complete_store(out.keys_to_store, success)


@pytest.fixture
def manager(tmp_path: Path) -> DiskTierManager:
    return make(tmp_path)


def test_capacity_below_one_block_file_is_a_config_error_naming_disk_bytes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="disk_bytes"):
        DiskTierManager.create(DiskTierConfig(path=tmp_path, capacity_bytes=FILE - 1), NS, FILE)


def test_unusable_disk_path_is_a_config_error_naming_disk_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError, match="disk_path"):
        DiskTierManager.create(DiskTierConfig(path=blocker, capacity_bytes=FILE), NS, FILE)


def test_stored_blocks_are_found_and_announced_on_disk(manager: DiskTierManager) -> None:
    ks = keys(3)
    out = manager.prepare_store(ks)
    assert out is not None and out.store_spec == DiskBlocks(tuple(ks), (3,))
    assert manager.lookup(ks).pending
    manager.complete_store(ks)
    assert manager.lookup(ks).hits == 3
    (event,) = manager.take_events()
    assert event.kind is EventKind.STORED and event.medium is Medium.DISK
    manager.check_integrity()


def test_restart_rebuilds_the_index_from_file_names_and_drops_crash_leftovers(tmp_path: Path) -> None:
    ks = keys(3)
    for key in ks:
        plant(tmp_path, key)
    tmp = Path(block_path(rank_directory(tmp_path, NS), ks[0])[:-4] + ".999999999-0.tmp")  # a dead writer
    tmp.write_bytes(b"half")
    manager = make(tmp_path)
    assert manager.lookup(ks).hits == 3
    assert not tmp.exists()
    assert manager.take_events() == []  # already there before start: nothing new to announce
    manager.check_integrity()


def test_restart_with_a_smaller_budget_deletes_the_files_beyond_it(tmp_path: Path) -> None:
    paths = [plant(tmp_path, key) for key in keys(6)]
    manager = make(tmp_path, blocks=4)
    assert manager.usage()[0].used_blocks == 4
    assert sum(p.exists() for p in paths) == 4


def test_eviction_removes_the_files_of_every_rank(manager: DiskTierManager, tmp_path: Path) -> None:
    first = keys(4)
    stored(manager, tmp_path, first)
    stored(manager, tmp_path, keys(1, salt=1))  # a full tier: the oldest block goes
    gone = [k for k in first if manager.lookup([k]).hits == 0]
    assert len(gone) == 1
    for rank in (0, 1):
        ns = Namespace(model="m", dtype="bf16", layout="pages=64", rank=rank, world_size=2)
        assert not Path(block_path(rank_directory(tmp_path, ns), gone[0])).exists()
    assert len(list(tmp_path.rglob("*.kvb"))) == 2 * 4  # never more than the budget


def test_failed_store_indexes_nothing_and_removes_files_a_rank_wrote(
        manager: DiskTierManager, tmp_path: Path) -> None:
    ks = keys(2)
    stored(manager, tmp_path, ks, success=False)
    assert manager.lookup(ks).hits == 0
    assert not list(tmp_path.rglob("*.kvb"))
    manager.check_integrity()


def test_failed_load_forgets_the_block_and_its_files(manager: DiskTierManager, tmp_path: Path) -> None:
    ks = keys(1)
    stored(manager, tmp_path, ks)
    manager.prepare_load(ks)
    manager.complete_load(ks, success=False)
    assert manager.lookup(ks).hits == 0
    assert not list(tmp_path.rglob("*.kvb"))


def test_a_block_written_by_another_engine_is_adopted_on_lookup(
        manager: DiskTierManager, tmp_path: Path) -> None:
    ks = keys(3)
    stored(manager, tmp_path, ks[:1])
    plant(tmp_path, ks[1])  # written by a second engine sharing the directory, after this one started
    assert manager.lookup(ks).hits == 2
    assert manager.prepare_load(ks[:2]) == DiskBlocks(tuple(ks[:2]), (2,))
    manager.check_integrity()


def test_reset_forgets_unpinned_blocks_and_their_files(manager: DiskTierManager, tmp_path: Path) -> None:
    ks = keys(2)
    stored(manager, tmp_path, ks)
    manager.prepare_load(ks[:1])
    manager.reset()
    assert manager.lookup(ks[:1]).hits == 1 and manager.lookup(ks[1:]).hits == 0
    assert len(list(tmp_path.rglob("*.kvb"))) == 2  # the pinned block's two rank files


def test_scheduler_side_disk_modules_import_no_torch() -> None:
    code = ("import sys, kvoffload.manager.disk, kvoffload.manager.tiered; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0
