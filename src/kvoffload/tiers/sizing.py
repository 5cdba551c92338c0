"""Sizing the host tier from the configuration; both halves size it here, so they agree on slot counts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvoffload.config import ConfigError, OffloadConfig


class GroupedLayout(Protocol):
    """What sizing needs of a KV-cache layout (``layout.KVCacheLayout`` is one; no torch here)."""

    @property
    def groups(self) -> Sequence[Any]: ...

    def group_block_bytes(self, group: int) -> int: ...


def entry_bytes_of(layout: GroupedLayout, factor: int) -> tuple[int, ...]:
    """Payload bytes of one offload block (``factor`` engine blocks) of each KV-cache group."""
    if factor <= 0:
        raise ValueError(f"offload factor {factor} must be positive")
    return tuple(factor * layout.group_block_bytes(g) for g in range(len(layout.groups)))

def offload_factor(config: OffloadConfig, engine_block_size: int) -> int:
    """Engine blocks per offload block."""
    tokens = config.offload_block_tokens or engine_block_size
    if tokens % engine_block_size:
        raise ConfigError(
            f"offload_block_tokens={tokens} is not a multiple of the engine block size {engine_block_size}"
        )
    return tokens // engine_block_size


def host_slot_bytes(layout: GroupedLayout, factor: int) -> int:
    """Bytes of one host slot: an offload block of the largest group."""
    return max(entry_bytes_of(layout, factor))


def host_num_slots(config: OffloadConfig, layout: GroupedLayout, factor: int) -> int:
    """Slots of the host tier; both halves size it here, so both refuse the same bad sizes.

    Raises:
        ConfigError: the tier is below one slot, or over the container's memory limit.
    """
    slot = host_slot_bytes(layout, factor)
    slots = config.host.capacity_bytes // slot
    if slots < 1:
        raise ConfigError(
            f"host_bytes/host_gib: the host tier ({config.host.capacity_bytes} bytes) is below one offload block "
            f"({slot} bytes); set at least host_bytes={slot}"
        )
    limit = container_memory_limit()
    if limit is not None and slots * slot >= limit:
        # Private pages and tmpfs pages alike count against the cgroup that faults them in: past its limit the
        # engine is OOM-killed while it fills the pool at start-up, with nothing said about why.
        raise ConfigError(
            f"host_bytes/host_gib: the host tier ({slots * slot} bytes) does not fit in this container's memory "
            f"limit ({limit} bytes, cgroup memory.max); set host_bytes well below it, or raise the limit")
    return slots


def check_available(pool_bytes: int) -> None:
    """Refuse a private pool larger than this machine's available memory. A node pool skips it: it may already be
    in memory, and making it checks the tmpfs has room (``tiers/node/segment``).

    Raises:
        ConfigError: ``pool_bytes`` is over MemAvailable.
    """
    available = available_memory_bytes()
    if available is not None and pool_bytes > available:
        # Pinned memory is committed at once: such a pool fails, or swaps the machine, long after start-up.
        raise ConfigError(
            f"host_bytes/host_gib: the host tier ({pool_bytes} bytes per rank) is larger than this machine's "
            f"available memory (MemAvailable {available} bytes); lower it"
        )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping); None where it is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is no limit."""


def container_memory_limit(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors (cgroup v2 ``memory.max``, or v1
    ``memory.limit_in_bytes``); None where there is none or it cannot be read.

    Inside a cgroup namespace /proc/self/cgroup names a path the mount does not have (the container's cgroup is
    the mount's root), so the path's ancestors are read too, down to the mount's root.
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            found += _limits(cgroups, path, "memory.max")
        elif "memory" in controllers.split(","):
            found += _limits(cgroups / "memory", path, "memory.limit_in_bytes")
    limits = [n for n in found if n < _UNLIMITED]
    return min(limits) if limits else None


def _limits(mount: Path, path: str, name: str) -> list[int]:
    """The numeric values of ``name`` in the cgroup directory ``path`` under ``mount`` and in its ancestors."""
    values = []
    relative = Path(path.lstrip("/"))
    for directory in (relative, *relative.parents):
        try:
            text = (mount / directory / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            values.append(int(text))
    return values
