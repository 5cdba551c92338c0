"""Sizing and building the tiers from the configuration; both halves use these so they agree on slot counts."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvoffload.config import ConfigError, OffloadConfig, RemoteTierConfig, WritePolicy
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout
from kvoffload.manager.base import ResidencyManager
from kvoffload.manager.slot_index import SlotIndex
from kvoffload.specs import Medium
from kvoffload.tiers.lower.block_format import BlockFormat, entry_bytes_of

if TYPE_CHECKING:
    from kvoffload.manager.tiered import Below


def offload_factor(config: OffloadConfig, engine_block_size: int) -> int:
    """Engine blocks per offload block."""
    tokens = config.offload_block_tokens or engine_block_size
    if tokens % engine_block_size:
        raise ConfigError(
            f"offload_block_tokens={tokens} is not a multiple of the engine block size {engine_block_size}"
        )
    return tokens // engine_block_size


def host_slot_bytes(layout: KVCacheLayout, factor: int) -> int:
    """Bytes of one host slot: an offload block of the largest group."""
    return factor * max(layout.group_block_bytes(g) for g in range(len(layout.groups)))


def host_num_slots(config: OffloadConfig, layout: KVCacheLayout, factor: int) -> int:
    """Slots of the host tier; both halves size it here, so both refuse the same bad sizes.

    Raises:
        ConfigError: the tier is below one slot, or larger than this machine's available memory.
    """
    slot = host_slot_bytes(layout, factor)
    slots = config.host.capacity_bytes // slot
    if slots < 1:
        raise ConfigError(
            f"host tier capacity {config.host.capacity_bytes} bytes is below one offload block ({slot} bytes)"
        )
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


def build_manager(config: OffloadConfig, layout: KVCacheLayout, factor: int,
                  namespace: Namespace) -> ResidencyManager:
    """The scheduler half's index: the host tier, over the disk tier, the remote tier or both when configured.

    Host RAM is the hub; the disk and the remote tier sit beside each other under it, disk first
    (``TieredManager``; docs/remote.md says why).

    Raises:
        ConfigError: a tier cannot be sized or used (see ``host_num_slots`` and the lower tiers' ``create``), or
            ``remote_url`` is given without redis-py installed.
    """
    host = SlotIndex(host_num_slots(config, layout, factor), config.host.policy)
    if config.disk is None and config.remote is None:
        return host
    from kvoffload.manager.tiered import TieredManager  # only when a lower tier is configured

    remote = () if config.remote is None else (_remote_tier(config.remote, namespace, layout, factor),)
    if config.disk is None:
        return TieredManager(host, remote)
    return TieredManager.create(config.disk, host, namespace, layout, factor, further=remote)


def _remote_tier(config: RemoteTierConfig, namespace: Namespace, layout: KVCacheLayout, factor: int) -> Below:
    try:
        from kvoffload.tiers.remote.index import RemoteIndex
    except ImportError as e:
        raise ConfigError(f'remote_url needs redis-py: pip install "kvoffload[redis]" ({e})') from None
    from kvoffload.manager.tiered import Below

    value_bytes = BlockFormat.of(config.secret).file_bytes(max(entry_bytes_of(layout, factor)))
    # Write-through: a shared tier serves other engines only what is written to it, as soon as it is written.
    return Below(RemoteIndex.create(config, namespace, value_bytes), WritePolicy.WRITE_THROUGH)


def transfer_routes(config: OffloadConfig) -> tuple[tuple[Medium, Medium], ...]:
    """The copy directions a configuration's workers run: device<->host always, host<->each lower tier."""
    routes = [(Medium.DEVICE, Medium.HOST), (Medium.HOST, Medium.DEVICE)]
    for medium, tier in ((Medium.DISK, config.disk), (Medium.REMOTE, config.remote)):
        if tier is not None:
            routes += [(Medium.HOST, medium), (medium, Medium.HOST)]
    return tuple(routes)
