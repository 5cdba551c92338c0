"""``RamTierSpec``: the ram tier's binding, the factory its entry point names (``ramtier.spec:RamTierSpec``).

``kvoffload.tiers.registry`` calls it with the tier's ``extra_tiers`` options; it checks them (a bad one is a
``ValueError`` naming it, which the registry turns into a ``ConfigError`` naming ``extra_tiers.ramtier``). The
index and the handler are imported only inside ``make_index`` and ``make_handler``, so that neither half loads the
other's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffload.tiers import EvictionPolicy, Medium, TierContext, TierSpec
from ramtier import MEDIUM

if TYPE_CHECKING:
    from kvoffload.tiers import HostPool, LowerIndex, TransferHandler


@dataclass(frozen=True)
class RamTierOptions:
    """The tier's options: ``capacity_blocks`` (required, a positive integer: the offload blocks each worker
    keeps) and ``corrupt_loads`` (false by default: fault injection for the tests)."""

    capacity_blocks: int
    corrupt_loads: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> RamTierOptions:
        """Raises: ValueError naming the first bad or unknown option."""
        unknown = sorted(set(options) - {"capacity_blocks", "corrupt_loads"})
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r} (options: capacity_blocks, corrupt_loads)")
        capacity = options.get("capacity_blocks")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity_blocks {capacity!r} must be a positive integer")
        corrupt = options.get("corrupt_loads", False)
        if not isinstance(corrupt, bool):
            raise ValueError(f"corrupt_loads {corrupt!r} must be true or false")
        return cls(capacity, corrupt)


class RamTierSpec(TierSpec):
    """``capacity_blocks`` offload blocks in each worker's memory, under host, written through.

    Raises:
        ValueError: a bad or unknown option.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = RamTierOptions.parse(options)

    @property
    def medium(self) -> Medium:
        return MEDIUM

    def make_index(self, context: TierContext) -> LowerIndex:
        from ramtier.index import ram_index

        capacity = self.options.capacity_blocks
        # The tier's policy from the context: per tenant when tenants are on (docs/tenants.md), else plain LRU.
        return ram_index(capacity, context.policy(EvictionPolicy.LRU, capacity, "ramtier"))

    def make_handler(self, context: TierContext, pool: HostPool) -> TransferHandler:
        from ramtier.handler import RamHandler, RamSlots

        slots = RamSlots(self.options.capacity_blocks, max(context.entry_bytes))
        return RamHandler(pool, slots, corrupt_loads=self.options.corrupt_loads)
