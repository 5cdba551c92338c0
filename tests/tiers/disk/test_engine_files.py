"""The scheduler's side of the slot files (``tiers.disk.engine_files``): an engine number held for life (distinct
while held, the same one back after a restart), this engine's file in every rank directory (kept with its entries
when it has this engine's layout, else started afresh, never anything but a regular file), the other engines'
files trimmed only by name, and entries emptied on a reset."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.config import ConfigError, DiskTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.disk import engine_files
from kvoffload.tiers.disk.engine_files import (
    EngineNumber,
    clear_entries,
    prepare_engine,
    prepare_files,
    trim_leftovers,
)
from kvoffload.tiers.disk.file_io import NotABlockFileError
from kvoffload.tiers.disk.paths import rank_directories, slot_file_path
from kvoffload.tiers.disk.slot_file import (
    EMPTY_ENTRY,
    ENTRY_BYTES,
    PAGE,
    Layout,
    decode_file_header,
    encode_entry,
    encode_file_header,
)
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.tiers.lower.trust import Access

LAYOUT = Layout(112, 300)
PRIVATE = Access()
NS = Namespace(model="m", dtype="bf16", layout="pages=64", world_size=2)


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [offload_key(bytes([salt, i]) * 8, 0) for i in range(n)]  # type: ignore[arg-type]


@pytest.fixture
def ranks(tmp_path: Path) -> list[Path]:
    """Two rank directories, rank 0's first."""
    out = [tmp_path / "rank0", tmp_path / "rank1"]
    for directory in out:
        directory.mkdir()
    return out


@pytest.fixture
def numbers(tmp_path: Path) -> Iterator[list[EngineNumber]]:
    """Engine numbers a test takes on ``tmp_path``; released at its end."""
    held: list[EngineNumber] = []
    yield held
    for number in held:
        number.close()


def path(directory: Path, engine: int = 0) -> Path:
    return Path(slot_file_path(directory, engine))


def put_entries(file: Path, placed: dict[int, OffloadKey], layout: Layout = LAYOUT) -> None:
    """Table entries as a worker's store leaves them (the blocks themselves do not matter here)."""
    with open(file, "r+b") as f:
        for slot, key in placed.items():
            f.seek(layout.entry_offset(slot))
            f.write(encode_entry(key, slot))


def table(file: Path, layout: Layout = LAYOUT) -> bytes:
    with open(file, "rb") as f:
        f.seek(layout.table_offset)
        return f.read(layout.capacity * ENTRY_BYTES)


def is_fresh(file: Path, layout: Layout = LAYOUT) -> bool:
    """``file`` is a new slot file of ``layout``: its header, its size, no entry."""
    raw = file.read_bytes()
    return (len(raw) == layout.file_bytes and decode_file_header(raw[:PAGE]) == layout
            and table(file, layout) == bytes(layout.capacity * ENTRY_BYTES))


# ---- engine numbers ---------------------------------------------------------------------------------------------

def test_engine_numbers_are_distinct_while_held_and_the_lowest_free_one_comes_back_after_close(
        tmp_path: Path, numbers: list[EngineNumber]) -> None:
    numbers += [EngineNumber(tmp_path, PRIVATE) for _ in range(3)]
    assert [n.engine for n in numbers] == [0, 1, 2]
    numbers[1].close()
    numbers.append(EngineNumber(tmp_path, PRIVATE))  # a restarted engine
    assert numbers[-1].engine == 1
    numbers.append(EngineNumber(tmp_path, PRIVATE))
    assert numbers[-1].engine == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"engine-{n}.lock" for n in range(4)]


def test_the_number_locks_have_the_access_mode_whatever_the_umask(
        tmp_path: Path, numbers: list[EngineNumber]) -> None:
    old = os.umask(0o022)
    try:
        numbers += [EngineNumber(tmp_path, PRIVATE), EngineNumber(tmp_path, Access(gid=os.getegid()))]
    finally:
        os.umask(old)
    modes = [stat.S_IMODE((tmp_path / f"engine-{n}.lock").stat().st_mode) for n in (0, 1)]
    assert modes == [0o600, 0o660]


def test_an_engine_number_is_held_against_another_process(tmp_path: Path, numbers: list[EngineNumber]) -> None:
    numbers.append(EngineNumber(tmp_path, PRIVATE))
    code = ("import sys; from pathlib import Path; from kvoffload.tiers.disk.engine_files import EngineNumber; "
            "from kvoffload.tiers.lower.trust import Access; "
            "print(EngineNumber(Path(sys.argv[1]), Access()).engine)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                         env={**os.environ})
    assert out.stdout.strip() == "1"


def test_when_every_engine_number_is_taken_another_engine_is_an_os_error(
        tmp_path: Path, numbers: list[EngineNumber], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_files, "MAX_ENGINES", 2)
    numbers += [EngineNumber(tmp_path, PRIVATE), EngineNumber(tmp_path, PRIVATE)]
    with pytest.raises(OSError, match="2 engines already run"):
        EngineNumber(tmp_path, PRIVATE)
    numbers[0].close()
    numbers.append(EngineNumber(tmp_path, PRIVATE))
    assert numbers[-1].engine == 0


# ---- prepare_files ----------------------------------------------------------------------------------------------

def test_new_files_are_made_in_every_rank_directory_with_the_layout_and_the_access_mode(
        ranks: list[Path]) -> None:
    old = os.umask(0o077)  # the umask would cut a shared tier's group bits
    try:
        found = prepare_files(ranks, 2, LAYOUT, PRIVATE)
        assert found.placed == ()
        assert all(is_fresh(path(d, 2)) for d in ranks)
        assert {stat.S_IMODE(path(d, 2).stat().st_mode) for d in ranks} == {0o600}
        assert sorted(p.name for p in ranks[0].iterdir()) == ["engine-2.kvs"]
        prepare_files(ranks, 3, LAYOUT, Access(gid=os.getegid()))
        assert {stat.S_IMODE(path(d, 3).stat().st_mode) for d in ranks} == {0o660}
    finally:
        os.umask(old)


def test_a_file_of_this_layout_is_kept_and_rank_0s_valid_entries_are_returned(ranks: list[Path]) -> None:
    prepare_files(ranks, 0, LAYOUT, PRIVATE)
    ks = keys(5)
    put_entries(path(ranks[0]), {0: ks[0], 7: ks[1], 299: ks[2], 8: ks[3]})
    with open(path(ranks[0]), "r+b") as f:  # slot 8's entry damaged
        f.seek(LAYOUT.entry_offset(8) + 3)
        f.write(b"\xff")
    put_entries(path(ranks[1]), {1: ks[4]})  # only rank 0's table is the index's
    before = [path(d).read_bytes() for d in ranks]
    found = prepare_files(ranks, 0, LAYOUT, PRIVATE)
    assert found.placed == ((0, ks[0]), (7, ks[1]), (299, ks[2]))
    assert [path(d).read_bytes() for d in ranks] == before  # nothing written, not even the header


@pytest.mark.parametrize("other", [Layout(112, 299), Layout(113, 300), Layout(112, 1000)],
                         ids=["fewer-slots", "other-stride", "more-slots"])
def test_a_file_of_another_layout_is_started_afresh_and_none_of_its_entries_is_returned(
        ranks: list[Path], other: Layout, caplog: pytest.LogCaptureFixture) -> None:
    prepare_files(ranks, 0, other, PRIVATE)
    put_entries(path(ranks[0]), {slot: key for slot, key in enumerate(keys(10))}, other)
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        found = prepare_files(ranks, 0, LAYOUT, PRIVATE)
    assert found.placed == ()
    assert all(is_fresh(path(d)) for d in ranks)
    assert [r.levelno for r in caplog.records if "afresh" in r.getMessage()] == [logging.INFO] * 2


@pytest.mark.parametrize("size", [PAGE, LAYOUT.file_bytes - 1, LAYOUT.file_bytes + 1, 2 * LAYOUT.file_bytes])
def test_a_file_of_this_header_but_another_size_is_started_afresh(ranks: list[Path], size: int) -> None:
    prepare_files(ranks, 0, LAYOUT, PRIVATE)
    put_entries(path(ranks[0]), {3: keys(1)[0]})
    os.truncate(path(ranks[0]), size)  # cut short (or grown) by someone: its slots are not what they were
    assert prepare_files(ranks, 0, LAYOUT, PRIVATE).placed == ()
    assert is_fresh(path(ranks[0]))


@pytest.mark.parametrize("garbage", [b"x" * 10, b"\xff" * PAGE, encode_file_header(LAYOUT)[:40]],
                         ids=["short", "noise", "cut-header"])
def test_a_file_whose_header_is_garbage_is_started_afresh_with_a_warning_naming_its_directory(
        ranks: list[Path], garbage: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path(ranks[0]).write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert prepare_files(ranks, 0, LAYOUT, PRIVATE).placed == ()
    assert is_fresh(path(ranks[0])) and is_fresh(path(ranks[1]))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(ranks[0]) in warning and "afresh" in warning


def test_an_empty_file_is_given_its_header_without_a_warning(
        ranks: list[Path], caplog: pytest.LogCaptureFixture) -> None:
    path(ranks[0]).write_bytes(b"")  # a crash between creating the file and sizing it
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        prepare_files(ranks, 0, LAYOUT, PRIVATE)
    assert is_fresh(path(ranks[0])) and caplog.records == []


def test_a_symbolic_link_at_the_file_path_is_refused_and_what_it_points_at_is_left_alone(
        ranks: list[Path], tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's")
    path(ranks[1]).symlink_to(victim)
    with pytest.raises(NotABlockFileError, match="symbolic link"):
        prepare_files(ranks, 0, LAYOUT, PRIVATE)
    assert victim.read_bytes() == b"someone else's" and path(ranks[1]).is_symlink()


def test_a_fifo_at_the_file_path_is_refused_without_waiting_for_a_writer(ranks: list[Path]) -> None:
    os.mkfifo(path(ranks[0]))
    with pytest.raises(NotABlockFileError, match="not a regular file"):
        prepare_files(ranks, 0, LAYOUT, PRIVATE)
    assert stat.S_ISFIFO(path(ranks[0]).lstat().st_mode)


# ---- trim_leftovers and clear_entries ---------------------------------------------------------------------------

def test_trim_deletes_only_the_other_engines_canonical_files_in_every_rank_directory(
        ranks: list[Path], tmp_path: Path) -> None:
    for engine in (0, 1, 5):
        prepare_files(ranks, engine, LAYOUT, PRIVATE)
    kept = ["engine-0.kvs", "engine-01.kvs", "engine-1.kvs.tmp", f"engine-{256}.kvs", "notes.txt", "ab"]
    for directory in ranks:
        for name in kept[1:-1]:
            (directory / name).write_bytes(b"not a leftover")
        (directory / "ab").mkdir()  # an old-format fan-out
        (directory / "ab" / "engine-2.kvs").write_bytes(b"")
    target = tmp_path / "target"
    target.write_bytes(b"what a link points at")
    (ranks[0] / "engine-7.kvs").symlink_to(target)
    assert trim_leftovers([*ranks, tmp_path / "gone"], 0) == 5  # 1 and 5 in both, the link
    for directory in ranks:
        assert sorted(p.name for p in directory.iterdir()) == sorted(kept)
        assert (directory / "ab" / "engine-2.kvs").exists()
    assert target.read_bytes() == b"what a link points at"
    assert trim_leftovers(ranks, 0) == 0


def test_clear_entries_empties_the_named_slots_only_in_every_file_it_is_given(ranks: list[Path]) -> None:
    prepare_files(ranks, 0, LAYOUT, PRIVATE)
    ks = keys(3)
    for directory in ranks:
        put_entries(path(directory), {0: ks[0], 1: ks[1], 2: ks[2]})
    for directory in ranks:
        clear_entries(directory, 0, LAYOUT, [0, 2])
    for directory in ranks:
        raw = table(path(directory))
        assert raw[:3 * ENTRY_BYTES] == EMPTY_ENTRY + encode_entry(ks[1], 1) + EMPTY_ENTRY
    assert prepare_files(ranks, 0, LAYOUT, PRIVATE).placed == ((1, ks[1]),)


# ---- prepare_engine ---------------------------------------------------------------------------------------------

def test_prepare_engine_makes_the_files_a_handler_needs_in_every_rank_directory(tmp_path: Path) -> None:
    config = DiskTierConfig(path=tmp_path / "disk", capacity_bytes=Layout(1064, 20).file_bytes)
    layout = prepare_engine(config, NS, 1064, engine=3)
    assert layout == Layout(1064, 20)
    for directory in rank_directories(config.path, NS, PLAIN):
        assert is_fresh(path(directory, 3), layout)


def test_prepare_engine_below_one_slot_is_a_config_error_naming_disk_bytes(tmp_path: Path) -> None:
    config = DiskTierConfig(path=tmp_path / "disk", capacity_bytes=Layout(1064, 1).file_bytes - 1)
    with pytest.raises(ConfigError, match="disk_bytes"):
        prepare_engine(config, NS, 1064)
    assert not (tmp_path / "disk").exists()
