"""``kvoffload node``: the node pools on this machine as an operator sees them, and removing one safely.

``status`` lists every pool under ``--node-path`` (one per user or shared group and namespace): its size, the
engines attached and how many of them live (their locks, ``tiers/node/liveness.py``), occupancy and the pool's
counters, and whether its files are whole. It only reads: the index is mapped privately and guarded, so a pool
truncated meanwhile is reported, not a crash. ``remove`` deletes a pool's files and directory under the lock
engines open pools under, and refuses while a live engine is attached: an engine restarted later finds its blocks
only while the files are kept, so they outlive every engine until removed (or the machine restarts).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_NODE_PATH = Path("/dev/shm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    status = sub.add_parser("status", help="the node pools under --node-path: size, engines, occupancy, counters")
    status.add_argument("--node-path", type=Path, default=DEFAULT_NODE_PATH, help="the tier's node_path")
    status.add_argument("--json", action="store_true", help="one JSON object per pool")
    remove = sub.add_parser("remove", help="delete a node pool no live engine uses")
    remove.add_argument("pool", nargs="?", help="its directory, or its namespace as status names it")
    remove.add_argument("--all", action="store_true", help="every pool no live engine uses")
    remove.add_argument("--node-path", type=Path, default=DEFAULT_NODE_PATH, help="the tier's node_path")


@dataclass(frozen=True)
class PoolStatus:
    """One node pool as ``status`` reports it."""

    directory: str
    namespace: str
    owner: str
    bytes: int
    engines_attached: int
    engines_alive: int
    capacity: int
    used: int
    counters: dict[str, int]
    problem: str | None
    """None when the files are whole and the index reads; else what is wrong (engines make a new pool)."""


def pools(node_path: Path) -> list[Path]:
    """The namespace directories under ``node_path``."""
    found = []
    for owner in sorted(node_path.glob("kvoffload-node-*")):
        if owner.is_dir() and not owner.is_symlink():
            found.extend(sorted(d for d in owner.iterdir() if d.is_dir() and not d.is_symlink()))
    return found


def read_status(directory: Path) -> PoolStatus:
    """``directory``'s pool, read without changing it."""
    from kvoffload import _mapguard, _nodeindex
    from kvoffload.tiers.node.files import ENGINES_NAME, INDEX_NAME, POOL_PREFIX
    from kvoffload.tiers.node.liveness import alive_attachments

    files = [e for e in os.scandir(directory) if e.is_file(follow_symlinks=False)]
    size = sum(e.stat(follow_symlinks=False).st_size for e in files if e.name == INDEX_NAME
               or e.name.startswith(POOL_PREFIX))
    alive = alive_attachments(directory / ENGINES_NAME)
    problem, stats, attached = None, {}, 0
    try:
        with open(directory / INDEX_NAME, "rb") as f:
            index = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: a damaged index is not touched
        guard = _mapguard.guard(index)
        try:
            stats = _nodeindex.stats(index)
            attached = len(_nodeindex.attachments(index))
            problem = _files_problem(directory, index)
            if _mapguard.lost(guard):
                problem, stats = "the index was truncated while it was read", {}
        finally:
            _mapguard.unguard(guard)
            index.close()
    except (OSError, ValueError) as e:
        problem = f"no index: {e}"
    except _nodeindex.Damaged as e:
        problem = str(e)
    counters = {k: int(v) for k, v in stats.items() if k not in ("capacity", "used", "fingerprint", "attached")}
    return PoolStatus(str(directory), directory.name, directory.parent.name.removeprefix("kvoffload-node-"), size,
                      attached, len(alive), int(stats.get("capacity", 0)), int(stats.get("used", 0)), counters,
                      problem)


def _files_problem(directory: Path, index: mmap.mmap) -> str | None:
    from kvoffload import _nodeindex
    from kvoffload.tiers.node.files import INDEX_NAME, BoundFiles

    stats = _nodeindex.stats(index)
    bound = BoundFiles(directory, os.lstat(directory / INDEX_NAME).st_ino, stats["capacity"] * stats["slot_bytes"])
    return bound.problem(index)


def remove(directory: Path) -> str | None:
    """Delete ``directory``'s pool; None when done, else why it was refused (a live engine uses it)."""
    from kvoffload.tiers.node.files import ENGINES_NAME, set_locked
    from kvoffload.tiers.node.liveness import alive_attachments

    with set_locked(directory):  # no engine opens the pool meanwhile
        alive = alive_attachments(directory / ENGINES_NAME)
        if alive:
            return f"{len(alive)} live engine(s) use it (attachments {sorted(alive)}): stop them first"
        for entry in os.scandir(directory):
            os.unlink(entry.path)
    os.rmdir(directory)
    return None


def run(args: argparse.Namespace) -> int:
    if args.action == "status":
        return _status(args.node_path, args.json)
    return _remove(args)


def _status(node_path: Path, as_json: bool) -> int:
    found = [read_status(d) for d in pools(node_path)]
    if as_json:
        for pool in found:
            print(json.dumps(asdict(pool)))
        return 0
    if not found:
        print(f"no node pool under {node_path}")
    for pool in found:
        state = "whole" if pool.problem is None else f"NOT WHOLE: {pool.problem}"
        print(f"{pool.directory}\n  owner {pool.owner}, {pool.bytes / (1 << 20):.1f} MiB, {state}\n"
              f"  engines: {pool.engines_attached} attached, {pool.engines_alive} alive\n"
              f"  slots: {pool.used} of {pool.capacity} used\n"
              f"  counters: {', '.join(f'{k} {v}' for k, v in sorted(pool.counters.items()))}")
    return 0


def _remove(args: argparse.Namespace) -> int:
    if args.all == (args.pool is not None):
        print("kvoffload node remove: name one pool, or --all")
        return 2
    if args.all:
        targets = pools(args.node_path)
    else:
        given = Path(args.pool)
        matches = [d for d in pools(args.node_path) if d.name == args.pool or d == given]
        if not matches:
            print(f"kvoffload node remove: no node pool {args.pool} under {args.node_path}")
            return 1
        targets = matches
    failed = 0
    for directory in targets:
        refused = remove(directory)
        print(f"{directory}: {'removed' if refused is None else 'kept: ' + refused}")
        failed += refused is not None
    return 1 if failed and not args.all else 0
