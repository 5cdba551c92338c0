"""DiskIndex: the scheduler's index of block files (rebuild, budget, adoption, file removal)."""

from __future__ import annotations

import dataclasses
import errno
import gc
import grp
import logging
import os
import re
import stat
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from kvoffload.blocks import Medium, TierBlocks
from kvoffload.config import ConfigError, DiskTierConfig, OffloadConfig
from kvoffload.index.base import EventKind, LookupResult
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import block_path, rank_directory
from kvoffload.tiers.lower.block_format import file_bytes

NS = Namespace(model="m", dtype="bf16", layout="pages=64", rank=0, world_size=2)
FILE = file_bytes(1000)


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i % 256, i // 256]) * 4, 0) for i in range(n)]  # type: ignore[arg-type]


def make(tmp_path: Path, blocks: int = 4) -> DiskIndex:
    return DiskIndex.create(DiskTierConfig(path=tmp_path, capacity_bytes=blocks * FILE), NS, FILE)


def plant(tmp_path: Path, key: OffloadKey, rank: int = 0) -> Path:
    """A block file as a worker of ``rank`` would leave it (the index reads names only)."""
    ns = Namespace(model="m", dtype="bf16", layout="pages=64", rank=rank, world_size=2)
    path = Path(block_path(rank_directory(tmp_path, ns), key))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def stored(manager: DiskIndex, root: Path, ks: list[OffloadKey], success: bool = True) -> None:
    """Store ``ks`` as the connector would: reserve, every rank's worker writes its file, complete."""
    out = manager.prepare_store(ks)
    assert out is not None
    for key in out.keys_to_store:
        plant(root, key, 0)
        plant(root, key, 1)
    manager.complete_store(out.keys_to_store, success)


@pytest.fixture
def manager(tmp_path: Path) -> DiskIndex:
    return make(tmp_path)


def test_capacity_below_one_block_file_is_a_config_error_naming_disk_bytes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="disk_bytes"):
        DiskIndex.create(DiskTierConfig(path=tmp_path, capacity_bytes=FILE - 1), NS, FILE)


def test_unusable_disk_path_is_a_config_error_naming_disk_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError, match="disk_path"):
        DiskIndex.create(DiskTierConfig(path=blocker, capacity_bytes=FILE), NS, FILE)


def test_stored_blocks_are_found_and_announced_on_disk(manager: DiskIndex) -> None:
    ks = keys(3)
    out = manager.prepare_store(ks)
    assert out is not None and out.store_spec == TierBlocks(Medium.DISK, tuple(ks), (3,))
    assert manager.lookup(ks).pending
    manager.complete_store(ks)
    assert manager.lookup(ks).hits == 3
    (event,) = manager.take_events()
    assert event.kind is EventKind.STORED and event.medium == Medium.DISK
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


def test_eviction_removes_the_files_of_every_rank(manager: DiskIndex, tmp_path: Path) -> None:
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
        manager: DiskIndex, tmp_path: Path) -> None:
    ks = keys(2)
    stored(manager, tmp_path, ks, success=False)
    assert manager.lookup(ks).hits == 0
    assert not list(tmp_path.rglob("*.kvb"))
    manager.check_integrity()


def test_failed_load_forgets_the_block_and_its_files(manager: DiskIndex, tmp_path: Path) -> None:
    ks = keys(1)
    stored(manager, tmp_path, ks)
    manager.prepare_load(ks)
    manager.complete_load(ks, success=False)
    assert manager.lookup(ks).hits == 0
    assert not list(tmp_path.rglob("*.kvb"))


def test_a_block_written_by_another_engine_is_adopted_on_lookup(
        manager: DiskIndex, tmp_path: Path) -> None:
    ks = keys(3)
    stored(manager, tmp_path, ks[:1])
    plant(tmp_path, ks[1])  # written by a second engine sharing the directory, after this one started
    assert manager.lookup(ks).hits == 2
    assert manager.prepare_load(ks[:2]) == TierBlocks(Medium.DISK, tuple(ks[:2]), (2,))
    manager.check_integrity()


def test_reset_forgets_unpinned_blocks_and_their_files(manager: DiskIndex, tmp_path: Path) -> None:
    ks = keys(2)
    stored(manager, tmp_path, ks)
    manager.prepare_load(ks[:1])
    manager.reset()
    assert manager.lookup(ks[:1]).hits == 1 and manager.lookup(ks[1:]).hits == 0
    assert len(list(tmp_path.rglob("*.kvb"))) == 2  # the pinned block's two rank files


def test_scheduler_side_disk_modules_import_no_torch() -> None:
    code = ("import sys, kvoffload.tiers.disk.index, kvoffload.index.tiered; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0


# ---- a block that can be neither loaded nor removed -----------------------------------------------------------

def refuse_removal(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Files under ``root`` cannot be removed (a file system that turned read-only)."""
    real = os.unlink

    def unlink(path: str, *args: object, **kwargs: object) -> None:
        if str(path).startswith(str(root)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)


def test_a_block_whose_load_failed_is_not_adopted_again_until_its_file_is_replaced(
        manager: DiskIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (key,) = keys(1)
    path = plant(tmp_path, key)
    assert manager.lookup([key]).hits == 1  # adopted
    refuse_removal(monkeypatch, tmp_path)
    manager.prepare_load([key])
    manager.complete_load([key], success=False)  # corrupt, and its file stays
    assert path.exists()
    assert manager.lookup([key]) == LookupResult(0) and manager.lookup([key]) == LookupResult(0)
    monkeypatch.undo()
    path.unlink()
    plant(tmp_path, key).write_bytes(b"a new file")  # another engine wrote it again
    assert manager.lookup([key]).hits == 1
    manager.check_integrity()


def test_a_failed_removal_is_logged_once_not_every_time(
        manager: DiskIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    refuse_removal(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        for salt in range(5):
            stored(manager, tmp_path, keys(1, salt=salt), success=False)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "remove" in warnings[0].getMessage()
    assert manager.removal_errors == 10  # 5 keys, 2 ranks


def test_a_directory_at_a_block_path_is_never_adopted(manager: DiskIndex, tmp_path: Path) -> None:
    (key,) = keys(1)
    plant(tmp_path, key).unlink()
    Path(block_path(rank_directory(tmp_path, NS), key)).mkdir()
    assert manager.lookup([key]) == LookupResult(0)
    manager.check_integrity()


# ---- the start-up scan trusts only what is ours ---------------------------------------------------------------

def rank0(root: Path) -> Path:
    return rank_directory(root, NS)


def test_scan_indexes_only_regular_files_with_their_canonical_name_in_their_fan_out(tmp_path: Path) -> None:
    good, as_dir, as_fifo, as_link, misplaced, upper = keys(6)
    plant(tmp_path, good)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not ours")
    for key, make_it in ((as_dir, Path.mkdir), (as_fifo, lambda p: os.mkfifo(p)),
                         (as_link, lambda p: p.symlink_to(target))):
        path = Path(block_path(rank0(tmp_path), key))
        path.parent.mkdir(parents=True, exist_ok=True)
        make_it(path)
    wrong_place = rank0(tmp_path) / f"{(int(misplaced.hex()[:2], 16) ^ 1):02x}" / f"{misplaced.hex()}.kvb"
    wrong_place.parent.mkdir(parents=True, exist_ok=True)
    wrong_place.write_bytes(b"x")
    upper_name = Path(block_path(rank0(tmp_path), upper))
    upper_name = upper_name.with_name(upper.hex().upper() + ".kvb")
    upper_name.parent.mkdir(parents=True, exist_ok=True)
    upper_name.write_bytes(b"x")
    manager = make(tmp_path, blocks=1)  # junk must not push the real block out of a one-block budget
    assert manager.usage()[0].used_blocks == 1 and manager.lookup([good]).hits == 1
    assert target.read_bytes() == b"not ours" and wrong_place.exists() and upper_name.exists()


def test_a_symlinked_fan_out_directory_is_skipped_and_what_it_points_at_is_left_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (key,) = keys(1)
    fan_out = Path(block_path(rank0(tmp_path), key)).parent
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / f"{key.hex()}.kvb").write_bytes(b"x")
    (victim / f"{key.hex()}.999999999-0.tmp").write_bytes(b"someone else's")  # a dead pid: ours would go
    fan_out.parent.mkdir(parents=True)
    fan_out.symlink_to(victim, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        manager = make(tmp_path)
    assert manager.lookup([key]) == LookupResult(0)  # neither indexed nor adopted through the link
    assert sorted(p.name for p in victim.iterdir()) == sorted([f"{key.hex()}.kvb",
                                                               f"{key.hex()}.999999999-0.tmp"])
    assert len([r for r in caplog.records if "symbolic link" in r.getMessage()]) == 1


def test_only_our_own_temporary_names_are_removed(tmp_path: Path) -> None:
    (key,) = keys(1)
    fan_out = Path(block_path(rank0(tmp_path), key)).parent
    fan_out.mkdir(parents=True)
    ours = fan_out / f"{key.hex()}.999999999-0.tmp"  # a dead writer's
    ours.write_bytes(b"half")
    others = [fan_out / "notes.tmp", fan_out / "x.y.tmp", fan_out / f"{key.hex()}.tmp"]
    for path in others:
        path.write_bytes(b"not ours")
    a_directory = fan_out / f"{key.hex()}.999999998-0.tmp"
    a_directory.mkdir()
    make(tmp_path)
    assert not ours.exists() and all(p.exists() for p in others) and a_directory.is_dir()


# ---- a directory shared by engines of different budgets -------------------------------------------------------

def test_a_smaller_budget_engine_starting_on_a_shared_directory_deletes_none_of_the_others_blocks(
        tmp_path: Path) -> None:
    big = make(tmp_path, blocks=8)
    ks = keys(8)
    stored(big, tmp_path, ks)
    small = make(tmp_path, blocks=4)  # ``big`` still runs on this directory
    assert small.usage()[0].used_blocks == 4
    assert len(list(rank0(tmp_path).rglob("*.kvb"))) == 8
    assert big.lookup(ks).hits == 8
    stored(small, tmp_path, keys(1, salt=1))  # a full index: ``small`` evicts one block of its own index
    assert len(list(rank0(tmp_path).rglob("*.kvb"))) == 8


def test_an_engine_that_starts_alone_trims_leftovers_beyond_its_budget(tmp_path: Path) -> None:
    big = make(tmp_path, blocks=8)
    stored(big, tmp_path, keys(8))
    del big  # stopped
    gc.collect()
    make(tmp_path, blocks=4)
    assert len(list(rank0(tmp_path).rglob("*.kvb"))) == 4


# ---- start-up cost does not grow with the slot count ----------------------------------------------------------

def test_a_hundred_million_block_disk_index_allocates_little_until_used(tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        manager = make(tmp_path, blocks=100_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert manager.capacity == 100_000_000
    assert peak < 1 << 20


# ---- who may write the tier's directories ---------------------------------------------------------------------

def test_a_pre_created_world_writable_tier_directory_is_refused_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(ConfigError, match=f"{re.escape(str(root))}.*writable by others"):
        make(root)


def test_a_tier_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    world = rank0(tmp_path).parent
    world.mkdir(mode=0o700)
    os.chown(world, 12345, -1)
    with pytest.raises(ConfigError, match=f"{re.escape(str(world))}.*owned by uid 12345"):
        make(tmp_path)


def test_a_group_writable_directory_is_accepted_only_for_the_shared_group(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    os.chown(root, -1, 4242)
    root.chmod(0o770)
    with pytest.raises(ConfigError, match=f"{re.escape(str(root))}.*writable by group 4242.*disk_shared_group"):
        make(root)
    config = DiskTierConfig(path=root, capacity_bytes=4 * FILE, shared_group=4242)
    DiskIndex.create(config, NS, FILE)
    with pytest.raises(ConfigError, match="writable by group 4242"):
        DiskIndex.create(dataclasses.replace(config, shared_group=4343), NS, FILE)


def test_every_directory_of_the_tree_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        make(tmp_path / "kv")
    finally:
        os.umask(old)
    created = [tmp_path / "kv", *(tmp_path / "kv").rglob("*")]
    directories = [p for p in created if p.is_dir()]
    assert len(directories) == 1 + 1 + 1 + 256  # disk_path, the world's directory, rank0, its fan-out
    assert {stat.S_IMODE(p.lstat().st_mode) for p in directories} == {0o700}
    assert {stat.S_IMODE(p.lstat().st_mode) for p in created if not p.is_dir()} == {0o600}  # the engines' lock


def test_a_shared_group_tree_is_created_group_writable_for_that_group_only(tmp_path: Path) -> None:
    config = DiskTierConfig(path=tmp_path / "kv", capacity_bytes=4 * FILE, shared_group=4242)
    DiskIndex.create(config, NS, FILE)
    created = [tmp_path / "kv", *(tmp_path / "kv").rglob("*")]
    modes = {(p.is_dir(), p.stat().st_mode & 0o777, p.stat().st_gid) for p in created}
    assert modes == {(True, 0o770, 4242), (False, 0o660, 4242)}


def test_disk_shared_group_takes_a_group_name_or_a_gid() -> None:
    def parsed(value: object) -> int | None:
        config = OffloadConfig.from_dict({"disk_path": "/tmp/kv", "disk_shared_group": value})
        assert config.disk is not None
        return config.disk.shared_group

    assert parsed(grp.getgrgid(0).gr_name) == 0 and parsed(4242) == 4242 and parsed("4242") == 4242
    for bad in ("no-such-group-here", -1, True, ""):
        with pytest.raises(ConfigError, match="disk_shared_group"):
            parsed(bad)
    assert OffloadConfig.from_dict({"disk_path": "/tmp/kv"}).disk == DiskTierConfig(path=Path("/tmp/kv"))
