"""The shared index checks everything it reads back (``_nodeindex.c``): damage written into it by a bug, a version
mix or a stray write is repaired from the slots, or makes the engine leave the pool; it never crashes, hangs or
raises out of an engine's step, and never has a load read another block's bytes.

Each test damages the segment the way issue 34 found it broke, and shows what used to happen is now caught."""

from __future__ import annotations

import fcntl
import os
import random
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.tiers.node.pools import index_in, keys, locks_in, segment_in, slot_field, store, table_offset

from kvoffload import _nodeindex
from kvoffload.blocks import HostBlocks
from kvoffload.config import NodeTierConfig, TenantBy, TenantConfig
from kvoffload.index.base import IntegrityError
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.segment import namespace_directory

LAYOUT = _nodeindex.LAYOUT


def tick(index: NodeIndex) -> None:
    """What an engine does once a RECLAIM_S: check (and repair) the index, look for the dead."""
    index._last_reclaim = 0.0
    index._reclaim()


def put(index: NodeIndex, offset: int, fmt: str, value: int) -> None:
    struct.pack_into(fmt, index._segment, offset, value)


def test_a_slot_state_no_code_writes_is_caught_and_the_slot_quarantined(node_path: Path) -> None:
    a = index_in(node_path, 4)
    blocks = keys(2)
    spec = store(a, blocks)
    a._segment[slot_field(a, spec.slots[0], "state")] = 7
    with pytest.raises(IntegrityError, match="fails its check"):
        a.check_integrity()
    tick(a)  # repaired: the damaged slot is quarantined, the rest kept
    a.check_integrity()
    assert a.lookup(blocks).hits == 0 and a.lookup(blocks[1:]).hits == 1
    assert not _nodeindex.verify(a._segment, spec.slots[:1], spec.epochs[:1])
    assert a.pool_counters()["repairs"] >= 1


def test_a_free_slot_flipped_to_ready_never_serves_its_stale_bytes(node_path: Path) -> None:
    """A store that failed leaves its key in a free slot; one flipped state byte used to make it a hit."""
    a = index_in(node_path, 4)
    blocks = keys(1)
    out = a.prepare_store(blocks)
    assert out is not None
    a.complete_store(blocks, success=False)  # the slot is free again, the key and half its bytes still there
    a._segment[slot_field(a, out.store_spec.slots[0], "state")] = _nodeindex.READY
    tick(a)
    assert a.lookup(blocks).hits == 0
    assert not _nodeindex.verify(a._segment, out.store_spec.slots, out.store_spec.epochs)


@pytest.mark.parametrize("value", [0x7FFFFFF0, -5, 1 << 30])
def test_a_table_entry_naming_no_slot_is_no_crash(node_path: Path, value: int) -> None:
    a = index_in(node_path, 4)
    blocks = keys(3)
    store(a, blocks)
    table = table_offset(a)
    for entry in range(8):
        put(a, table + 4 * entry, "<i", value)  # SIGSEGV in the engine that next evicted, before
    a.lookup(blocks)  # lock-free read sees damage: repaired under the mutex
    assert a.prepare_store(keys(4)) is not None  # evicts: no crash
    a.check_integrity()


def test_a_table_with_no_empty_entry_never_loops(node_path: Path) -> None:
    a = index_in(node_path, 4)
    table = table_offset(a)
    size = _nodeindex.stats(a._segment)["capacity"] * 2
    for entry in range(size):
        put(a, table + 4 * entry, "<i", 0)  # every probe used to go on forever inside the mutex
    assert a.lookup(keys(2)).hits == 0
    assert a.prepare_store(keys(2)) is not None
    tick(a)
    a.check_integrity()


def test_a_clock_hand_past_the_pool_is_no_crash(node_path: Path) -> None:
    a = index_in(node_path, 4)
    store(a, keys(4))
    put(a, LAYOUT["hand"], "<Q", 1 << 40)
    assert a.prepare_store(keys(2)) is not None
    tick(a)
    a.check_integrity()


@pytest.mark.parametrize("repaired", [False, True])
def test_a_next_epoch_going_back_never_makes_an_old_pin_valid_again(node_path: Path, repaired: bool) -> None:
    a = index_in(node_path, 2)
    spec = store(a, keys(2))
    put(a, LAYOUT["next_epoch"], "<Q", spec.epochs[0])  # epochs restart: a reused slot got an epoch a reader holds
    if repaired:
        tick(a)
    again = store(a, keys(2))  # evicts both: the same slots
    assert set(again.slots) == set(spec.slots)
    assert not set(zip(again.slots, again.epochs, strict=True)) & set(zip(spec.slots, spec.epochs, strict=True))
    a.check_integrity()


def test_an_epoch_of_zero_in_a_ready_slot_is_refused(node_path: Path) -> None:
    a = index_in(node_path, 2)
    blocks = keys(1)
    spec = store(a, blocks)
    put(a, slot_field(a, spec.slots[0], "epoch"), "<Q", 0)  # requests retried the same hit forever, before
    assert a.lookup(blocks).hits == 0
    assert set(a.prepare_load(blocks).epochs) == {0}


def test_junk_attachment_entries_are_reclaimed(node_path: Path) -> None:
    segment = segment_in(node_path, 4)
    for entry in range(_nodeindex.MAX_ATTACH):  # "64 engines already share this node pool" with none running
        struct.pack_into("<QQQ", segment, LAYOUT["att"] + 24 * entry, 1000 + entry, 7, 7)
    engine = NodeIndex(segment, locks_in(node_path))
    assert engine.attachment >= 0 and engine.detached is None
    assert engine.pool_counters()["attached"] == 1


@pytest.mark.parametrize("where", ["magic", "geometry"])
def test_a_damaged_header_makes_the_engine_leave_the_pool_without_an_exception(node_path: Path, where: str) -> None:
    a = index_in(node_path, 4)
    blocks = keys(2)
    store(a, blocks)
    if where == "magic":
        put(a, 0, "<Q", 0x1234)  # raised ValueError out of the engine step, before
    else:
        put(a, 48, "<Q", 3)  # the table's length: not a power of two
    assert a.lookup(blocks).hits == 0 and a.detached is not None
    assert a.prepare_store(keys(1)) is None
    load = a.prepare_load(blocks)
    assert set(load.epochs) == {0}  # the worker fails it: a recompute
    a.complete_load(blocks, success=False)
    a.check_integrity()  # not judged: left
    assert a.pool_counters()["capacity"] == 0
    a.close()


def hold_the_lock(node_path: Path) -> int:
    """Another engine's descriptor holding the index's lock (the byte after the attachments'), as one frozen in
    the middle of a change does: a frozen holder of the old mutex stalled every engine's step."""
    fd = os.open(namespace_directory(NodeTierConfig(node_path), Namespace(model="m", dtype="bf16",
                                                                          layout="node-index")) / "engines", os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET,
                                                   _nodeindex.MAX_ATTACH, 1, 0))
    return fd


def test_an_engine_frozen_holding_the_lock_costs_hits_not_steps(node_path: Path) -> None:
    _nodeindex.set_wait_ms(20)
    try:
        a = index_in(node_path, 4)
        blocks = keys(2)
        store(a, blocks)
        frozen = hold_the_lock(node_path)
        assert a.lookup(blocks).hits == 2  # lookups read without the lock
        assert a.prepare_store(keys(2)) is None  # skipped
        load = a.prepare_load(blocks)
        assert set(load.epochs) == {0}  # not pinned: the worker fails it, a recompute
        a.complete_load(blocks)
        assert a.pool_counters()["busy"] >= 2
        os.close(frozen)  # the holder thaws (or dies): the next operations go through
        assert a.prepare_store(keys(1)) is not None
        a.check_integrity()
    finally:
        _nodeindex.set_wait_ms(_nodeindex.WAIT_MS)


def test_a_holder_killed_mid_change_is_repaired_by_the_next(node_path: Path) -> None:
    a = index_in(node_path, 4)
    store(a, keys(2))
    put(a, LAYOUT["seq"], "<Q", 7)  # odd: a writer died between its two bumps
    a.lookup(keys(1))  # no lock-free answer while odd: asks under the lock, which repairs first
    assert a.pool_counters()["repairs"] >= 1
    a.check_integrity()


def test_random_words_in_the_header_counters_never_raise_out_of_a_step(node_path: Path) -> None:
    rng = random.Random(3)
    for seed in range(8):
        a = index_in(node_path, 4, layout=f"damage-header-{seed}")
        blocks = keys(2)
        store(a, blocks)
        for _ in range(6):
            put(a, rng.randrange(LAYOUT["seq"], LAYOUT["att"] + 24 * _nodeindex.MAX_ATTACH, 8), "<Q",
                rng.getrandbits(64))
        tick(a)
        a.lookup(blocks)
        a.prepare_store(keys(1))
        a.complete_load(keys(1))
        a.pool_counters()
        a.check_integrity()
        a.close()


def test_random_bytes_anywhere_past_the_header_are_repaired(node_path: Path) -> None:
    """Slots and table overwritten at random: the engine goes on, and every hit it pins verifies or is refused."""
    rng = random.Random(5)
    a = index_in(node_path, 16)
    blocks = keys(12)
    store(a, blocks)
    start, end = _nodeindex.HEADER_BYTES, len(a._segment)
    for _ in range(40):
        at = rng.randrange(start, end - 8)
        a._segment[at:at + 8] = os.urandom(8)
    hits = a.lookup(blocks).hits
    tick(a)
    a.check_integrity()
    hits = a.lookup(blocks).hits
    load = a.prepare_load(blocks[:hits])
    assert _nodeindex.verify(a._segment, load.slots, load.epochs)
    a.complete_load(blocks[:hits])
    a.prepare_store(keys(8))  # room or not (damaged slots sit out a quarantine): no exception
    a.check_integrity()


# ---- the tenant table, the slots' tenant bytes and the counts: fairness only, repaired from the slots ----------

TENANTS = TenantConfig(TenantBy.CACHE_SALT, 0.5, (("acme", 0.5),))


def tenant_engine(node_path: Path) -> tuple[NodeIndex, list[OffloadKey], HostBlocks]:
    """An engine with tenants, and acme's 3 blocks stored in a pool of 8."""
    a = NodeIndex(segment_in(node_path, 8), locks_in(node_path), tenants=TENANTS)
    blocks = keys(3)
    assert a.tenant_book is not None
    a.tenant_book.assign(blocks, "acme")
    spec = store(a, blocks)
    a.tenant_book.clear()
    return a, blocks, spec


def tenant_field(position: int, field: str) -> int:
    return LAYOUT["tenant"] + position * _nodeindex.TENANT_BYTES + LAYOUT[f"tenant_{field}"]


def served_right(a: NodeIndex, blocks: list[OffloadKey], spec: HostBlocks) -> None:
    """Every block still hits, at the slots and epochs it was stored at (damage to tenants never moves a block)."""
    assert a.lookup(blocks).hits == len(blocks)
    load = a.prepare_load(blocks)
    assert (load.slots, load.epochs) == (spec.slots, spec.epochs)
    assert _nodeindex.verify(a._segment, load.slots, load.epochs)
    a.complete_load(blocks)


@pytest.mark.parametrize(("damage", "problem"), [
    ("share", "tenant table is damaged"),
    ("name", "tenant table is damaged"),
    ("on", "tenant table is damaged"),
    ("resident", "tenant 0 holds 3 slots, its count says"),
    ("slot_tenant", "tenant 200 is not in the tenant table"),
    ("slot_tenant_unused", "tenant 5 is not in the tenant table"),
])
def test_damaged_tenant_fields_are_found_and_repaired_without_losing_a_block(node_path: Path, damage: str,
                                                                            problem: str) -> None:
    a, blocks, spec = tenant_engine(node_path)
    if damage == "share":
        put(a, tenant_field(0, "share"), "<I", 3_000_000)  # three times the pool
    elif damage == "name":
        a._segment[tenant_field(0, "name"):tenant_field(0, "name") + 8] = b"\x00garbage"
    elif damage == "on":
        put(a, LAYOUT["tenants_on"], "<Q", 1 << 50)
    elif damage == "resident":
        put(a, tenant_field(0, "resident"), "<Q", 1 << 60)
    else:
        a._segment[slot_field(a, spec.slots[0], "tenant")] = 200 if damage == "slot_tenant" else 5
    with pytest.raises(IntegrityError, match=problem):
        a.check_integrity()
    served_right(a, blocks, spec)  # before the repair too
    tick(a)  # repaired: a damaged table reset (and written back), counts recounted, bad bytes to "other"
    a.check_integrity()
    served_right(a, blocks, spec)
    counts = a.tenant_counts()
    assert set(counts) == {"acme", "other"}
    assert counts["acme"]["resident"] + counts["other"]["resident"] == 3
    assert a.prepare_store(keys(5)) is not None  # the free slots: no exception (a sixth would need acme's: refused)
    a.check_integrity()


def test_random_words_in_the_tenant_table_never_raise_out_of_a_step(node_path: Path) -> None:
    rng = random.Random(7)
    table = LAYOUT["tenant"], LAYOUT["tenant"] + _nodeindex.MAX_TENANTS * _nodeindex.TENANT_BYTES
    for seed in range(6):
        a = NodeIndex(segment_in(node_path, 8, layout=f"damage-tenants-{seed}"),
                      locks_in(node_path, layout=f"damage-tenants-{seed}"), tenants=TENANTS)
        blocks = keys(3)
        spec = store(a, blocks)
        for _ in range(6):
            put(a, rng.randrange(table[0], table[1] - 8, 8), "<Q", rng.getrandbits(64))
        served_right(a, blocks, spec)
        a.prepare_store(keys(2))
        a.tenant_counts()
        tick(a)
        a.check_integrity()
        a.close()


# ---- retention deadlines and their count: fairness only, bounded, repaired from the slots -----------------------

@pytest.fixture
def monotonic_shift() -> Iterator[None]:
    """The index's deadline clock back to CLOCK_MONOTONIC after a test that moved it."""
    _nodeindex.shift_clock(0)
    yield
    _nodeindex.shift_clock(0)


def deadline_of(index: NodeIndex, slot: int) -> int:
    return int(struct.unpack_from("<Q", index._segment, slot_field(index, slot, "deadline"))[0])


@pytest.mark.parametrize(("damage", "problem"), [
    ("forever", "1 slots have deadlines, the count says 0"),
    ("free_slot", "free slot 7 has a deadline"),
    ("count", "0 slots have deadlines, the count says 1152921504606846976"),
])
def test_damaged_deadlines_are_found_and_repaired_without_losing_a_block(node_path: Path, damage: str,
                                                                         problem: str) -> None:
    a = index_in(node_path, 8)
    blocks = keys(3)
    spec = store(a, blocks)
    if damage == "forever":
        put(a, slot_field(a, spec.slots[0], "deadline"), "<Q", (1 << 64) - 1)
    elif damage == "free_slot":
        put(a, slot_field(a, 7, "deadline"), "<Q", 12345)
    else:
        put(a, LAYOUT["retained"], "<Q", 1 << 60)
    with pytest.raises(IntegrityError, match=problem):
        a.check_integrity()
    tick(a)  # recounted; a free slot's deadline cleared
    a.check_integrity()
    load = a.prepare_load(blocks)
    assert _nodeindex.verify(a._segment, load.slots, load.epochs)
    a.complete_load(blocks)
    for _ in range(12):  # the sweep is never stuck: every store finds room
        store(a, keys(2))
        a.check_integrity()


def test_a_deadline_written_far_in_the_future_holds_a_block_a_day_at_most(node_path: Path,
                                                                          monotonic_shift: None) -> None:
    """Garbage in a deadline costs fairness for at most ``MAX_RETAIN_MS`` (the sweep clamps it), never a store."""
    a = index_in(node_path, 4)
    blocks = keys(1)
    spec = store(a, blocks)
    put(a, slot_field(a, spec.slots[0], "deadline"), "<Q", (1 << 64) - 1)
    tick(a)  # the count recounted: the pool holds a retained slot now
    for _ in range(8):
        store(a, keys(1))
    assert a.lookup(blocks).hits == 1  # retained: the cost is fairness
    assert deadline_of(a, spec.slots[0]) <= time.monotonic_ns() // 1_000_000 + _nodeindex.MAX_RETAIN_MS
    _nodeindex.shift_clock(_nodeindex.MAX_RETAIN_MS + 1000)
    for _ in range(8):
        store(a, keys(1))
    assert a.lookup(blocks).hits == 0  # the clamped deadline passed: an ordinary block again
    a.check_integrity()


def test_random_deadlines_never_raise_out_of_a_step_nor_refuse_a_store(node_path: Path) -> None:
    rng = random.Random(11)
    for seed in range(6):
        a = index_in(node_path, 8, layout=f"damage-deadlines-{seed}")
        blocks = keys(4)
        spec = store(a, blocks)
        for _ in range(6):
            put(a, slot_field(a, rng.randrange(8), "deadline"), "<Q", rng.getrandbits(64))
        put(a, LAYOUT["retained"], "<Q", rng.getrandbits(64))
        served_right(a, blocks, spec)
        for _ in range(6):
            store(a, keys(1))  # retained slots go last, but they go
        tick(a)
        a.check_integrity()
        a.close()
