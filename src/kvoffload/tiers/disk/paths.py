"""Where the disk tier's files live, and their names.

Paths: ``<disk_path>/<world>/rank<r>/engine-<n>.kvs``, where ``world`` is the chain root's hex[:16] (for an
authenticated tier, keyed by the secret: ``BlockFormat``) and ``n`` the engine's number, which its scheduler holds
``<world>/engine-<n>.lock`` for while it runs (``tiers.disk.engine_files``). A replicated namespace (every rank
holds the same bytes: ``Namespace.replicated``) has one directory, ``<world>/replicated``, that rank 0 writes and
every rank reads. ``tree`` creates and checks the directories; ``slot_file`` is a file's layout.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from kvoffload.keys import Namespace
from kvoffload.tiers.lower.block_format import PLAIN, BlockFormat

SLOT_FILE = re.compile(r"engine-(0|[1-9][0-9]{0,5})\.kvs")
"""``engine-<n>.kvs``, the only slot file name (n in canonical decimal)."""
MAX_ENGINES = 256
"""Engine numbers an engine tries at start-up (the engines running on one directory at once)."""


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


def slot_file_path(rank_dir: Path, engine: int) -> str:
    """The slot file of engine ``engine`` in ``rank_dir`` (a str: the handler opens it per file, not per block)."""
    return os.path.join(rank_dir, f"engine-{engine}.kvs")


def engine_lock_path(world_dir: Path, engine: int) -> Path:
    """The lock an engine's scheduler holds on its number while it runs."""
    return world_dir / f"engine-{engine}.lock"


def engine_of(name: str) -> int | None:
    """The engine number a slot file's name gives, when it is exactly a name ``slot_file_path`` makes."""
    match = SLOT_FILE.fullmatch(name)
    return int(match.group(1)) if match and int(match.group(1)) < MAX_ENGINES else None
