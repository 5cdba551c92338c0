"""``PrivateHostSpec``: the host tier each engine keeps in its own memory (``host_scope`` private); with tenants on
(``tenant_by``), its index evicts by tenants' shares (index/tenants.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.index.slot_index import SlotIndex
from kvoffload.tiers.sizing import check_available, host_num_slots, host_slot_bytes
from kvoffload.tiers.spec import HostSpec, TierContext

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostPool


class PrivateHostSpec(HostSpec):
    """Host slots in this process's memory, pinned when the KV cache is on a GPU."""

    def num_slots(self, context: TierContext) -> int:
        """Slots of each rank's pool; both halves size it here, so both refuse the same bad sizes.

        Raises:
            ConfigError: as ``host_num_slots``, or the pool is larger than this machine's available memory.
        """
        slots = host_num_slots(self._config, context.layout, context.factor)
        check_available(slots * host_slot_bytes(context.layout, context.factor))
        return slots

    def make_index(self, context: TierContext) -> SlotIndex:
        slots = self.num_slots(context)
        return SlotIndex(slots, context.policy(self._config.host.policy, slots, "host"))

    def make_pool(self, context: TierContext, pin_memory: bool) -> HostPool:
        from kvoffload.transfer.host_pool import HostPool

        return HostPool(self.num_slots(context), host_slot_bytes(context.layout, context.factor),
                        pin_memory=pin_memory)
