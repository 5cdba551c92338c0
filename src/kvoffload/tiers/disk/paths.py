"""Where the disk tier's files live, and their names.

Paths: ``<disk_path>/<world>/rank<r>/<name hex[:2]>/<name hex>.kvb``, where ``world`` is the chain root's hex[:16]
and ``name`` the key, or, for an authenticated tier, both are keyed by the secret (``BlockFormat``). A replicated
namespace (every rank holds the same bytes: ``Namespace.replicated``) has one directory, ``<world>/replicated``,
that rank 0 writes and every rank reads. A file is
written under a temporary name in the same directory (``<name hex>.<pid>-<n>.tmp``) and renamed into place, so a
final name never points at a half-written block. ``tree`` creates, checks and scans the directories.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat

BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 600.0
"""A temporary file this old whose writer is gone is a crashed write's leftover (``tree.scan`` removes it)."""


def world_directory(disk_path: Path, namespace: Namespace, fmt: BlockFormat = PLAIN) -> Path:
    """The directory of every rank of this world (named by the chain root, the same on all ranks)."""
    return disk_path / fmt.world_name(namespace.chain_root())


REPLICATED_DIRECTORY = "replicated"


def rank_directory(disk_path: Path, namespace: Namespace, fmt: BlockFormat = PLAIN) -> Path:
    """The directory holding ``namespace.rank``'s files (a replicated namespace's one copy, whatever the rank);
    the scheduler's index covers rank 0's."""
    name = REPLICATED_DIRECTORY if namespace.replicated else f"rank{namespace.rank}"
    return world_directory(disk_path, namespace, fmt) / name


def rank_directories(disk_path: Path, namespace: Namespace, fmt: BlockFormat = PLAIN) -> list[Path]:
    """Every directory of this world, rank 0's first: one per rank, or the one copy of a replicated namespace
    (files of an evicted key are removed from all of them)."""
    return [rank_directory(disk_path, replace(namespace, rank=r), fmt) for r in namespace.copy_ranks]


def block_path(rank_dir: Path, key: OffloadKey, fmt: BlockFormat = PLAIN) -> str:
    """Final file name of ``key`` in ``rank_dir`` (a str: this runs per block)."""
    name = fmt.name(key)
    return os.path.join(rank_dir, name[:2], name + BLOCK_SUFFIX)
