"""Where the disk tier's files live (one directory per rank, or one for all ranks of a replicated namespace) and
their names: ``engine-<n>.kvs`` is the only name of a slot file, and only its canonical spelling below
``MAX_ENGINES`` names an engine (anything else in a directory is never read or trimmed as one)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from kvoffload.keys import Namespace
from kvoffload.tiers.disk.paths import (
    MAX_ENGINES,
    engine_lock_path,
    engine_of,
    rank_directories,
    rank_directory,
    slot_file_path,
    world_directory,
)

NS = Namespace(model="m", dtype="bf16", layout="pages=64", world_size=2)


def test_each_rank_of_a_per_rank_namespace_has_its_own_directory(tmp_path: Path) -> None:
    dirs = rank_directories(tmp_path, NS)
    assert [d.name for d in dirs] == ["rank0", "rank1"]
    assert [rank_directory(tmp_path, dataclasses.replace(NS, rank=r)) for r in range(2)] == dirs
    assert {d.parent for d in dirs} == {world_directory(tmp_path, NS)}


def test_every_rank_of_a_replicated_namespace_uses_one_directory(tmp_path: Path) -> None:
    ns = dataclasses.replace(NS, replicated=True)
    (only,) = rank_directories(tmp_path, ns)
    assert only.name == "replicated"
    assert {rank_directory(tmp_path, dataclasses.replace(ns, rank=r)) for r in range(2)} == {only}
    # one world for every TP size: an engine at TP=1 and one at TP=2 share the files
    assert rank_directories(tmp_path, dataclasses.replace(ns, world_size=1)) == [only]
    assert only.parent != rank_directories(tmp_path, NS)[0].parent  # never mixed with per-rank files


def test_an_engine_slot_file_is_named_by_its_number_and_the_name_gives_the_number_back(tmp_path: Path) -> None:
    rank0 = rank_directory(tmp_path, NS)
    for engine in (0, 1, 9, 10, MAX_ENGINES - 1):
        path = slot_file_path(rank0, engine)
        assert path == os.path.join(rank0, f"engine-{engine}.kvs")
        assert engine_of(os.path.basename(path)) == engine


@pytest.mark.parametrize("name", [
    f"engine-{MAX_ENGINES}.kvs", "engine-999999.kvs", "engine-1000000.kvs",  # beyond the numbers engines take
    "engine-01.kvs", "engine-00.kvs", "engine-+1.kvs", "engine--1.kvs", "engine- 1.kvs", "engine-1_0.kvs",
    "engine-\u0661.kvs",  # an Arabic-Indic one: int() reads it, but no engine writes it
    "engine-.kvs", "engine-1", "engine-1.kvs.tmp", "engine-1.kvs~", ".engine-1.kvs", "Engine-1.kvs",
    "engine-1.KVS", "engine-1.kvb", "engine-1.lock", " engine-1.kvs", "engine-1.kvs\n", "rank0/engine-1.kvs",
    "ab", "00112233445566778899aabbccddeeff.kvb", "",
])
def test_only_the_canonical_name_of_an_engine_below_max_engines_is_a_slot_file(name: str) -> None:
    assert engine_of(name) is None


def test_the_engine_locks_live_in_the_world_directory_under_names_that_are_not_slot_files(tmp_path: Path) -> None:
    world = world_directory(tmp_path, NS)
    lock = engine_lock_path(world, 3)
    assert lock == world / "engine-3.lock"
    assert engine_of(lock.name) is None
    assert all(lock.parent != d for d in rank_directories(tmp_path, NS))
