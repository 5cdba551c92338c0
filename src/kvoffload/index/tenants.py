"""Tenants' shares of a tier: ``TenantPolicy`` orders each tenant's keys with its own policy and picks victims so
that one tenant's flood cannot flush another's blocks.

Built only when tenants are on (``tenant_by`` not none), for every tier on a ``SlotIndex`` (the private host tier,
the disk, this engine's budgets in the remote store and the bucket, plug-ins: ``tier_policy``, which
``TierContext.policy`` calls), all on one ``TenantBook`` (index/tenant_book.py); with tenants off no ``TenantPolicy``
exists and each tier's policy is the configured one, as before.

Groups: each tenant named in ``tenant_quota`` is a group with its share, and every tenant not named counts in one
group, "other", with the default share. A group's quota is its share times the tier's capacity in keys; its usage is
its resident keys (ready or in flight), plus, while a store is being prepared, that store's new keys of that group.
The scheduler says whose the keys of a store are (``TenantBook.assign``, before ``prepare_store``; ``clear`` after);
a key nobody assigned joins the group it has in another tier of the book (a block written below, or promoted), else
the shared tenant's. The store's new keys are those the ``SlotIndex`` names (``entering``). A key stays in the group
it entered with until it leaves (or new quotas regroup it: ``TenantBook.set_quota``).

The rule, for each victim of ``victims(n, can_evict)``, with usages updated as victims are taken:

1. a group that is storing now and is over its quota (usage > quota) gives up its own key, the most over first;
2. else any group over its quota gives up a key, the most over first (unused share was lent; this takes it back);
3. else a group that is storing now gives up its own key (it is at or under its quota: it only hurts itself),
   the least under its quota first;
4. else the store cannot be made: None. A group that is not storing and is at or under its quota never gives up
   a key, whoever stores.

"Most over" is usage minus quota, in keys; ties go to the group named first ("other" last). Within a group the
victims are its own policy's (LRU, ARC, S3-FIFO, TinyLFU: their order within a tenant is theirs). Work-conserving:
quotas never refuse a store while some group is over its quota and has a key ``can_evict`` allows, and nothing is
evicted while the tier has free slots (the index asks for victims only when full). If shares add up to 1 and every
group is at or under quota, the tier has room; so a store refused by the rule needs keys refused by ``can_evict``.

Costs: ``victims`` is O(groups) per run of victims taken from one group, plus the inner policies' costs, and one
call into one policy for most stores (one tenant storing, over its quota: ``_whole_run``); the other methods add one
dict lookup per key, done in C for a run of one tenant's keys (``_stepscan.common_value``: a request's keys are one
tenant's), which is then handed to its policy whole. Bounds: at most ``MAX_TENANTS`` + 1 groups; each policy maps
only its tier's resident keys (at most the tier's capacity), the book only the store being prepared.

Atomicity: inner policies are asked group by group, each atomic. A group that cannot give the run asked changes
nothing and has offered every key it may give, so the rule then knows how many it can and asks for no more. Only
when a later group falls short and no other group may give does an earlier group's run have to be undone: those
groups get their keys back ahead of their other keys, in their order, in a fresh inner policy (their history, ARC's
ghosts or TinyLFU's counts, is forgotten; keys ``can_evict`` refused move behind them). It happens only when the
store is refused anyway, and never with one group (the policy conformance suite checks that case).

An adaptive eviction policy is not steered inside tenants (phase 1): each tenant's stays LRU. Uses of keys that
are not resident are not remembered (TinyLFU counts only resident keys' uses under tenants).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

from kvoffload._stepscan import common_value
from kvoffload.config import EvictionPolicy, TenantConfig
from kvoffload.index.base import IntegrityError
from kvoffload.index.policies.base import CanEvict, Policy, any_key, consume, counting
from kvoffload.index.policies.registry import make_policy
from kvoffload.index.tenant_book import OTHER, SHARED, TenantBook, TenantCounts
from kvoffload.keys import OffloadKey


class TenantPolicy(Policy):
    """Per-group inner policies of one tier, evicted by the rule in the module docstring.

    Args:
        capacity: the tier's capacity in keys.
        shares: each group's fraction of the tier, in the book's group order ("other" last); the book keeps them
            (every tier on one book has the same shares).
        make_inner: builds a fresh inner policy (the configured kind) for a group whose quota is the given number of
            keys (at least 1; a group may hold more while unused share is lent to it).
        book: the groups and their keys; this policy joins its ``policies``.
        tier: the tier's name in figures ("host", "disk", ...).
    """

    __slots__ = ("_capacity", "_entering", "_inner", "_make", "book", "counts", "of", "tier")

    def __init__(self, capacity: int, shares: Sequence[float], make_inner: Callable[[int], Policy],
                 book: TenantBook, tier: str = "host") -> None:
        if len(shares) != len(book.names):
            raise ValueError(f"TenantPolicy: {len(shares)} shares for {len(book.names)} groups")
        book.shares = list(shares)
        book.policies.append(self)
        self.book = book
        self.tier = tier
        self._capacity = capacity
        self._make = make_inner
        self._inner = [make_inner(self.inner_size(g)) for g in range(len(shares))]
        self.of: dict[OffloadKey, int] = {}
        """Resident keys' groups."""
        self.counts = [TenantCounts() for _ in shares]
        """Each group's figures so far."""
        self._entering: Sequence[OffloadKey] = ()

    @classmethod
    def of_config(cls, config: TenantConfig, capacity: int, make_inner: Callable[[int], Policy]) -> TenantPolicy:
        book = TenantBook.of_config(config)
        return cls(capacity, book.shares, make_inner, book)

    def quota(self, group: int) -> float:
        """The group's quota in keys: its share of the tier."""
        return self.book.shares[group] * self._capacity

    def inner_size(self, group: int) -> int:
        """What the group's inner policy is sized for: its quota in keys, at least 1 (set when the inner policy is
        made: at start-up, or when new quotas merge groups)."""
        return max(1, math.ceil(self.quota(group)))

    def usage(self) -> dict[str, int]:
        """Resident keys per group, by name ("other" last)."""
        return {name: len(inner) for name, inner in zip(self.book.names, self._inner, strict=True)}

    def figures(self) -> dict[str, tuple[int, TenantCounts]]:
        """Per group name: (resident keys, counts so far)."""
        return {name: (len(inner), counts)
                for name, inner, counts in zip(self.book.names, self._inner, self.counts, strict=True)}

    def inner_of(self, key: OffloadKey) -> Policy | None:
        """The policy of ``key``'s group (None: not resident)."""
        group = self.of.get(key)
        return None if group is None else self._inner[group]

    def inners(self) -> Sequence[Policy]:
        """Each group's policy, in group order."""
        return self._inner

    def insert(self, key: OffloadKey) -> None:
        of = self.of
        group = of.get(key)
        if group is None:
            group = of[key] = self.book.new_key_group(key, self)
            self.counts[group].stored += 1
        self._inner[group].insert(key)

    def insert_all(self, keys: Iterable[OffloadKey]) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        of = self.of
        group = common_value(self.book.pending, keys)  # most stores: one tenant's new keys, all assigned
        if group is not None and of.keys().isdisjoint(keys):
            of.update(dict.fromkeys(keys, group))
            self.counts[group].stored += len(keys)
            self._inner[group].insert_all(keys)
            return
        for group, batch in self._by_group(keys, new=True):
            self._inner[group].insert_all(batch)

    def touch(self, key: OffloadKey) -> None:
        group = self.of.get(key)
        if group is not None:
            self.counts[group].hits += 1
            self._inner[group].touch(key)

    def touch_all(self, keys: Iterable[OffloadKey]) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        group = common_value(self.of, keys)  # most loads: one request's keys, one tenant's
        if group is not None:
            self.counts[group].hits += len(keys)
            self._inner[group].touch_all(keys)
            return
        for group, batch in self._by_group(keys, new=False):
            self.counts[group].hits += len(batch)
            self._inner[group].touch_all(batch)

    def entering(self, keys: Sequence[OffloadKey]) -> None:
        self._entering = keys

    def remove(self, key: OffloadKey) -> None:
        group = self.of.pop(key, None)
        if group is not None:
            self._inner[group].remove(key)

    def regroup(self, mapping: Sequence[int]) -> None:
        """The book's groups changed (``TenantBook.set_quota``): old group ``g`` is new group ``mapping[g]``."""
        count = len(self.book.names)
        sources: list[list[int]] = [[] for _ in range(count)]
        for old, new in enumerate(mapping):
            sources[new].append(old)
        inner: list[Policy] = []
        counts: list[TenantCounts] = []
        for olds in sources:
            counts.append(TenantCounts())
            for old in olds:
                counts[-1].add(self.counts[old])
            if len(olds) == 1:
                inner.append(self._inner[olds[0]])
                continue
            # First to go: the groups joining "other" (in group order), then its own.
            merged = self._make(self.inner_size(len(inner)))
            merged.insert_all([key for old in olds for key in self._drain(self._inner[old])])
            inner.append(merged)
        self._inner, self.counts = inner, counts
        of = self.of
        for key, group in of.items():
            of[key] = mapping[group]

    def victims(self, n: int, can_evict: CanEvict) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        entering, self._entering = self._entering or self._assigned(), ()
        group = common_value(self.book.pending, entering) if entering else None  # most stores: one tenant's keys
        if group is not None and self._whole_run(group, len(self._inner[group]) + len(entering), n):
            got = self._inner[group].victims(n, can_evict)
            if got is not None:
                self.counts[group].evicted += n
                consume(map(self.of.__delitem__, got))
                return got
        used, storing = self._usage_with_store(entering, group)
        taken: list[tuple[int, list[OffloadKey]]] = []
        avail: dict[int, int] = {}
        """Groups that could not give what was asked: how many keys ``can_evict`` allowed there (0: none)."""
        left = n
        while left:
            group, run = self._next(used, storing, avail, left)
            if group is None:
                self._give_back(taken)
                return None
            got = self._inner[group].victims(run, can_evict)
            if got is None:
                # A refused call changes nothing and offers every key it could give: asked again, counting them,
                # it says how many (only a store short of room pays for the count).
                allowed: set[OffloadKey] = set()
                self._inner[group].victims(run, counting(can_evict, allowed))
                avail[group] = len(allowed) if len(allowed) < run else 0
                if self._short(used, storing, avail, left):
                    self._give_back(taken)
                    return None
                continue
            taken.append((group, got))
            used[group] -= run
            left -= run
            if group in avail:
                avail[group] -= run
        of, counts = self.of, self.counts
        for group, got in taken:
            counts[group].evicted += len(got)
            for key in got:
                del of[key]
        return [key for _, got in taken for key in got]

    def __contains__(self, key: object) -> bool:
        return key in self.of

    def __len__(self) -> int:
        return len(self.of)

    def check_integrity(self) -> None:
        of = self.of
        if sum(len(inner) for inner in self._inner) != len(of):
            raise IntegrityError(f"tenant policy: groups hold {[len(i) for i in self._inner]} keys, the book "
                                 f"{len(of)}")
        for key, group in of.items():
            if key not in self._inner[group]:
                raise IntegrityError(f"tenant policy: key {key!r} of group {self.book.names[group]} is not in "
                                     f"its policy")
        for inner in self._inner:
            inner.check_integrity()

    def _by_group(self, keys: Iterable[OffloadKey], new: bool) -> list[tuple[int, list[OffloadKey]]]:
        """``keys`` split by group, each in the given order; ``new``: keys not resident join their new group
        (recorded in the book), else they are left out."""
        of, book, counts = self.of, self.book, self.counts
        batches: dict[int, list[OffloadKey]] = {}
        for key in keys:
            group = of.get(key)
            if group is None:
                if not new:
                    continue
                group = of[key] = book.new_key_group(key, self)
                counts[group].stored += 1
            batches.setdefault(group, []).append(key)
        return list(batches.items())

    def _assigned(self) -> list[OffloadKey]:
        """The store's keys when ``entering`` named none (a caller of ``victims`` other than ``SlotIndex``): those
        assigned that are not resident."""
        of = self.of
        return [key for key in self.book.pending if key not in of]

    def _usage_with_store(self, entering: Sequence[OffloadKey], group: int | None
                          ) -> tuple[list[float], set[int]]:
        """Each group's usage counting the store being prepared, and the groups storing now.

        The store's keys are ``entering``, each in the group it will join: assigned, else its group in another tier
        (a promoted block, a block written below); ``group``: the one group all of them were assigned, if so."""
        used: list[float] = [len(inner) for inner in self._inner]
        book = self.book
        if group is not None:
            used[group] += len(entering)
            return used, {group}
        storing: set[int] = set()
        for key in entering:
            group = book.new_key_group(key, self)
            used[group] += 1
            storing.add(group)
        if not storing:
            storing.add(self.book.shared)  # nobody assigned: the shared tenant's
        return used, storing

    def _whole_run(self, group: int, used: int, n: int) -> bool:
        """Whether all ``n`` victims come from ``group`` by rule 1 at once: it is the one tenant storing (``used``
        keys with its new ones) and over its quota by more than ``n - 1``, so it stays over until its last victim.
        Most stores; the rest go by ``_next``."""
        return used - self.quota(group) > n - 1

    def _next(self, used: list[float], storing: set[int], avail: dict[int, int], left: int
              ) -> tuple[int | None, int]:
        """The group the next victims come from by the rule, and how many in a row before the rule may change
        (at most what ``avail`` says the group can give)."""
        quota = [self.quota(g) for g in range(len(used))]
        excess = [used[g] - quota[g] for g in range(len(quota))]
        order = sorted((g for g in range(len(quota)) if avail.get(g, 1) > 0), key=lambda g: -excess[g])
        over = [g for g in order if excess[g] > 0]
        mine = [g for g in order if g in storing]
        for candidates in ([g for g in over if g in storing], over, mine):
            if candidates:
                first = candidates[0]
                run = left
                if any(g != first for g in (*over, *mine)) and candidates is not mine:
                    # Another group may be next once this one is less over (or no longer over) its quota.
                    after = excess[candidates[1]] if len(candidates) > 1 else 0.0
                    run = min(left, max(1, math.ceil(excess[first] - max(after, 0.0))))
                return first, min(run, avail.get(first, run))
        return None, 0

    def _short(self, used: list[float], storing: set[int], avail: dict[int, int], left: int) -> bool:
        """Whether the groups the rule may still take from are known to hold fewer than ``left`` keys to give."""
        quota = [self.quota(g) for g in range(len(used))]
        may = [g for g in range(len(quota)) if used[g] > quota[g] or g in storing]
        return all(g in avail for g in may) and sum(avail[g] for g in may) < left

    def _give_back(self, taken: list[tuple[int, list[OffloadKey]]]) -> None:
        """Undo ``victims``' partial work: each group that gave keys gets them back, first in its order."""
        back: dict[int, list[OffloadKey]] = {}
        for group, got in taken:
            back.setdefault(group, []).extend(got)
        for group, got in back.items():
            fresh = self._make(self.inner_size(group))
            fresh.insert_all(got + self._drain(self._inner[group]))
            self._inner[group] = fresh

    @staticmethod
    def _drain(inner: Policy) -> list[OffloadKey]:
        """All of ``inner``'s keys, in its eviction order (it is left empty)."""
        return inner.victims(len(inner), any_key) or []


PolicyOf = Callable[[EvictionPolicy, int, str], "EvictionPolicy | Policy"]
"""(kind, capacity in blocks, tier name) -> a tier's eviction policy: ``TierContext.policy``, or ``no_tenants``."""


def no_tenants(kind: EvictionPolicy, capacity: int, tier: str) -> EvictionPolicy | Policy:
    """The configured policy alone: tenants off."""
    return kind


def tier_policy(book: TenantBook | None, kind: EvictionPolicy, capacity: int, tier: str) -> EvictionPolicy | Policy:
    """A tier's eviction policy: ``kind`` alone with tenants off (``book`` None: as before tenants existed), else
    a ``TenantPolicy`` on the deployment's book with a ``kind`` policy per group. Plug-in tiers built on
    ``SlotIndex`` get tenants' shares through this (``TierContext.policy``)."""
    if book is None:
        return kind
    return TenantPolicy(capacity, book.shares, inner_policies(kind, capacity), book, tier)


SIZED_BY_QUOTA = frozenset({EvictionPolicy.S3FIFO})
"""Kinds whose inner policy is sized for the group's quota, as measured by replay (docs/planning.md): S3-FIFO's
small queue is a tenth of what it is sized for, and sized for the whole tier it held most of a 0.2-share tenant's
keys (0.82x the tenant's alone-on-its-share hit rate on the flooded Mooncake trace; 1.00x sized for its quota).
TinyLFU is sized for the tier: sized for the quota its window and sample period shrink with it and the tenants did
worse (calm synthetic trace: total hit rate 0.520 against 0.666 sized for the tier; flooded Mooncake trace:
0.97-1.03x alone against 1.05-1.30x). ARC keeps the tier's capacity (its history is bounded by what it is sized
for, and a group may hold more while share is lent); LRU and the adaptive policy are sized for the tier too."""


def inner_policies(kind: EvictionPolicy, capacity: int) -> Callable[[int], Policy]:
    """The ``make_inner`` of a ``TenantPolicy`` over a tier of ``capacity`` keys: ``kind`` per group, sized for the
    group's quota where ``SIZED_BY_QUOTA`` says so, else for the tier."""
    return functools.partial(_inner_policy, kind, capacity)


def _inner_policy(kind: EvictionPolicy, capacity: int, quota: int) -> Policy:
    return make_policy(kind, quota if kind in SIZED_BY_QUOTA else capacity)


__all__ = ["OTHER", "SHARED", "SIZED_BY_QUOTA", "PolicyOf", "TenantBook", "TenantCounts", "TenantPolicy",
           "inner_policies", "no_tenants", "tier_policy"]
