"""DiskIndex: the scheduler's index of this engine's slot file. It is rebuilt from rank 0's table (damage is skipped,
never indexed wrongly); a restarted engine takes its number back and finds its blocks; engines sharing a directory
have distinct numbers and find each other's blocks without counting them in their budgets (a failed load forgets
that location); eviction frees slots within the layout's capacity; a reset empties the dropped keys' entries; only
an engine that starts alone trims other engines' files; the step does no file I/O; the tenants' policy applies; and
the directories are trusted only when no one else can write them."""

from __future__ import annotations

import builtins
import dataclasses
import errno
import fcntl
import grp
import itertools
import logging
import os
import random
import re
import stat
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.auth import TierSecret
from kvoffload.blocks import HostBlocks, JobId, Medium, TierBlocks, TransferJob
from kvoffload.config import ConfigError, DiskTierConfig, EvictionPolicy, OffloadConfig
from kvoffload.index.base import EventKind, LookupResult, PrepareStoreOutput
from kvoffload.index.policies.base import Policy
from kvoffload.index.policies.registry import make_policy
from kvoffload.index.tenants import TenantBook, TenantPolicy
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.testing.router_indexer import wait_for
from kvoffload.tiers.disk import index as index_module
from kvoffload.tiers.disk.foreign import ForeignTables
from kvoffload.tiers.disk.index import DiskIndex
from kvoffload.tiers.disk.paths import rank_directories, slot_file_path
from kvoffload.tiers.disk.slot_file import (
    EMPTY_ENTRY,
    ENTRY_BYTES,
    Layout,
    encode_entry,
    location,
    split_location,
)
from kvoffload.tiers.disk.spec import DiskTierSpec
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat, file_bytes
from kvoffload.tiers.spec import TierContext

NS = Namespace(model="m", dtype="bf16", layout="pages=64", rank=0, world_size=2)
FILE = file_bytes(1000)
SECRET = TierSecret("test", b"k" * 32)


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i % 256, i // 256]) * 4, 0) for i in range(n)]  # type: ignore[arg-type]


def budget(blocks: int) -> int:
    """The ``disk_bytes`` of a slot file of exactly ``blocks`` slots."""
    return Layout(FILE, blocks).file_bytes


def config(root: Path, blocks: int = 4, **kwargs: object) -> DiskTierConfig:
    return DiskTierConfig(path=root, capacity_bytes=budget(blocks), **kwargs)  # type: ignore[arg-type]


Start = Callable[..., DiskIndex]


def created(disk: DiskTierConfig, ns: Namespace = NS, nbytes: int = FILE) -> DiskIndex:
    """``DiskIndex.create``, its thread reading the other engines' tables stopped: a test reads them when it says
    (``read_tables``), never beside a read of the thread's (test_foreign.py tests the thread)."""
    index = DiskIndex.create(disk, ns, nbytes)
    tables(index).close()
    return index


def tables(index: DiskIndex) -> ForeignTables:
    assert index._foreign is not None
    return index._foreign


def read_tables(index: DiskIndex) -> None:
    tables(index).refresh()


@pytest.fixture
def start() -> Iterator[Start]:
    """Start an engine's index (``start(root, blocks=4, **config)``: ``created``); every one still running is closed
    at the end."""
    made: list[DiskIndex] = []

    def starting(root: Path, blocks: int = 4, **kwargs: object) -> DiskIndex:
        made.append(created(config(root, blocks, **kwargs)))
        return made[-1]

    yield starting
    for index in made:
        index.close()


@pytest.fixture
def manager(tmp_path: Path, start: Start) -> DiskIndex:
    return start(tmp_path)


def files(root: Path, engine: int = 0, fmt: BlockFormat = PLAIN) -> list[Path]:
    """``engine``'s slot file in every rank directory, rank 0's first."""
    return [Path(slot_file_path(d, engine)) for d in rank_directories(root, NS, fmt)]


def write_entries(root: Path, engine: int, placed: dict[int, OffloadKey], blocks: int = 4,
                  fmt: BlockFormat = PLAIN, ranks: tuple[int, ...] = (0, 1)) -> None:
    """The table entries every rank's worker writes after its blocks (the index reads entries, never blocks)."""
    layout = Layout(FILE, blocks)
    for rank in ranks:
        with open(files(root, engine, fmt)[rank], "r+b") as f:
            for slot, key in placed.items():
                f.seek(layout.entry_offset(slot))
                f.write(encode_entry(bytes.fromhex(fmt.name(key)), slot))


def entry(root: Path, engine: int, slot: int, rank: int = 0, blocks: int = 4) -> bytes:
    with open(files(root, engine)[rank], "rb") as f:
        f.seek(Layout(FILE, blocks).entry_offset(slot))
        return f.read(ENTRY_BYTES)


def damage(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def stored(index: DiskIndex, root: Path, ks: list[OffloadKey], success: bool = True, blocks: int = 4,
           fmt: BlockFormat = PLAIN) -> PrepareStoreOutput:
    """Store ``ks`` as the connector would: reserve, every rank's worker writes its blocks and their entries at the
    spec's places, complete."""
    out = index.prepare_store(ks)
    assert out is not None
    spec = out.store_spec
    assert isinstance(spec, TierBlocks)
    placed = {}
    for key, place in zip(out.keys_to_store, spec.slots, strict=True):
        engine, slot = split_location(place)
        assert engine == index.engine
        placed[slot] = key
    if success:
        write_entries(root, index.engine, placed, blocks, fmt)
    index.complete_store(out.keys_to_store, success)
    return out


def slots_of(out: PrepareStoreOutput) -> tuple[int, ...]:
    assert isinstance(out.store_spec, TierBlocks)
    return out.store_spec.slots


def places(index: DiskIndex, ks: list[OffloadKey]) -> tuple[int, ...]:
    """Where a load of ``ks`` would read them (pins them; completed at once)."""
    spec = index.prepare_load(ks)
    assert isinstance(spec, TierBlocks)
    index.complete_load(ks)
    return spec.slots


# ---- configuration ----------------------------------------------------------------------------------------------

def test_a_budget_below_one_slot_is_a_config_error_naming_disk_bytes(tmp_path: Path, start: Start) -> None:
    with pytest.raises(ConfigError, match="disk_bytes"):
        DiskIndex.create(DiskTierConfig(path=tmp_path, capacity_bytes=budget(1) - 1), NS, FILE)
    assert start(tmp_path, blocks=1).capacity == 1


def test_the_capacity_is_the_largest_layout_the_budget_holds(tmp_path: Path, start: Start) -> None:
    index = start(tmp_path, blocks=130)
    assert index.capacity == 130 == Layout.for_budget(budget(130), FILE).capacity  # type: ignore[union-attr]
    assert {p.stat().st_size for p in files(tmp_path)} == {budget(130)}
    assert index.usage()[0].capacity_blocks == 130


def test_unusable_disk_path_is_a_config_error_naming_disk_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError, match="disk_path"):
        DiskIndex.create(DiskTierConfig(path=blocker, capacity_bytes=budget(1)), NS, FILE)


@pytest.mark.parametrize("what", ["symlink", "directory", "fifo"])
def test_something_other_than_a_regular_file_at_this_engines_slot_file_path_is_a_config_error(
        tmp_path: Path, start: Start, what: str) -> None:
    start(tmp_path).close()  # the tree exists
    path = files(tmp_path)[1]
    path.unlink()
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's")
    {"symlink": lambda: path.symlink_to(victim), "directory": path.mkdir, "fifo": lambda: os.mkfifo(path)}[what]()
    with pytest.raises(ConfigError, match="disk_path"):
        DiskIndex.create(config(tmp_path), NS, FILE)
    assert victim.read_bytes() == b"someone else's"
    path.rmdir() if what == "directory" else path.unlink()
    assert start(tmp_path).engine == 0  # the failed start let go of its number


# ---- stores, and the rebuild at restart -------------------------------------------------------------------------

def test_stored_blocks_are_found_at_their_slots_and_announced_on_disk(manager: DiskIndex) -> None:
    ks = keys(3)
    out = manager.prepare_store(ks)
    assert out is not None
    assert out.store_spec == TierBlocks(Medium.DISK, tuple(ks), (3,), tuple(location(0, s) for s in range(3)))
    assert manager.lookup(ks).pending
    manager.complete_store(ks)
    assert manager.lookup(ks).hits == 3
    (event,) = manager.take_events()
    assert event.kind is EventKind.STORED and event.medium == Medium.DISK
    assert manager.prepare_load(ks[::-1]) == TierBlocks(Medium.DISK, tuple(ks[::-1]), (3,),
                                                        tuple(location(0, s) for s in (2, 1, 0)))
    manager.check_integrity()


def test_a_restarted_engine_takes_its_number_back_and_rebuilds_its_index_from_rank_0s_table(
        tmp_path: Path, start: Start) -> None:
    first = start(tmp_path)
    ks = keys(3)
    stored(first, tmp_path, ks)
    before = places(first, ks)
    first.close()
    again = start(tmp_path)
    assert again.engine == first.engine == 0
    assert again.lookup(ks).hits == 3 and places(again, ks) == before
    assert again.take_events() == []  # already there before start: nothing new to announce
    assert again.usage()[0].used_blocks == 3
    out = again.prepare_store(keys(1, salt=1))  # a new block goes to the free slot, never over an old one
    assert out is not None and out.evicted_keys == ()
    assert out.store_spec.slots == (location(0, 3),)  # type: ignore[union-attr]
    again.check_integrity()


def test_only_rank_0s_table_is_indexed(tmp_path: Path, start: Start) -> None:
    start(tmp_path).close()
    ks = keys(2)
    write_entries(tmp_path, 0, {0: ks[0]}, ranks=(0,))
    write_entries(tmp_path, 0, {1: ks[1]}, ranks=(1,))  # a block of rank 1 only
    index = start(tmp_path)
    assert index.lookup(ks[:1]).hits == 1 and index.lookup(ks[1:]).hits == 0
    assert index.usage()[0].used_blocks == 1


def test_a_damaged_or_moved_entry_is_skipped_at_restart_and_its_slot_is_free_again(
        tmp_path: Path, start: Start) -> None:
    start(tmp_path).close()
    ks = keys(4)
    write_entries(tmp_path, 0, {0: ks[0], 1: ks[1], 2: ks[2]})
    damage(files(tmp_path)[0], Layout(FILE, 4).entry_offset(1) + 5)  # ks[1]'s name
    with open(files(tmp_path)[0], "r+b") as f:  # slot 2's entry copied into slot 3's place, another key's name
        f.seek(Layout(FILE, 4).entry_offset(3))
        f.write(encode_entry(ks[3], 2))
    index = start(tmp_path)
    assert [index.lookup([k]).hits for k in ks] == [1, 0, 1, 0]
    assert places(index, [ks[0], ks[2]]) == (location(0, 0), location(0, 2))
    out = index.prepare_store(keys(2, salt=1))
    assert out is not None and out.evicted_keys == ()
    assert out.store_spec.slots == (location(0, 1), location(0, 3))  # type: ignore[union-attr]
    index.check_integrity()


def test_a_key_named_by_two_entries_is_indexed_once_at_the_first(tmp_path: Path, start: Start) -> None:
    start(tmp_path).close()
    (key,) = keys(1)
    write_entries(tmp_path, 0, {1: key, 3: key})
    index = start(tmp_path)
    assert places(index, [key]) == (location(0, 1),)
    assert index.usage()[0].used_blocks == 1
    index.check_integrity()


def test_a_damaged_file_header_starts_the_file_afresh_and_nothing_is_indexed(
        tmp_path: Path, start: Start, caplog: pytest.LogCaptureFixture) -> None:
    first = start(tmp_path)
    ks = keys(2)
    stored(first, tmp_path, ks)
    first.close()
    damage(files(tmp_path)[0], 14)  # the stride
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        index = start(tmp_path)
    assert index.lookup(ks) == LookupResult(0) and index.usage()[0].used_blocks == 0
    assert entry(tmp_path, 0, 0) == EMPTY_ENTRY
    assert any("afresh" in r.getMessage() and str(files(tmp_path)[0].parent) in r.getMessage()
               for r in caplog.records)


def test_a_restart_with_another_budget_starts_the_files_afresh(tmp_path: Path, start: Start) -> None:
    first = start(tmp_path, blocks=4)
    ks = keys(4)
    stored(first, tmp_path, ks)
    first.close()
    index = start(tmp_path, blocks=2)  # no entry of the old layout can name a slot of the new one
    assert index.capacity == 2 and index.lookup(ks) == LookupResult(0)
    assert [p.stat().st_size for p in files(tmp_path)] == [budget(2)] * 2
    assert entry(tmp_path, 0, 0, blocks=2) == EMPTY_ENTRY == entry(tmp_path, 0, 0, rank=1, blocks=2)


def test_a_sealed_tier_rebuilds_its_keys_from_the_names_in_its_table(tmp_path: Path, start: Start) -> None:
    fmt = BlockFormat.of(SECRET)
    first = start(tmp_path, secret=SECRET)
    ks = keys(2)
    stored(first, tmp_path, ks, fmt=fmt)
    assert ks[0] not in files(tmp_path, 0, fmt)[0].read_bytes()  # the table names no key of the prompt
    first.close()
    again = start(tmp_path, secret=SECRET)
    assert again.lookup(ks).hits == 2


def test_a_block_the_handler_stored_at_the_indexs_slot_loads_byte_for_byte_after_a_restart(tmp_path: Path) -> None:
    from tests.tiers.disk.handlers import BUDGET, ENTRY, make_pool, run
    from tests.tiers.disk.handlers import NS as ONE_RANK

    from kvoffload.tiers.disk.handler import DiskHandler

    disk = DiskTierConfig(path=tmp_path, capacity_bytes=BUDGET)
    nbytes = PLAIN.file_bytes(max(ENTRY))
    ids = itertools.count(1_000_000)
    index = created(disk, ONE_RANK, nbytes)
    handler = DiskHandler(disk, make_pool(), ONE_RANK, ENTRY)
    try:
        pool = handler._slots
        ks = keys(3)
        index.prepare_store(keys(2, salt=9))  # the blocks go to slots 2-4, not 0-2
        out = index.prepare_store(ks)
        assert out is not None and out.store_spec.slots == tuple(location(0, s) for s in (2, 3, 4))  # type: ignore[union-attr]
        assert run(handler, TransferJob(JobId(next(ids)), HostBlocks((0, 1, 2), (3,)), out.store_spec)).success
        index.complete_store(ks)
        index.close()
        index = created(disk, ONE_RANK, nbytes)
        assert index.lookup(ks).hits == 3
        spec = index.prepare_load(ks[::-1])
        assert run(handler, TransferJob(JobId(next(ids)), spec, HostBlocks((5, 6, 7), (3,)))).success
        index.complete_load(ks[::-1])
        for src, dst in ((0, 7), (1, 6), (2, 5)):
            assert bytes(pool[dst, :max(ENTRY)]) == bytes(pool[src, :max(ENTRY)])
    finally:
        handler.shutdown()
        index.close()


# ---- engines sharing a directory ---------------------------------------------------------------------------------

def test_two_engines_on_one_directory_get_distinct_numbers_and_files(tmp_path: Path, start: Start) -> None:
    a, b = start(tmp_path, blocks=4), start(tmp_path, blocks=8)
    assert (a.engine, b.engine) == (0, 1)
    assert [p.stat().st_size for p in files(tmp_path, 0)] == [budget(4)] * 2
    assert [p.stat().st_size for p in files(tmp_path, 1)] == [budget(8)] * 2


def test_an_engine_finds_the_other_engines_blocks_without_counting_them_in_its_budget(
        tmp_path: Path, start: Start) -> None:
    a, b = start(tmp_path), start(tmp_path)
    theirs, mine = keys(4), keys(4, salt=1)
    stored(a, tmp_path, theirs)
    assert b.lookup(theirs) == LookupResult(0)  # not read yet: the step reads no table
    read_tables(b)
    assert b.lookup(theirs).hits == 4
    assert places(b, theirs) == tuple(location(a.engine, s) for s in range(4))
    assert b.usage()[0].used_blocks == 0
    assert stored(b, tmp_path, mine).evicted_keys == ()  # a full budget of its own, none of it taken by a's
    mixed = [theirs[0], mine[1], theirs[2], mine[0]]
    assert b.lookup(mixed).hits == 4
    assert places(b, mixed) == (location(0, 0), location(1, 1), location(0, 2), location(1, 0))
    assert b.usage()[0].used_blocks == 4
    b.check_integrity()
    assert a.lookup(mine) == LookupResult(0)  # a has not read b's table yet; the step never does
    read_tables(a)
    assert a.lookup(mine).hits == 4


def test_a_block_this_engine_holds_is_loaded_from_its_own_file_even_when_another_engine_has_it(
        tmp_path: Path, start: Start) -> None:
    a, b = start(tmp_path), start(tmp_path)
    ks = keys(2)
    stored(a, tmp_path, ks)
    read_tables(b)
    assert b.lookup(ks).hits == 2  # both a's
    stored(b, tmp_path, ks[1:])
    assert places(b, ks) == (location(0, 0), location(1, 0))
    b.check_integrity()


def test_a_failed_load_of_another_engines_block_forgets_that_location(tmp_path: Path, start: Start) -> None:
    a, b, c = start(tmp_path), start(tmp_path), start(tmp_path)
    ks = keys(2)
    stored(a, tmp_path, ks)
    read_tables(b)
    assert b.lookup(ks).hits == 2
    spec = b.prepare_load(ks)
    assert spec.slots == (location(0, 0), location(0, 1))  # type: ignore[union-attr]
    b.complete_load(ks[:1], success=False)  # a's block of ks[0] did not load (damaged, or its slot reused)
    b.complete_load(ks[1:])
    read_tables(b)
    assert b.lookup(ks) == LookupResult(0) and b.lookup(ks[1:]).hits == 1
    assert b.usage()[0].used_blocks == 0 and b.take_events() == []  # none of b's own blocks was involved
    assert a.lookup(ks[:1]).hits == 1  # a's index is a's: it hears of its own failed loads only
    stored(c, tmp_path, ks[:1])  # another engine has it at another place
    read_tables(b)
    assert b.lookup(ks).hits == 2 and places(b, ks[:1]) == (location(c.engine, 0),)
    b.check_integrity()


def test_a_damaged_block_of_another_engine_fails_its_load_and_is_not_tried_again(
        tmp_path: Path) -> None:
    from tests.tiers.disk.handlers import BUDGET, ENTRY, make_pool, run
    from tests.tiers.disk.handlers import NS as ONE_RANK

    from kvoffload.tiers.disk.handler import DiskHandler

    disk = DiskTierConfig(path=tmp_path, capacity_bytes=BUDGET)
    nbytes = PLAIN.file_bytes(max(ENTRY))
    ids = itertools.count(2_000_000)
    a, b = created(disk, ONE_RANK, nbytes), created(disk, ONE_RANK, nbytes)
    handler = DiskHandler(disk, make_pool(), ONE_RANK, ENTRY)
    try:
        pool = handler._slots
        ks = keys(2)
        out = a.prepare_store(ks)
        assert out is not None
        assert run(handler, TransferJob(JobId(next(ids)), HostBlocks((0, 1), (2,)), out.store_spec)).success
        a.complete_store(ks)
        read_tables(b)
        layout = Layout.for_budget(BUDGET, nbytes)
        assert layout is not None
        path = Path(slot_file_path(rank_directories(tmp_path, ONE_RANK)[0], a.engine))
        damage(path, layout.slot_offset(1) + nbytes - 1)  # the last payload byte of ks[1]'s block
        for key, host_slot, ok in ((ks[0], 4, True), (ks[1], 5, False)):
            assert b.lookup([key]).hits == 1
            spec = b.prepare_load([key])
            assert spec.slots == (location(a.engine, 0 if ok else 1),)  # type: ignore[union-attr]
            result = run(handler, TransferJob(JobId(next(ids)), spec, HostBlocks((host_slot,), (1,))))
            assert result.success is ok
            b.complete_load([key], result.success)
        assert bytes(pool[4, :max(ENTRY)]) == bytes(pool[0, :max(ENTRY)])
        read_tables(b)
        assert b.lookup(ks[1:]) == LookupResult(0) and b.lookup(ks[:1]).hits == 1
    finally:
        handler.shutdown()
        a.close()
        b.close()


def test_a_miss_wakes_the_reads_of_the_other_engines_tables(tmp_path: Path, start: Start) -> None:
    a, b = start(tmp_path), start(tmp_path)
    b._foreign = ForeignTables(files(tmp_path)[0].parent, b.engine, PLAIN, interval_s=3600.0)  # only when poked
    assert wait_for(lambda: tables(b).reads >= 1, 5.0)
    (key,) = keys(1)
    stored(a, tmp_path, [key])
    assert b.lookup([key]) == LookupResult(0)  # the miss asks for a read
    assert wait_for(lambda: b.lookup([key]).hits == 1, 5.0)


# ---- eviction and the layout's capacity --------------------------------------------------------------------------

def test_eviction_frees_the_slot_for_the_next_store_and_a_restart_finds_only_what_is_held(
        manager: DiskIndex, tmp_path: Path, start: Start) -> None:
    first = keys(4)
    stored(manager, tmp_path, first)
    before = dict(zip(first, places(manager, first), strict=True))
    table = [entry(tmp_path, 0, s, rank) for s in range(4) for rank in (0, 1)]
    out = manager.prepare_store(keys(1, salt=1))  # a full tier: the oldest block goes
    assert out is not None
    (gone,) = out.evicted_keys
    assert out.store_spec.slots == (before[gone],)  # type: ignore[union-attr]
    assert [entry(tmp_path, 0, s, rank) for s in range(4) for rank in (0, 1)] == table  # the step wrote nothing
    assert manager.lookup([gone]) == LookupResult(0)
    write_entries(tmp_path, 0, {split_location(before[gone])[1]: keys(1, salt=1)[0]})  # the workers' writes
    manager.complete_store(out.keys_to_store)
    manager.close()
    again = start(tmp_path)
    assert again.lookup([gone]) == LookupResult(0)
    assert again.lookup(keys(1, salt=1)).hits == 1 and again.usage()[0].used_blocks == 4


def test_never_more_ready_keys_than_the_layouts_capacity(tmp_path: Path, start: Start) -> None:
    index = start(tmp_path, blocks=7)
    rng = random.Random(7)
    universe = keys(40)
    for step in range(300):
        ks = rng.sample(universe, rng.randint(1, 5))
        if rng.random() < 0.6:
            out = index.prepare_store(ks)
            if out is not None:
                index.complete_store(out.keys_to_store, success=rng.random() < 0.8)
        else:
            hits = index.lookup(ks).hits
            if hits:
                index.prepare_load(ks[:hits])
                index.complete_load(ks[:hits], success=rng.random() < 0.9)
        placed = index._index.placed()
        assert len(placed) <= 7 and len(set(placed.values())) == len(placed), step
        assert all(0 <= slot < 7 for slot in placed.values()), step
        assert index.usage()[0].used_blocks <= 7
        index.check_integrity()
    assert [p.stat().st_size for p in files(tmp_path)] == [budget(7)] * 2


def test_failed_store_indexes_nothing_and_frees_its_slots(manager: DiskIndex, tmp_path: Path) -> None:
    ks = keys(2)
    failed = slots_of(stored(manager, tmp_path, ks, success=False))
    assert manager.lookup(ks) == LookupResult(0) and manager.usage()[0].used_blocks == 0
    assert manager.take_events() == []
    assert sorted(slots_of(stored(manager, tmp_path, keys(2, salt=1)))) == sorted(failed)
    manager.check_integrity()


def test_failed_load_drops_the_block_and_frees_its_slot(manager: DiskIndex, tmp_path: Path) -> None:
    ks = keys(1)
    spec = slots_of(stored(manager, tmp_path, ks))
    manager.take_events()
    manager.prepare_load(ks)
    manager.complete_load(ks, success=False)
    assert manager.lookup(ks) == LookupResult(0)
    (event,) = manager.take_events()
    assert event.kind is EventKind.REMOVED and event.keys == tuple(ks)
    assert slots_of(stored(manager, tmp_path, keys(1, salt=1))) == spec
    manager.check_integrity()


# ---- reset ------------------------------------------------------------------------------------------------------

def test_reset_drops_unpinned_blocks_and_empties_their_entries_so_no_engine_finds_them(
        tmp_path: Path, start: Start) -> None:
    index, other = start(tmp_path), start(tmp_path)
    ks = keys(2)
    stored(index, tmp_path, ks)
    index.prepare_load(ks[:1])  # a load in progress pins ks[0]
    index.reset()
    assert index.lookup(ks[:1]).hits == 1 and index.lookup(ks[1:]).hits == 0
    assert [entry(tmp_path, 0, 1, rank) for rank in (0, 1)] == [EMPTY_ENTRY] * 2
    assert [entry(tmp_path, 0, 0, rank) for rank in (0, 1)] == [encode_entry(ks[0], 0)] * 2
    read_tables(other)
    assert other.lookup(ks[1:]) == LookupResult(0) and other.lookup(ks[:1]).hits == 1
    index.complete_load(ks[:1])
    index.close()
    other.close()
    assert start(tmp_path).lookup(ks) == LookupResult(1)  # a restart finds the pinned one only


def test_a_reset_whose_entries_cannot_be_emptied_is_logged_and_still_drops_the_keys(
        manager: DiskIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    ks = keys(2)
    stored(manager, tmp_path, ks)

    def read_only(*args: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(index_module, "clear_entries", read_only)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        manager.reset()
    assert manager.lookup(ks) == LookupResult(0)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "cannot empty the entries of 2 reset blocks" in warning
    manager.check_integrity()


# ---- other engines' files: trimmed only by an engine that starts alone ------------------------------------------

def test_an_engine_starting_while_another_runs_deletes_none_of_its_blocks(tmp_path: Path, start: Start) -> None:
    big = start(tmp_path, blocks=8)
    ks = keys(8)
    stored(big, tmp_path, ks, blocks=8)
    theirs = [p.read_bytes() for p in files(tmp_path, big.engine)]
    small = start(tmp_path, blocks=4)  # ``big`` still runs on this directory
    assert small.engine != big.engine and small.usage()[0].used_blocks == 0
    assert [p.read_bytes() for p in files(tmp_path, big.engine)] == theirs
    assert big.lookup(ks).hits == 8
    stored(small, tmp_path, keys(4, salt=1))
    assert stored(small, tmp_path, keys(1, salt=2)).evicted_keys != ()  # a full index: it evicts one of its own
    assert [p.read_bytes() for p in files(tmp_path, big.engine)] == theirs
    assert [p.stat().st_size for p in files(tmp_path, small.engine)] == [budget(4)] * 2


def test_an_engine_that_starts_alone_trims_the_files_of_engines_that_stopped(tmp_path: Path, start: Start) -> None:
    a, b = start(tmp_path), start(tmp_path)
    stored(a, tmp_path, keys(2))
    stored(b, tmp_path, keys(2, salt=1))
    a.close()
    b.close()
    rank0 = files(tmp_path)[0].parent
    kept = [rank0 / "engine-01.kvs", rank0 / "notes"]
    for path in kept:
        path.write_bytes(b"not a slot file")
    target = tmp_path / "target"
    target.write_bytes(b"what a link points at")
    (rank0 / "engine-5.kvs").symlink_to(target)
    index = start(tmp_path)
    assert index.engine == 0 and index.lookup(keys(2)).hits == 2
    assert not any(p.exists() for p in files(tmp_path, 1)) and not (rank0 / "engine-5.kvs").is_symlink()
    assert all(p.exists() for p in [*kept, *files(tmp_path, 0)])
    assert target.read_bytes() == b"what a link points at"
    read_tables(index)
    assert index.lookup(keys(2, salt=1)) == LookupResult(0)


def test_an_engine_that_starts_while_another_runs_takes_a_stopped_engines_number_and_trims_nothing(
        tmp_path: Path, start: Start) -> None:
    a, b = start(tmp_path), start(tmp_path)
    stored(b, tmp_path, keys(2, salt=1))
    b.close()
    leftover = files(tmp_path, 7)[0]
    leftover.write_bytes(b"")
    c = start(tmp_path)
    assert c.engine == 1 and c.lookup(keys(2, salt=1)).hits == 2  # b's file, kept: c's own blocks now
    assert leftover.exists() and all(p.exists() for p in files(tmp_path, a.engine))


# ---- the step does no file I/O ----------------------------------------------------------------------------------

FILE_CALLS = [(os, name) for name in ("open", "pread", "pwrite", "preadv", "pwritev", "read", "write", "scandir",
                                       "listdir", "stat", "lstat", "fstat", "access", "unlink", "rename", "replace",
                                       "ftruncate", "truncate", "mkdir", "fsync")]
FILE_CALLS += [(builtins, "open"), (fcntl, "flock")]


def test_lookups_stores_and_loads_touch_no_file(tmp_path: Path, start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = start(tmp_path), start(tmp_path)
    theirs, mine = keys(3), keys(3, salt=1)
    stored(a, tmp_path, theirs)
    stored(b, tmp_path, mine[:1])
    read_tables(b)
    step = threading.get_ident()  # the other engines' tables are read on a thread of their own: not this one
    calls: list[str] = []

    def refuse(module: object, name: str) -> None:
        real = getattr(module, name)

        def call(*args: object, **kwargs: object) -> object:
            if threading.get_ident() == step:
                calls.append(name)
                raise OSError(errno.EIO, f"the step called {name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    for module, name in FILE_CALLS:
        refuse(module, name)
    assert b.lookup([*mine[:1], *theirs, keys(1, salt=2)[0]]).hits == 4  # own, then a's; then a miss
    spec = b.prepare_load([theirs[0], mine[0]])
    assert spec.slots == (location(0, 0), location(1, 0))  # type: ignore[union-attr]
    b.touch([theirs[0], mine[0]])
    b.complete_load([theirs[0]], success=False)
    b.complete_load([mine[0]])
    out = b.prepare_store(mine[1:])
    assert out is not None
    b.complete_store(out.keys_to_store[:1])
    b.complete_store(out.keys_to_store[1:], success=False)
    b.prepare_load(mine[:2])
    b.complete_load(mine[:2], success=False)
    b.take_events()
    b.usage()
    b.check_integrity()
    monkeypatch.undo()
    assert calls == []


# ---- tenants ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GroupLayout:
    groups: tuple[str, ...] = ("attn",)

    def group_block_bytes(self, group: int) -> int:
        return 500


def test_the_tier_policy_of_the_context_is_the_index_policy(tmp_path: Path) -> None:
    book = TenantBook(["a"], [0.5, 0.5])
    context = TierContext(NS, GroupLayout(), 2, book)
    assert PLAIN.file_bytes(max(context.entry_bytes)) == FILE
    index = DiskTierSpec(config(tmp_path, 6)).make_index(context)
    try:
        assert isinstance(index._index.host_policy, TenantPolicy) and index.capacity == 6
    finally:
        index.close()
    asked, made = [], []

    def recording(kind: EvictionPolicy, capacity: int, tier: str) -> Policy:
        asked.append((kind, capacity, tier))
        made.append(make_policy(kind, capacity))
        return made[-1]

    index = DiskIndex.create(config(tmp_path, 6, policy=EvictionPolicy.S3FIFO), NS, FILE, recording)
    try:
        assert asked == [(EvictionPolicy.S3FIFO, 6, "disk")]  # the slot file's capacity, not a guess
        assert index._index.host_policy is made[0]
    finally:
        index.close()


# ---- imports and start-up cost ----------------------------------------------------------------------------------

def test_scheduler_side_disk_modules_import_no_torch() -> None:
    code = ("import sys, kvoffload.tiers.disk.index, kvoffload.index.tiered; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0


def test_a_hundred_million_block_disk_index_allocates_little_until_used(tmp_path: Path, start: Start) -> None:
    tracemalloc.start()
    try:
        index = start(tmp_path, blocks=100_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.capacity == 100_000_000
    assert peak < 1 << 20
    assert slots_of(stored(index, tmp_path, keys(2), blocks=100_000_000)) == (location(0, 0), location(0, 1))


# ---- who may write the tier's directories ---------------------------------------------------------------------

def test_a_pre_created_world_writable_tier_directory_is_refused_naming_it(tmp_path: Path, start: Start) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(ConfigError, match=f"{re.escape(str(root))}.*writable by others"):
        start(root)


def test_a_tier_directory_owned_by_another_user_is_refused(tmp_path: Path, start: Start) -> None:
    world = rank_directories(tmp_path, NS)[0].parent
    world.mkdir(mode=0o700)
    os.chown(world, 12345, -1)
    with pytest.raises(ConfigError, match=f"{re.escape(str(world))}.*owned by uid 12345"):
        start(tmp_path)


def test_a_rank_directory_owned_by_another_user_is_refused(tmp_path: Path, start: Start) -> None:
    rank1 = rank_directories(tmp_path, NS)[1]
    rank1.mkdir(mode=0o700, parents=True)
    os.chown(rank1, 12345, -1)
    with pytest.raises(ConfigError, match=f"{re.escape(str(rank1))}.*owned by uid 12345"):
        start(tmp_path)


def test_a_group_writable_directory_is_accepted_only_for_the_shared_group(tmp_path: Path, start: Start) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    os.chown(root, -1, 4242)
    root.chmod(0o770)
    with pytest.raises(ConfigError, match=f"{re.escape(str(root))}.*writable by group 4242.*disk_shared_group"):
        start(root)
    start(root, shared_group=4242)
    with pytest.raises(ConfigError, match="writable by group 4242"):
        start(root, shared_group=4343)


def test_every_directory_and_file_of_the_tree_is_private_whatever_the_umask(tmp_path: Path, start: Start) -> None:
    old = os.umask(0o022)
    try:
        start(tmp_path / "kv")
    finally:
        os.umask(old)
    created = [tmp_path / "kv", *(tmp_path / "kv").rglob("*")]
    directories = [p for p in created if p.is_dir()]
    assert len(directories) == 1 + 1 + 2  # disk_path, the world's directory, rank0 and rank1: no fan-outs
    assert {stat.S_IMODE(p.lstat().st_mode) for p in directories} == {0o700}
    regular = [p for p in created if not p.is_dir()]
    assert sorted(p.name for p in regular) == ["engine-0.kvs", "engine-0.kvs", "engine-0.lock", "engines.lock"]
    assert {stat.S_IMODE(p.lstat().st_mode) for p in regular} == {0o600}


def test_a_shared_group_tree_is_created_group_writable_for_that_group_only(tmp_path: Path, start: Start) -> None:
    old = os.umask(0o022)
    try:
        start(tmp_path / "kv", shared_group=4242)
    finally:
        os.umask(old)
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
