"""A node pool read from outside any engine: what ``kvoffload node status`` prints and what an engine's /metrics
reads at scrape time (``integrations/vllm/metrics.py``). It only reads: the index is mapped privately and guarded,
so a pool truncated or damaged meanwhile is reported, never a crash."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload import _mapguard, _nodeindex
from kvoffload.tiers.node.files import INDEX_NAME, POOL_PREFIX, BoundFiles
from kvoffload.tiers.node.liveness import ENGINES_NAME, alive_attachments
from kvoffload.tiers.node.tenants import shown


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
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per tenant of the pool's tenant table: {"resident", "stores", "evictions"} (empty: no table); a name over
    64 bytes shows as its prefix and hash (tiers/node/tenants.py)."""


def pools(node_path: Path) -> list[Path]:
    """The namespace directories under ``node_path``."""
    found = []
    for owner in sorted(node_path.glob("kvoffload-node-*")):
        if owner.is_dir() and not owner.is_symlink():
            found.extend(sorted(d for d in owner.iterdir() if d.is_dir() and not d.is_symlink()))
    return found


def read_status(directory: Path) -> PoolStatus:
    """``directory``'s pool, read without changing it."""
    files = [e for e in os.scandir(directory) if e.is_file(follow_symlinks=False)]
    size = sum(e.stat(follow_symlinks=False).st_size for e in files if e.name == INDEX_NAME
               or e.name.startswith(POOL_PREFIX))
    alive = alive_attachments(directory / ENGINES_NAME)
    problem, stats, attached, tenants = None, {}, 0, {}
    try:
        with open(directory / INDEX_NAME, "rb") as f:
            index = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: a damaged index is not touched
            inode = os.fstat(f.fileno()).st_ino
        guard = _mapguard.guard(index)
        try:
            stats = _nodeindex.stats(index)
            attached = len(_nodeindex.attachments(index))
            tenants = tenant_counts(index)
            problem = BoundFiles(directory, inode, stats["capacity"] * stats["slot_bytes"]).problem(index)
            if _mapguard.lost(guard):
                problem, stats, tenants = "the index was truncated while it was read", {}, {}
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
                      problem, tenants)


def tenant_counts(index: mmap.mmap) -> dict[str, dict[str, int]]:
    """Each tenant's counts in the pool's tenant table (empty when it has none)."""
    _, on, entries = _nodeindex.tenants(index)
    if not on:
        return {}
    return {shown(name, hashed): {"resident": resident, "stores": stores, "evictions": evictions}
            for _, name, hashed, _, resident, stores, evictions in entries}


def tenant_gauges(status: PoolStatus) -> dict[tuple[str, str], int]:
    """Per-tenant gauges of ``status``: (tenant, "resident" | "stores" | "evictions") -> value, for a gauge
    labelled by tenant and counter (at most 17 tenants: 16 named and "other")."""
    return {(tenant, counter): value for tenant, counts in status.tenants.items() for counter, value in counts.items()}


def gauges(status: PoolStatus) -> dict[str, int]:
    """The pool-wide counters of ``index.POOL_COUNTERS`` (all but an engine's own ``served``) from ``status``."""
    return {"capacity": status.capacity, "used": status.used, "attached": status.engines_attached,
            **{k: v for k, v in status.counters.items() if k in ("stores", "evictions", "cross_hits", "repairs",
                                                                 "reclaimed", "busy")}}
