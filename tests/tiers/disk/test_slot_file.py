"""The slot file's layout (``tiers.disk.slot_file``): the largest layout a budget holds, a file header that decodes
only when every field checks, table entries bound to their slot, and the (engine, slot) locations specs carry."""

from __future__ import annotations

import struct
import zlib

import pytest

from kvoffload.keys import offload_key
from kvoffload.tiers.disk.slot_file import (
    EMPTY_ENTRY,
    ENTRY_BYTES,
    FILE_MAGIC,
    MAX_CAPACITY,
    MAX_STRIDE,
    PAGE,
    SLOT_FORMAT_VERSION,
    Layout,
    SlotFileError,
    decode_file_header,
    encode_entry,
    encode_file_header,
    entry_name,
    location,
    split_location,
    table_names,
)

NAMES = [bytes([i]) * 16 for i in range(1, 9)]


def header(magic: bytes = FILE_MAGIC, version: int = SLOT_FORMAT_VERSION, header_bytes: int = PAGE,
           stride: int = 112, capacity: int = 10, table: int | None = None, data: int | None = None) -> bytes:
    """A file header written field by field (docs/disk-format.md), its crc right: only what a test changes is
    wrong."""
    if table is None:
        table = PAGE
    if data is None:
        data = -(-(PAGE + capacity * ENTRY_BYTES) // PAGE) * PAGE
    body = struct.pack("<8sHHIQQQ", magic, version, header_bytes, stride, capacity, table, data)
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(PAGE, b"\0")


# ---- Layout -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stride", [1, 112, 1064, 4096, 1 << 20])
def test_for_budget_is_the_largest_layout_whose_file_fits(stride: int) -> None:
    for capacity in (*range(1, 200), 127, 128, 129, 12_345, 1_000_000):
        exact = Layout(stride, capacity).file_bytes
        for budget in (exact - 1, exact, exact + 1):
            layout = Layout.for_budget(budget, stride)
            got = 0 if layout is None else layout.capacity
            assert layout is None or (layout.stride == stride and layout.file_bytes <= budget)
            assert Layout(stride, got + 1).file_bytes > budget, (budget, got)
        assert Layout.for_budget(exact, stride) == Layout(stride, capacity)


def test_a_layout_puts_its_table_after_the_header_and_its_slots_on_a_page_after_the_table() -> None:
    layout = Layout(1064, 200)
    assert layout.table_offset == PAGE and layout.entry_offset(3) == PAGE + 3 * ENTRY_BYTES
    assert layout.data_offset == 3 * PAGE  # 4096 + 6400 bytes, rounded up to a page
    assert layout.slot_offset(0) == 3 * PAGE and layout.slot_offset(5) == 3 * PAGE + 5 * 1064
    assert layout.file_bytes == layout.slot_offset(200)
    assert Layout(1064, 128).data_offset == 2 * PAGE  # a table that fills its page exactly is not padded


def test_for_budget_is_none_below_one_slot() -> None:
    one = Layout(1064, 1).file_bytes
    assert one == 2 * PAGE + 1064
    assert Layout.for_budget(one - 1, 1064) is None
    assert Layout.for_budget(0, 1064) is None and Layout.for_budget(-1, 1064) is None
    assert Layout.for_budget(one, 1064) == Layout(1064, 1)


def test_for_budget_is_capped_at_the_largest_capacity_a_file_states() -> None:
    layout = Layout.for_budget(1 << 62, 1)
    assert layout == Layout(1, MAX_CAPACITY)
    assert Layout.for_budget(1 << 62, MAX_STRIDE) is not None


@pytest.mark.parametrize("stride, capacity", [(0, 1), (-1, 1), (MAX_STRIDE + 1, 1), (1, 0), (1, -1),
                                              (1, MAX_CAPACITY + 1)])
def test_a_layout_out_of_range_is_refused(stride: int, capacity: int) -> None:
    with pytest.raises(SlotFileError, match="out of range"):
        Layout(stride, capacity)


# ---- the file header --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(1064, 200), Layout(MAX_STRIDE, MAX_CAPACITY)])
def test_a_file_header_round_trips_in_one_page(layout: Layout) -> None:
    raw = encode_file_header(layout)
    assert len(raw) == PAGE and raw.startswith(FILE_MAGIC)
    assert decode_file_header(raw) == layout
    assert decode_file_header(memoryview(raw)) == layout


def test_the_test_headers_are_the_format_the_module_writes() -> None:
    assert header(stride=1064, capacity=200) == encode_file_header(Layout(1064, 200))
    assert decode_file_header(header()) == Layout(112, 10)


@pytest.mark.parametrize("raw, problem", [
    (header()[:40], "header is 40 bytes"),
    (b"", "header is 0 bytes"),
    (header(magic=b"KVOFFBLK"), "not a version 3 slot file"),
    (header(version=2), "not a version 3 slot file"),
    (header(version=4), "not a version 3 slot file"),
    (header(header_bytes=512), "not a version 3 slot file"),
    (header(table=2 * PAGE), "offsets do not follow"),
    (header(data=PAGE), "offsets do not follow"),
    (header(capacity=200, data=2 * PAGE), "offsets do not follow"),  # the table would run into the slots
    (header(stride=0), "out of range"),
    (header(stride=MAX_STRIDE + 1), "out of range"),
    (header(capacity=0, data=PAGE), "out of range"),
    (header(capacity=MAX_CAPACITY + 1), "out of range"),
], ids=["short", "empty", "magic", "old-version", "new-version", "header-size", "table-offset", "data-offset",
        "overlap", "stride-0", "stride-big", "capacity-0", "capacity-big"])
def test_a_file_header_is_refused_unless_every_field_checks(raw: bytes, problem: str) -> None:
    with pytest.raises(SlotFileError, match=problem):
        decode_file_header(raw)


def test_a_file_header_with_any_byte_changed_is_refused_by_its_checksum() -> None:
    raw = encode_file_header(Layout(1064, 200))
    for i in range(44):  # the fields and the crc
        damaged = bytearray(raw)
        damaged[i] ^= 0x01
        with pytest.raises(SlotFileError, match="checksum"):
            decode_file_header(bytes(damaged))


# ---- table entries ----------------------------------------------------------------------------------------------

def test_an_entry_round_trips_at_its_slot() -> None:
    raw = encode_entry(NAMES[0], 7)
    assert len(raw) == ENTRY_BYTES and raw != EMPTY_ENTRY
    assert entry_name(raw, 7) == NAMES[0]
    key = offload_key(b"k" * 16, 0)  # type: ignore[arg-type]
    assert entry_name(encode_entry(key, (1 << 40) + 3), (1 << 40) + 3) == key


def test_an_entry_moved_to_another_slot_is_refused() -> None:
    raw = encode_entry(NAMES[0], 7)
    assert entry_name(raw, 8) is None and entry_name(raw, 6) is None and entry_name(raw, 7 + (1 << 32)) is None


def test_an_empty_short_or_damaged_entry_names_nothing() -> None:
    raw = encode_entry(NAMES[0], 7)
    assert entry_name(EMPTY_ENTRY, 0) is None
    assert entry_name(raw[:-1], 7) is None
    for i in range(28):  # the name, the slot and the crc
        damaged = bytearray(raw)
        damaged[i] ^= 0x80
        assert entry_name(bytes(damaged), 7) is None


def test_table_names_lists_the_valid_entries_in_slot_order_and_skips_the_rest() -> None:
    entries = [encode_entry(name, slot) for slot, name in enumerate(NAMES[:6])]
    entries[1] = EMPTY_ENTRY
    damaged = bytearray(entries[2])
    damaged[0] ^= 1
    entries[2] = bytes(damaged)
    entries[3] = encode_entry(NAMES[3], 4)  # slot 4's entry copied into slot 3's place
    table = b"".join(entries)
    assert table_names(table) == [(0, NAMES[0]), (4, NAMES[4]), (5, NAMES[5])]
    assert table_names(memoryview(table)) == table_names(table)
    assert table_names(bytes(ENTRY_BYTES * 4)) == [] and table_names(b"") == []


def test_table_names_of_a_chunk_reads_its_entries_at_their_slots_from_the_first() -> None:
    chunk = b"".join(encode_entry(name, 128 + i) for i, name in enumerate(NAMES[:3]))
    assert table_names(chunk, 128) == [(128 + i, name) for i, name in enumerate(NAMES[:3])]
    assert table_names(chunk) == []  # read as slots 0-2 they are other slots' entries


# ---- locations --------------------------------------------------------------------------------------------------

def test_a_location_names_one_engine_and_slot_and_splits_back() -> None:
    places = {location(engine, slot): (engine, slot)
              for engine in (0, 1, 255) for slot in (0, 1, MAX_CAPACITY - 1)}
    assert len(places) == 9
    for place, pair in places.items():
        assert split_location(place) == pair
    assert location(0, 5) == 5  # engine 0's locations are its slots
