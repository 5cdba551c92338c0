"""TenantPolicy: its rule (an over-share tenant evicts its own, an under-share tenant's blocks survive a flood,
unused share is lent and taken back), within-tenant order equal to the inner policy's, the policy conformance suite,
and tenants off building no TenantPolicy at all (same victims as before tenants existed)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from tests.index.workloads import key, keys

from kvoffload.config import EvictionPolicy, OffloadConfig
from kvoffload.index.policies import make_policy
from kvoffload.index.slot_index import SlotIndex
from kvoffload.index.tenants import OTHER, SHARED, TenantBook, TenantPolicy, inner_policies
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.layout import KVCacheLayout, KVGroup
from kvoffload.testing.policy_conformance import POLICY_CHECKS
from kvoffload.tiers.host.spec import PrivateHostSpec
from kvoffload.tiers.spec import TierContext

KINDS = [pytest.param(kind, id=kind.value) for kind in EvictionPolicy]


def tenant_policy(capacity: int, shares: dict[str, float], default: float,
                  kind: EvictionPolicy = EvictionPolicy.LRU, policy: type[TenantPolicy] = TenantPolicy
                  ) -> TenantPolicy:
    names = list(shares)
    return policy(capacity, [*shares.values(), default], inner_policies(kind, capacity), TenantBook(names))


def tier(capacity: int, shares: dict[str, float], default: float = 0.1,
         kind: EvictionPolicy = EvictionPolicy.LRU, policy: type[TenantPolicy] = TenantPolicy) -> SlotIndex:
    return SlotIndex(capacity, tenant_policy(capacity, shares, default, kind, policy))


def store(index: SlotIndex, tenant: str | None, ids: range | list[int]) -> list[OffloadKey] | None:
    """Store ``ids`` as ``tenant``'s, as the scheduler does; answers the evicted keys (None: refused)."""
    book = index_book(index)
    book.assign(keys(*ids), tenant)
    try:
        out = index.prepare_store(keys(*ids))
    finally:
        book.clear()
    if out is None:
        return None
    index.complete_store(out.keys_to_store)
    index.check_integrity()
    return list(out.evicted_keys)


def store_each(index: SlotIndex, tenant: str | None, ids: range | list[int]) -> list[OffloadKey]:
    """Store ``ids`` one at a time (so that they age in this order: a store's own keys enter back to front)."""
    evicted: list[OffloadKey] = []
    for i in ids:
        got = store(index, tenant, [i])
        assert got is not None
        evicted += got
    return evicted


def index_book(index: SlotIndex) -> TenantBook:
    policy = index.host_policy
    assert isinstance(policy, TenantPolicy)
    return policy.book


def resident(index: SlotIndex, ids: range | list[int]) -> int:
    return sum(index.lookup([key(i)]).hits for i in ids)


class IgnoresShares(TenantPolicy):
    """A wrong rule, for the controls: other tenants' blocks go before the storing tenant's, whatever the shares."""

    def _whole_run(self, group: int, used: int, n: int) -> bool:
        return False

    def _next(self, used: list[float], storing: set[int], avail: dict[int, int], left: int
              ) -> tuple[int | None, int]:
        order = sorted((g for g in range(len(used)) if avail.get(g, 1) > 0 and used[g] > 0),
                       key=lambda g: (g in storing, -used[g]))
        return (order[0], 1) if order else (None, 0)


# ---- the rule ------------------------------------------------------------------------------------------------


def test_a_tenant_over_its_share_evicts_its_own_blocks_first() -> None:
    index = tier(10, {"a": 0.5, "b": 0.4})
    store(index, "b", range(100, 103))
    store_each(index, "a", range(7))  # the tier is full: a holds 7 (over its 5), b 3
    evicted = store_each(index, "a", range(7, 12))
    assert evicted == keys(0, 1, 2, 3, 4)  # a's oldest, none of b's
    assert resident(index, range(100, 103)) == 3


def flood_survivors(policy: type[TenantPolicy] = TenantPolicy, kind: EvictionPolicy = EvictionPolicy.LRU) -> int:
    """b (share 0.4) stores 4 blocks, then a floods 200 blocks in stores of 3: how many of b's are resident."""
    index = tier(10, {"a": 0.5, "b": 0.4}, kind=kind, policy=policy)
    store(index, "b", range(100, 104))
    for first in range(0, 200, 3):
        assert store(index, "a", range(first, first + 3)) is not None  # quotas never refuse the flood's stores
    return resident(index, range(100, 104))


@pytest.mark.parametrize("kind", KINDS)
def test_an_under_share_tenants_blocks_survive_a_flood(kind: EvictionPolicy) -> None:
    assert flood_survivors(kind=kind) == 4


def test_control_a_rule_that_ignores_shares_lets_the_flood_evict_them() -> None:
    assert flood_survivors(IgnoresShares) < 4


def test_control_without_tenants_the_flood_evicts_them() -> None:
    index = SlotIndex(10, EvictionPolicy.LRU)
    assert index.prepare_store(keys(100, 101, 102, 103)) is not None
    for first in range(0, 200, 3):
        out = index.prepare_store(keys(*range(first, first + 3)))
        assert out is not None
        index.complete_store(out.keys_to_store)
    assert resident(index, range(100, 104)) == 0


def test_unused_share_is_lent_and_taken_back_by_eviction() -> None:
    index = tier(10, {"a": 0.4, "b": 0.4}, default=0.2)
    assert store_each(index, "a", range(10)) == []  # a fills the whole tier: b's and the others' shares are lent
    evicted = store_each(index, "b", range(100, 104))  # b, under its share, is never refused: a gives back
    assert evicted == keys(0, 1, 2, 3)
    policy = index.host_policy
    assert isinstance(policy, TenantPolicy)
    assert policy.of.get(key(100)) == 1
    assert policy.usage() == {"a": 6, "b": 4, OTHER: 0}
    # b at its share stores one more: it is over its share now, so it gives up its own oldest, not a's
    assert store(index, "b", [104]) == keys(100)


def test_the_most_over_share_tenant_gives_up_blocks_first() -> None:
    index = tier(12, {"a": 0.25, "b": 0.25, "c": 0.25}, default=0.25)  # quotas of 3
    store_each(index, "a", range(0, 4))  # a 4: over by 1
    store_each(index, "b", range(100, 108))  # b 8: over by 5; the tier is full
    assert store_each(index, "c", range(200, 203)) == keys(100, 101, 102)  # b's, the most over (then by 2)
    assert store(index, "c", [203]) == keys(200)  # c would be over its share now: its own goes
    assert store(index, "a", [4]) == keys(0)  # a is over its share too: its own, though b is more over


def test_an_under_share_tenant_is_never_evicted_for_one_over_its_share() -> None:
    index = tier(10, {"a": 0.5, "b": 0.5}, default=0.0001)
    store(index, "b", range(100, 105))
    store(index, "a", range(5))
    pins = index.prepare_load(keys(0, 1, 2, 3, 4))  # a's blocks are all being loaded: none of them may go
    assert pins is not None
    assert store(index, "a", [5]) is None  # a (at its share) would go over; b's blocks are b's
    assert resident(index, range(100, 105)) == 5


def test_keys_nobody_assigned_count_for_the_shared_tenant() -> None:
    index = tier(8, {SHARED: 0.5, "a": 0.4})
    out = index.prepare_store(keys(1, 2))
    assert out is not None
    policy = index.host_policy
    assert isinstance(policy, TenantPolicy)
    assert policy.of[key(1)] == 0 and index_book(index).names[0] == SHARED
    assert index_book(index).group("nobody-named-me") == 2 and index_book(index).group(None) == 0


# ---- within a tenant, the inner policy's order --------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_within_one_tenant_the_victims_are_the_inner_policys(kind: EvictionPolicy, seed: int) -> None:
    """All keys of one tenant (share 1 less a hair): the same operations give the same victims as the plain
    policy on a tier of the same size."""
    capacity = 16
    plain = SlotIndex(capacity, kind)
    tenants = tier(capacity, {"a": 0.99}, default=0.01, kind=kind)
    assert same_victims(plain, tenants, seed, lambda index, ids: store_as(index, "a", ids))


def store_as(index: SlotIndex, tenant: str, ids: list[int]) -> list[OffloadKey] | None:
    if isinstance(index.host_policy, TenantPolicy):
        return store(index, tenant, ids)
    out = index.prepare_store(keys(*ids))
    if out is None:
        return None
    index.complete_store(out.keys_to_store)
    return list(out.evicted_keys)


def same_victims(a: SlotIndex, b: SlotIndex, seed: int,
                 stores: Callable[[SlotIndex, list[int]], list[OffloadKey] | None]) -> bool:
    rng = random.Random(seed)
    for _ in range(300):
        ids = [rng.randrange(60) for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.4:
            hits = [k for k in keys(*ids) if a.lookup([k]).hits]
            for index in (a, b):
                index.touch(hits)
            continue
        if stores(a, ids) != stores(b, ids):
            return False
    return True


# ---- tenants off is today's behaviour -----------------------------------------------------------------------------


def host_index(config: OffloadConfig) -> SlotIndex:
    from kvoffload.layout import AttentionSpec

    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float16")
    layout = KVCacheLayout(num_blocks=32, groups=(KVGroup.uniform(["l0"], spec),))
    book = TenantBook.of_config(config.tenants) if config.tenants is not None else None
    index = PrivateHostSpec(config).make_index(TierContext(Namespace("m", "fp16", "t"), layout, 1, book))
    assert isinstance(index, SlotIndex)
    return index


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tenant_by", [None, "none"])
def test_tenants_off_builds_no_tenant_policy_and_evicts_as_before(kind: EvictionPolicy, tenant_by: str | None
                                                                    ) -> None:
    raw = {"host_bytes": 24 * 1024, "eviction_policy": kind.value}
    if tenant_by is not None:
        raw["tenant_by"] = tenant_by
    index = host_index(OffloadConfig.from_dict(raw))
    assert not isinstance(index.host_policy, TenantPolicy)
    assert type(index.host_policy) is type(make_policy(kind, 24))
    for seed in range(3):
        before = SlotIndex(24, kind)  # what the host tier built before tenants existed
        now = host_index(OffloadConfig.from_dict(raw))
        assert same_victims(before, now, seed, lambda index, ids: store_as(index, "a", ids))


def test_tenants_on_builds_a_tenant_policy_of_the_configured_shares() -> None:
    index = host_index(OffloadConfig.from_dict({
        "host_bytes": 20 * 1024, "tenant_by": "cache_salt", "tenant_quota": {"default": 0.2, "acme": 0.8}}))
    policy = index.host_policy
    assert isinstance(policy, TenantPolicy) and policy.book.names == ("acme", OTHER)
    assert [policy.quota(0), policy.quota(1)] == [16.0, 4.0]


# ---- the conformance suite ----------------------------------------------------------------------------------------


# Only one tenant at a time: with several, the rule is not the interface's (keys a tenant under its share holds are
# not victims however old, so victims(n) may be None while n keys may go), which is the point.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("check", POLICY_CHECKS, ids=lambda c: c.__name__)
def test_one_tenant_passes_the_policy_conformance_suite(check, kind: EvictionPolicy) -> None:  # type: ignore[no-untyped-def]
    check(lambda capacity: TenantPolicy(capacity, [0.5, 0.5], lambda _: make_policy(kind, capacity),
                                        TenantBook([SHARED])))


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_sized_for_its_quota_may_hold_the_whole_tier_while_share_is_lent(kind: EvictionPolicy) -> None:
    """Inner policies are sized for their group's quota (S3-FIFO) yet a lone tenant fills the whole
    tier, keeps storing (evicting its own), and gives back when another stores: each step checked."""
    index = tier(20, {"a": 0.1, "b": 0.5}, default=0.4, kind=kind)
    for first in range(0, 60, 3):
        assert store(index, "a", range(first, first + 3)) is not None  # store checks the index's integrity
    policy = index.host_policy
    assert isinstance(policy, TenantPolicy) and policy.usage()["a"] == 20
    assert policy.inner_size(0) == 2 and policy.inner_size(1) == 10
    store_each(index, "b", range(100, 110))
    assert policy.usage() == {"a": 10, "b": 10, OTHER: 0}


def test_s3fifo_groups_are_sized_for_their_quota_the_others_for_the_tier() -> None:
    from kvoffload.index.tenants import SIZED_BY_QUOTA

    make = inner_policies(EvictionPolicy.S3FIFO, 1000)
    assert make(100)._capacity == 100  # type: ignore[attr-defined]
    assert inner_policies(EvictionPolicy.ARC, 1000)(100)._capacity == 1000  # type: ignore[attr-defined]
    assert {EvictionPolicy.S3FIFO} == SIZED_BY_QUOTA
    assert inner_policies(EvictionPolicy.TINYLFU, 1000)(100)._window_target == 10  # type: ignore[attr-defined]
