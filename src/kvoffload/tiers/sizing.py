"""Sizing the host tier from the configuration; both halves size it here, so they agree on slot counts."""

from __future__ import annotations

import os

from kvoffload.config import ConfigError, HostScope, OffloadConfig
from kvoffload.tiers.lower.block_format import GroupedLayout, entry_bytes_of


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
        ConfigError: the tier is below one slot, or larger than this machine's available memory.
    """
    slot = host_slot_bytes(layout, factor)
    slots = config.host.capacity_bytes // slot
    if slots < 1:
        raise ConfigError(
            f"host_bytes/host_gib: the host tier ({config.host.capacity_bytes} bytes) is below one offload block "
            f"({slot} bytes); set at least host_bytes={slot}"
        )
    if config.host.scope is HostScope.NODE:
        return slots  # a shared pool may already be in memory; making it checks the tmpfs has room (node/segment)
    available = available_memory_bytes()
    if available is not None and slots * slot > available:
        # Pinned memory is committed at once: such a pool fails, or swaps the machine, long after start-up.
        raise ConfigError(
            f"host_bytes/host_gib: the host tier ({slots * slot} bytes per rank) is larger than this machine's "
            f"available memory (MemAvailable {available} bytes); lower it"
        )
    return slots


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
