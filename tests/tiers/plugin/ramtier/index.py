"""Scheduler side of the ram tier: which of its ``capacity_blocks`` slots holds which key.

Nothing survives a restart and nothing is shared with another engine (each worker's slots are its own memory), so
the index needs nothing but a ``SlotIndex`` of the tier's slots: pins, in-flight stores, eviction and events work as
on the host tier. Its specs are ``TierBlocks`` naming both the key and the slot of each entry, so the handler can
refuse a load whose slot holds another key.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.tiers import EvictionPolicy, OffloadKey, Policy, SlotIndex, TierBlocks
from ramtier import MEDIUM


def ram_blocks(keys: Sequence[OffloadKey], slots: Sequence[int]) -> TierBlocks:
    """The tier's spec: each entry's key and slot, one group."""
    return TierBlocks(MEDIUM, tuple(keys), (len(keys),), tuple(slots))


def ram_index(capacity_blocks: int, policy: EvictionPolicy | Policy = EvictionPolicy.LRU) -> SlotIndex:
    """An empty index of ``capacity_blocks`` slots (a ``LowerIndex``).

    Raises:
        ValueError: ``capacity_blocks`` is not a positive integer.
    """
    return SlotIndex(capacity_blocks, policy, MEDIUM, ram_blocks)
