"""Sizing and building the tiers from the configuration; both halves use these so they agree on slot counts."""

from __future__ import annotations

from kvoffload.config import ConfigError, OffloadConfig
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout
from kvoffload.manager.base import ResidencyManager
from kvoffload.manager.host import HostTierManager


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
    slot = host_slot_bytes(layout, factor)
    slots = config.host.capacity_bytes // slot
    if slots < 1:
        raise ConfigError(
            f"host tier capacity {config.host.capacity_bytes} bytes is below one offload block ({slot} bytes)"
        )
    return slots


def build_manager(config: OffloadConfig, layout: KVCacheLayout, factor: int,
                  namespace: Namespace) -> ResidencyManager:
    """The scheduler half's index: the host tier, with the disk tier under it when configured."""
    host = HostTierManager(host_num_slots(config, layout, factor), config.host.policy)
    if config.disk is None:
        return host
    from kvoffload.manager.tiered import TieredManager  # only when a disk tier is configured

    return TieredManager.create(config.disk, host, namespace, layout, factor)
