"""``TenantBook``: the deployment's tenants' groups and shares, shared by every tier that keeps tenants' shares.

The tiers on a book (``TenantTier``: ``index/tenants.py``'s ``TenantPolicy`` for each ``SlotIndex`` tier, the node
pool's own view) learn from it whose the keys of a store are, which group a key entering them joins, and new
quotas; the scheduler's figures read them through it (docs/tenants.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload.config import TenantConfig
from kvoffload.keys import OffloadKey

SHARED = "shared"
"""The tenant of requests without a salt (or LoRA adapter), and of keys nobody assigned."""
OTHER = "other"
"""The group of every tenant not named in ``tenant_quota``."""


@dataclass
class TenantCounts:
    """One group's figures in one tier: keys that entered (``stored``), keys taken as victims (``evicted``), and
    uses of its resident keys (``hits``: keys touched by a load; a block on host and disk is a use in each)."""

    stored: int = 0
    evicted: int = 0
    hits: int = 0

    def add(self, other: TenantCounts) -> None:
        self.stored += other.stored
        self.evicted += other.evicted
        self.hits += other.hits


class TenantTier(Protocol):
    """A tier keeping tenants' shares on a ``TenantBook``."""

    tier: str
    """The tier's name in figures ("host", "disk", ...)."""

    @property
    def of(self) -> Mapping[OffloadKey, int]:
        """Resident keys' groups, for a key entering another tier (empty where the tier keeps them elsewhere)."""
        ...

    def regroup(self, mapping: Sequence[int]) -> None:
        """The book's groups changed (``TenantBook.set_quota``): old group ``g`` is new group ``mapping[g]``."""
        ...

    def figures(self) -> dict[str, tuple[int, TenantCounts]]:
        """Per group name: (resident blocks, counts so far)."""
        ...


class TenantBook:
    """The deployment's groups and their shares, shared by every tier's ``TenantPolicy``; whose the keys of the
    store being prepared are; and which group a key entering a tier joins.

    A key entering a tier joins the group the scheduler assigned it (``assign``), else the group it has in another
    tier (a block written below from host, or promoted to host from below, stays its tenant's), else the shared
    tenant's.

    Args:
        names: the named tenants, in order; group ``len(names)`` is "other".
        shares: each group's fraction ("other" last); None: set by the first ``TenantPolicy`` built on the book.
    """

    __slots__ = ("_group", "names", "pending", "policies", "shared", "shares")

    def __init__(self, names: Sequence[str], shares: Sequence[float] | None = None) -> None:
        self.names: tuple[str, ...] = (*names, OTHER)
        self._group = {name: i for i, name in enumerate(names)}
        self.shared = self.group(SHARED)
        """The shared tenant's group."""
        self.shares: list[float] = list(shares) if shares is not None else []
        self.pending: dict[OffloadKey, int] = {}
        """The store being prepared: its keys' groups (``assign``), until ``clear``."""
        self.policies: list[TenantTier] = []
        """Every tier on this book, in the order built (host first)."""

    @classmethod
    def of_config(cls, config: TenantConfig) -> TenantBook:
        return cls([name for name, _ in config.shares], [share for _, share in config.shares] + [config.default])

    def group(self, tenant: str | None) -> int:
        """The group of ``tenant`` (None: the shared tenant)."""
        return self._group.get(SHARED if tenant is None else tenant, len(self.names) - 1)

    def assign(self, keys: Iterable[OffloadKey], tenant: str | None) -> None:
        """The keys of the store about to be prepared are ``tenant``'s (resident ones stay in their group)."""
        self.pending.update(dict.fromkeys(keys, self.group(tenant)))

    def clear(self) -> None:
        """The store is prepared (or refused): forget its assignments."""
        self.pending.clear()

    def new_key_group(self, key: OffloadKey, tier: TenantTier) -> int:
        """The group a key entering ``tier`` joins."""
        group = self.pending.get(key)
        if group is not None:
            return group
        for policy in self.policies:
            if policy is not tier:
                group = policy.of.get(key)
                if group is not None:
                    return group
        return self.shared

    def set_quota(self, default: float, shares: Sequence[tuple[str, float]]) -> None:
        """New shares, on a running engine (validated by the caller: ``config.values.tenant_quota``).

        A tenant named before and now keeps its blocks and its policy's history. A tenant no longer named
        joins "other" with its blocks, which then go before "other"'s own (a tenant dropped from the quotas is
        most often a customer gone), in their order; the merged group's history (ARC's ghosts, TinyLFU's counts)
        starts afresh. A tenant named now that was not has only its later blocks in its group: its older ones
        stay in "other" (which tenant they were is not kept) until they leave.
        """
        names = [name for name, _ in shares]
        where = {name: i for i, name in enumerate(names)}
        mapping = [where.get(name, len(names)) for name in self.names[:-1]] + [len(names)]
        self.names, self._group = (*names, OTHER), where
        self.shared = self.group(SHARED)
        self.shares = [share for _, share in shares] + [default]
        for policy in self.policies:
            policy.regroup(mapping)

    def figures(self) -> dict[str, dict[str, tuple[int, TenantCounts]]]:
        """Per tier, per group name: (resident keys, counts so far)."""
        return {policy.tier: policy.figures() for policy in self.policies}
