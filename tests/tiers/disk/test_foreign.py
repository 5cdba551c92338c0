"""ForeignTables: the other engines' blocks in a rank directory, read from their slot files' tables on a thread of
its own. It finds every other engine's valid entries and never this engine's; sealed names map back to keys; a
damaged entry, header or file is skipped, never misread; only the table chunks that changed are parsed again (a
replaced file is read afresh); a forgotten location stays hidden; a poke wakes the thread, and close stops it."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.auth import TierSecret
from kvoffload.keys import OffloadKey, offload_key
from kvoffload.testing.router_indexer import wait_for
from kvoffload.tiers.disk import foreign as foreign_module
from kvoffload.tiers.disk.engine_files import prepare_files
from kvoffload.tiers.disk.foreign import CHUNK, ForeignTables
from kvoffload.tiers.disk.paths import slot_file_path
from kvoffload.tiers.disk.slot_file import EMPTY_ENTRY, ENTRY_BYTES, Layout, encode_entry, location
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat
from kvoffload.tiers.lower.trust import Access

LAYOUT = Layout(112, 4 * CHUNK // ENTRY_BYTES)
"""Four chunks of entries."""
CHUNK_SLOTS = CHUNK // ENTRY_BYTES
SEALED = BlockFormat.of(TierSecret("test", b"k" * 32))
LONG = 3600.0
"""An interval no test waits for: the thread reads once at start, then only when poked."""


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i]) * 8, 0) for i in range(n)]  # type: ignore[arg-type]


def file_of(rank_dir: Path, engine: int) -> Path:
    return Path(slot_file_path(rank_dir, engine))


def make_file(rank_dir: Path, engine: int, layout: Layout = LAYOUT) -> Path:
    prepare_files([rank_dir], engine, layout, Access())
    return file_of(rank_dir, engine)


def put(rank_dir: Path, engine: int, placed: dict[int, OffloadKey], fmt: BlockFormat = PLAIN,
        layout: Layout = LAYOUT) -> None:
    """Entries as engine ``engine``'s stores leave them (``write_run``: the name, bound to its slot)."""
    with open(file_of(rank_dir, engine), "r+b") as f:
        for slot, key in placed.items():
            f.seek(layout.entry_offset(slot))
            f.write(encode_entry(bytes.fromhex(fmt.name(key)), slot))


def poke_bytes(file: Path, offset: int, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def rank_dir(tmp_path: Path) -> Path:
    """Rank 0's directory with three engines' slot files (0 is this engine's)."""
    for engine in (0, 1, 2):
        make_file(tmp_path, engine)
    return tmp_path


@pytest.fixture
def opened() -> Iterator[Callable[..., ForeignTables]]:
    """Open ``ForeignTables`` whose thread has done its first read (then sleeps ``LONG`` unless poked), so a test's
    ``refresh`` never runs beside it; closed at the test's end."""
    made: list[ForeignTables] = []

    def open_tables(rank_dir: Path, own: int = 0, fmt: BlockFormat = PLAIN, interval_s: float = LONG
                    ) -> ForeignTables:
        tables = ForeignTables(rank_dir, own, fmt, interval_s)
        made.append(tables)
        assert wait_for(lambda: tables.reads >= 1, 5.0)
        return tables

    yield open_tables
    for tables in made:
        tables.close()


def test_other_engines_keys_are_found_at_their_locations_and_this_engines_never(
        rank_dir: Path, opened: Callable[..., ForeignTables]) -> None:
    mine, first, second = keys(3)
    put(rank_dir, 0, {0: mine})
    put(rank_dir, 1, {5: first})
    put(rank_dir, 2, {LAYOUT.capacity - 1: second})
    tables = opened(rank_dir, own=0)
    assert tables.find(mine) is None
    assert tables.find(first) == location(1, 5)
    assert tables.find(second) == location(2, LAYOUT.capacity - 1)
    assert tables.find(keys(1, salt=9)[0]) is None
    other = opened(rank_dir, own=1)  # engine 1's view: engine 0's blocks are foreign to it
    assert other.find(mine) == location(0, 0) and other.find(first) is None


def test_files_that_are_not_canonical_regular_slot_files_are_never_read(
        rank_dir: Path, tmp_path: Path, opened: Callable[..., ForeignTables]) -> None:
    ks = keys(4)
    put(rank_dir, 1, {0: ks[0]})
    for engine, name in ((3, "engine-03.kvs"), (4, "engine-4.kvs.tmp"), (5, "engine-300.kvs")):
        make_file(rank_dir, engine)
        put(rank_dir, engine, {0: ks[1]})
        file_of(rank_dir, engine).rename(rank_dir / name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_file(elsewhere, 6)
    put(elsewhere, 6, {0: ks[2]})
    file_of(rank_dir, 6).symlink_to(file_of(elsewhere, 6))  # a link at a canonical name
    os.mkfifo(file_of(rank_dir, 7))
    tables = opened(rank_dir)
    assert tables.find(ks[0]) == location(1, 0)
    assert tables.find(ks[1]) is None and tables.find(ks[2]) is None


def test_sealed_names_map_back_to_their_keys(rank_dir: Path, opened: Callable[..., ForeignTables]) -> None:
    ks = keys(2)
    put(rank_dir, 1, {0: ks[0], 1: ks[1]}, SEALED)
    names = [OffloadKey(bytes.fromhex(SEALED.name(k))) for k in ks]
    assert names[0] != ks[0]  # the table does not give the prompt's keys away
    tables = opened(rank_dir, fmt=SEALED)
    assert [tables.find(k) for k in ks] == [location(1, 0), location(1, 1)]
    assert tables.find(names[0]) is None
    plain = opened(rank_dir, fmt=PLAIN)  # read without the secret, the names are no keys of the prompt
    assert plain.find(ks[0]) is None


def test_a_damaged_or_moved_entry_is_skipped_and_the_rest_of_the_table_is_read(
        rank_dir: Path, opened: Callable[..., ForeignTables]) -> None:
    ks = keys(4)
    put(rank_dir, 1, {0: ks[0], 1: ks[1], 2: ks[2]})
    poke_bytes(file_of(rank_dir, 1), LAYOUT.entry_offset(1) + 20, b"\x01")  # its slot number changed
    poke_bytes(file_of(rank_dir, 1), LAYOUT.entry_offset(3), encode_entry(ks[3], 2))  # slot 2's entry, at 3
    tables = opened(rank_dir)
    assert [tables.find(k) for k in ks] == [location(1, 0), None, location(1, 2), None]


def test_a_file_whose_header_is_damaged_is_skipped_and_the_others_are_read(
        rank_dir: Path, opened: Callable[..., ForeignTables]) -> None:
    ks = keys(2)
    put(rank_dir, 1, {0: ks[0]})
    put(rank_dir, 2, {0: ks[1]})
    tables = opened(rank_dir)
    assert tables.find(ks[0]) == location(1, 0)
    poke_bytes(file_of(rank_dir, 1), 20, b"\xff")  # in its capacity: the header's crc fails
    tables.refresh()
    assert tables.find(ks[0]) is None and tables.find(ks[1]) == location(2, 0)
    file_of(rank_dir, 2).write_bytes(b"cut")
    file_of(rank_dir, 1).unlink()
    tables.refresh()
    assert tables.find(ks[1]) is None


def test_a_changed_entry_is_read_again_and_only_its_chunk_is_parsed(
        rank_dir: Path, opened: Callable[..., ForeignTables], monkeypatch: pytest.MonkeyPatch) -> None:
    ks = keys(4)
    put(rank_dir, 1, {0: ks[0], CHUNK_SLOTS + 1: ks[1], 3 * CHUNK_SLOTS: ks[2]})
    tables = opened(rank_dir)
    parsed: list[tuple[int, int]] = []  # (first slot, entries) of every chunk parsed
    real = foreign_module.table_names

    def counting(table: bytes, first_slot: int = 0) -> list[tuple[int, bytes]]:
        parsed.append((first_slot, len(table) // ENTRY_BYTES))
        return real(table, first_slot)

    monkeypatch.setattr(foreign_module, "table_names", counting)
    tables.refresh()
    assert parsed == []  # nothing changed: compared, not parsed
    put(rank_dir, 1, {CHUNK_SLOTS + 1: ks[3]})  # engine 1 reused the slot for another block
    tables.refresh()
    assert parsed == [(CHUNK_SLOTS, CHUNK_SLOTS)]
    assert tables.find(ks[1]) is None and tables.find(ks[3]) == location(1, CHUNK_SLOTS + 1)
    assert tables.find(ks[0]) == location(1, 0) and tables.find(ks[2]) == location(1, 3 * CHUNK_SLOTS)
    poke_bytes(file_of(rank_dir, 1), LAYOUT.entry_offset(0), EMPTY_ENTRY)  # a reset emptied one
    parsed.clear()
    tables.refresh()
    assert parsed == [(0, CHUNK_SLOTS)] and tables.find(ks[0]) is None
    assert tables.find(ks[2]) == location(1, 3 * CHUNK_SLOTS)


def test_a_replaced_file_is_read_afresh(rank_dir: Path, tmp_path: Path, opened: Callable[..., ForeignTables],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ks = keys(3)
    put(rank_dir, 1, {0: ks[0], 3 * CHUNK_SLOTS + 5: ks[1]})
    tables = opened(rank_dir)
    parsed: list[int] = []
    real = foreign_module.table_names

    def counting(table: bytes, first_slot: int = 0) -> list[tuple[int, bytes]]:
        parsed.append(first_slot)
        return real(table, first_slot)

    monkeypatch.setattr(foreign_module, "table_names", counting)
    # engine 1 restarted with the same layout: a new file (a new inode) with the same table
    copy = tmp_path / "copy.kvs"
    copy.write_bytes(file_of(rank_dir, 1).read_bytes())
    copy.replace(file_of(rank_dir, 1))
    tables.refresh()
    assert parsed == [0, CHUNK_SLOTS, 2 * CHUNK_SLOTS, 3 * CHUNK_SLOTS]  # every chunk, not only changed ones
    assert tables.find(ks[1]) == location(1, 3 * CHUNK_SLOTS + 5)
    # restarted again with a smaller budget: the slots beyond its table are gone with the old file
    file_of(rank_dir, 1).unlink()
    small = Layout(LAYOUT.stride, CHUNK_SLOTS)
    make_file(rank_dir, 1, small)
    put(rank_dir, 1, {0: ks[2]}, layout=small)
    tables.refresh()
    assert tables.find(ks[1]) is None and tables.find(ks[0]) is None
    assert tables.find(ks[2]) == location(1, 0)


def test_a_forgotten_location_stays_hidden_and_the_key_is_found_at_another(
        rank_dir: Path, opened: Callable[..., ForeignTables]) -> None:
    ks = keys(2)
    put(rank_dir, 1, {4: ks[0], 5: ks[1]})
    tables = opened(rank_dir)
    tables.forget(ks[0], location(1, 5))  # not where it is: nothing changes
    assert tables.find(ks[0]) == location(1, 4)
    tables.forget(ks[0], location(1, 4))
    assert tables.find(ks[0]) is None  # at once, before any read
    tables.refresh()
    assert tables.find(ks[0]) is None and tables.find(ks[1]) == location(1, 5)
    put(rank_dir, 2, {9: ks[0]})  # another engine stored it too
    tables.refresh()
    assert tables.find(ks[0]) == location(2, 9)


def test_the_forgotten_locations_are_a_bounded_memory(
        rank_dir: Path, opened: Callable[..., ForeignTables], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(foreign_module, "FORGOTTEN_MAX", 2)
    (key,) = keys(1)
    put(rank_dir, 1, {0: key})
    tables = opened(rank_dir)
    tables.forget(key, location(1, 0))
    for slot in (1, 2):
        tables.forget(key, location(1, slot))
    tables.refresh()
    assert tables.find(key) == location(1, 0)  # the oldest forgotten pair went


def test_a_poke_wakes_the_thread_and_close_stops_it(
        rank_dir: Path, opened: Callable[..., ForeignTables]) -> None:
    (key,) = keys(1)
    tables = opened(rank_dir)  # reads again in an hour unless poked
    put(rank_dir, 1, {3: key})
    reads = tables.reads
    tables.poke()
    assert wait_for(lambda: tables.reads == reads + 1, 5.0)
    assert tables.find(key) == location(1, 3)
    started = time.monotonic()
    tables.close()
    assert time.monotonic() - started < 2.0 and not tables._thread.is_alive()
    tables.poke()  # a lookup after close: nothing to wake, and what was read is still answered
    assert tables.find(key) == location(1, 3)


def test_the_thread_reads_every_interval_without_a_poke(
        rank_dir: Path, opened: Callable[..., ForeignTables]) -> None:
    (key,) = keys(1)
    tables = opened(rank_dir, interval_s=0.01)
    put(rank_dir, 1, {3: key})
    assert wait_for(lambda: tables.find(key) == location(1, 3), 5.0)


def test_a_failed_read_is_logged_and_the_thread_goes_on(
        rank_dir: Path, opened: Callable[..., ForeignTables], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    (key,) = keys(1)
    tables = opened(rank_dir)
    real = tables._engines
    failed = threading.Event()

    def broken() -> list[int]:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("a bug")
        return real()

    monkeypatch.setattr(tables, "_engines", broken)
    put(rank_dir, 1, {3: key})
    with caplog.at_level(logging.ERROR, logger="kvoffload"):
        tables.poke()
        assert wait_for(failed.is_set, 5.0)
        assert wait_for(lambda: any("tables failed" in r.getMessage() for r in caplog.records), 5.0)
        tables.poke()
        assert wait_for(lambda: tables.find(key) == location(1, 3), 5.0)
