"""A tier's eviction policy from the deployment's books: the configured kind, inside tenants' shares
(index/tenants.py) and around retained keys (index/retention.py) when those are on.

Composition: with tenants on, each tenant's policy is the configured kind wrapped in a ``RetainPolicy`` capped at
the book's share of the tenant's quota, so that retained keys go after every unretained key *of the same tenant*
and a tenant's retained keys count in its share; with tenants off, the tier's policy is wrapped once.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.config import EvictionPolicy
from kvoffload.index.policies.base import Policy
from kvoffload.index.policies.registry import make_policy
from kvoffload.index.retention import RetainCounts, RetainPolicy, RetentionBook
from kvoffload.index.tenants import TenantBook, TenantPolicy, inner_policies
from kvoffload.keys import OffloadKey


def tier_policy(tenants: TenantBook | None, retention: RetentionBook | None, kind: EvictionPolicy, capacity: int,
                tier: str) -> EvictionPolicy | Policy:
    """The eviction policy of a tier of ``capacity`` keys named ``tier`` in figures (what a ``SlotIndex`` takes):
    ``kind`` alone when tenants and hints are off, as before either existed."""
    if retention is None:
        if tenants is None:
            return kind
        return TenantPolicy(capacity, tenants.shares, inner_policies(kind, capacity), tenants, tier)
    if tenants is None:
        return RetainPolicy(make_policy(kind, capacity), retention, capacity, tier)
    make = inner_policies(kind, capacity)
    policy = TenantPolicy(capacity, tenants.shares,
                          lambda quota: RetainPolicy(make(quota), retention, quota), tenants, tier)
    retention.tiers.append(TenantsRetention(policy, tier))
    return policy


class TenantsRetention:
    """The ``RetainTier`` of a tier with tenants' shares: each tenant's ``RetainPolicy``, through the tier's
    ``TenantPolicy`` (which keeps whose each key is)."""

    __slots__ = ("_policy", "tier")

    def __init__(self, policy: TenantPolicy, tier: str) -> None:
        self._policy = policy
        self.tier = tier

    def retain(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            inner = self._policy.inner_of(key)
            if isinstance(inner, RetainPolicy):
                inner.retain((key,))

    def retained(self) -> int:
        return sum(inner.retained() for inner in self._retaining())

    def counts(self) -> RetainCounts:
        total = RetainCounts()
        for inner in self._retaining():
            total.add(inner.counts())
        return total

    def _retaining(self) -> list[RetainPolicy]:
        return [inner for inner in self._policy.inners() if isinstance(inner, RetainPolicy)]


def retention_book_of(policy: Policy | None) -> RetentionBook | None:
    """The book a tier's policy honours hints on (its own wrapper, or its tenants' wrappers), if any: for an index
    built elsewhere (tests, tools)."""
    if isinstance(policy, TenantPolicy):
        policy = policy.inners()[0]
    return policy.book if isinstance(policy, RetainPolicy) else None


__all__ = ["TenantsRetention", "retention_book_of", "tier_policy"]
