"""Where the disk tier's files live: one directory per rank, or one for all ranks of a replicated namespace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvoffload.keys import Namespace
from kvoffload.tiers.disk.paths import rank_directories, rank_directory

NS = Namespace(model="m", dtype="bf16", layout="pages=64", world_size=2)


def test_each_rank_of_a_per_rank_namespace_has_its_own_directory(tmp_path: Path) -> None:
    dirs = rank_directories(tmp_path, NS)
    assert [d.name for d in dirs] == ["rank0", "rank1"]
    assert [rank_directory(tmp_path, dataclasses.replace(NS, rank=r)) for r in range(2)] == dirs
    assert len({d.parent for d in dirs}) == 1


def test_every_rank_of_a_replicated_namespace_uses_one_directory(tmp_path: Path) -> None:
    ns = dataclasses.replace(NS, replicated=True)
    (only,) = rank_directories(tmp_path, ns)
    assert only.name == "replicated"
    assert {rank_directory(tmp_path, dataclasses.replace(ns, rank=r)) for r in range(2)} == {only}
    # one world for every TP size: an engine at TP=1 and one at TP=2 share the files
    assert rank_directories(tmp_path, dataclasses.replace(ns, world_size=1)) == [only]
    assert only.parent != rank_directories(tmp_path, NS)[0].parent  # never mixed with per-rank files
