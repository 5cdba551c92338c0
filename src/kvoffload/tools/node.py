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
import os
from dataclasses import asdict
from pathlib import Path

from kvoffload.tiers.node.status import pools, read_status

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
