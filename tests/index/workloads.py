"""Keys and the small workloads the manager's tests build state with: a policy filled or scanned, a SlotIndex
with keys stored."""

from __future__ import annotations

from kvoffload.index.policies import Policy
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import OffloadKey


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(4, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def filled(policy: Policy, *ids: int) -> Policy:
    for i in ids:
        policy.insert(key(i))
    return policy


def anything(k: OffloadKey) -> bool:
    return True


def scan(policy: Policy, capacity: int, ids: range) -> None:
    """Insert each key once, evicting one resident key per insert when full (what a tier does)."""
    for i in ids:
        if len(policy) == capacity:
            assert policy.victims(1, anything) is not None
        policy.insert(key(i))


def stored(manager: SlotIndex, *ids: int) -> SlotIndex:
    """Store ``ids`` successfully and clear the events that produced."""
    out = manager.prepare_store(keys(*ids))
    assert out is not None
    manager.complete_store(out.keys_to_store)
    manager.take_events()
    return manager


def held(manager: SlotIndex) -> int:
    return manager.usage()[0].used_blocks
