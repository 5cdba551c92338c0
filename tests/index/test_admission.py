"""Store admission rules: leading counts, second sightings within a bounded memory."""

from __future__ import annotations

from collections.abc import Iterable
from zlib import crc32

import pytest

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.index.admission import (
    SIGHTING_MEMORY,
    SWITCH_MARGIN,
    AdaptiveAdmission,
    AdmitAll,
    SecondSighting,
    make_admission,
)
from kvoffload.index.policies import AdaptivePolicy, make_policy
from kvoffload.index.slot_index import SlotIndex
from kvoffload.keys import OffloadKey


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(4, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def test_make_admission_builds_every_rule() -> None:
    assert isinstance(make_admission(StoreAdmission.ALL, 8), AdmitAll)
    rule = make_admission(StoreAdmission.SECOND_SIGHTING, 8)
    assert isinstance(rule, SecondSighting) and rule._limit == SIGHTING_MEMORY * 8


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_make_admission_rejects_a_capacity_that_is_not_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        make_admission(StoreAdmission.ALL, bad)  # type: ignore[arg-type]


def test_admit_all_stores_every_block() -> None:
    assert AdmitAll().admit(keys(1, 2, 3)) == 3
    assert AdmitAll().admit([]) == 0


def test_second_sighting_declines_the_first_and_admits_the_second() -> None:
    rule = SecondSighting(16)
    assert rule.admit(keys(1, 2, 3)) == 0
    assert rule.admit(keys(1, 2, 3)) == 3
    assert rule.admit(keys(1, 2, 3)) == 3  # still remembered: a block stored and evicted is stored again


def test_second_sighting_admits_only_the_leading_seen_blocks() -> None:
    rule = SecondSighting(16)
    rule.admit(keys(1, 2))
    assert rule.admit(keys(1, 2, 3, 4)) == 2
    rule.admit(keys(5))
    # Block 5 was seen, but after block 9 that was not: a block is useless without the blocks before it.
    assert rule.admit(keys(1, 9, 5)) == 1


def test_second_sighting_forgets_the_least_recently_offered_keys_beyond_its_limit() -> None:
    rule = SecondSighting(3)
    rule.admit(keys(1, 2, 3))
    rule.admit(keys(1))  # offered again: now the most recent
    rule.admit(keys(4, 5))
    assert len(rule) == 3
    assert rule.admit(keys(1)) == 1
    assert rule.admit(keys(2)) == 0 and rule.admit(keys(3)) == 0


def test_second_sighting_rejects_a_limit_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="limit 0"):
        SecondSighting(0)


def test_make_admission_builds_the_adaptive_rule() -> None:
    assert isinstance(make_admission(StoreAdmission.ADAPTIVE, 8), AdaptiveAdmission)


def repeat_once_each(rule: AdaptiveAdmission, rounds: int, first: int = 0) -> None:
    """Prompts each used twice in a row: storing every block wins (second sightings lose every reuse)."""
    for i in range(first, first + rounds):
        prompt = keys(3 * i, 3 * i + 1, 3 * i + 2)
        for _ in range(2):
            rule.looked_up(prompt)


def one_time_floods(rule: AdaptiveAdmission, rounds: int, hot: list[OffloadKey], first: int = 10_000) -> None:
    """A hot prefix used thrice per round between floods of blocks used once, which evict it when stored."""
    for i in range(rounds):
        rule.looked_up(hot)
        rule.looked_up(keys(*range(first + 20 * i, first + 20 * i + 20)))  # twice the tier, never again
        rule.looked_up(hot)
        rule.looked_up(hot)


def test_adaptive_stores_every_block_where_reuse_comes_soon() -> None:
    rule = AdaptiveAdmission(10)
    repeat_once_each(rule, 50)
    assert rule.admits_all and rule.admit(keys(9_000, 9_001)) == 2


def test_adaptive_turns_to_second_sightings_under_one_time_floods_and_back() -> None:
    rule = AdaptiveAdmission(10)
    one_time_floods(rule, 40, keys(900_000, 900_001, 900_002))
    assert not rule.admits_all  # storing the floods evicted the hot prefix; second sightings kept it
    assert rule.admit(keys(8_000, 8_001)) == 0 and rule.admit(keys(8_000, 8_001)) == 2  # remembered meanwhile
    repeat_once_each(rule, 400, first=100_000)
    assert rule.admits_all


def test_adaptive_follows_a_sample_of_the_keys_on_a_large_tier() -> None:
    small, large = AdaptiveAdmission(100, sample_slots=1000), AdaptiveAdmission(100_000, sample_slots=1000)
    assert small._bound is None and large._bound is not None
    prompt = [OffloadKey(i.to_bytes(8, "big")) for i in range(20_000)]
    followed = sum(crc32(k) < large._bound for k in prompt)
    assert 100 <= followed <= 300  # 1% of 20,000 keys, give or take
    large.looked_up(prompt)
    every_block = large._shadows[0]
    assert every_block.admission is StoreAdmission.ALL and len(every_block._policy) == followed  # only those


def test_adaptive_rejects_a_capacity_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        AdaptiveAdmission(0)


def test_make_admission_steers_an_adaptive_policy_behind_the_configured_rule() -> None:
    policy = make_policy(EvictionPolicy.ADAPTIVE, 8)
    for kind, pairs in ((StoreAdmission.ALL, 4), (StoreAdmission.SECOND_SIGHTING, 4), (StoreAdmission.ADAPTIVE, 8)):
        rule = make_admission(kind, 8, policy)
        assert isinstance(rule, AdaptiveAdmission) and rule._steer is policy and len(rule._shadows) == pairs
    assert isinstance(make_admission(StoreAdmission.ALL, 8, make_policy(EvictionPolicy.ARC, 8)), AdmitAll)


def test_adaptive_rejects_what_it_cannot_compare_or_steer() -> None:
    with pytest.raises(ValueError, match="fixed policies and rules"):
        AdaptiveAdmission(8, admissions=(StoreAdmission.ADAPTIVE,))
    with pytest.raises(ValueError, match="fixed policies and rules"):
        AdaptiveAdmission(8, policies=())
    with pytest.raises(ValueError, match="no adaptive policy to steer"):
        AdaptiveAdmission(8, policies=(EvictionPolicy.LRU, EvictionPolicy.ARC))


def serve(tier: SlotIndex, rule: AdaptiveAdmission, blocks: Iterable[int]) -> int:
    """Requests of one block each through a real tier behind ``rule``; its hits."""
    hits = 0
    for block in blocks:
        request = keys(block)
        rule.looked_up(request)
        if tier.lookup(request).hits:
            hits += 1
            tier.prepare_load(request)
            tier.touch(request)
            tier.complete_load(request)
        elif rule.admit(request):
            out = tier.prepare_store(request)
            assert out is not None
            tier.complete_store(out.keys_to_store)
    return hits


def steered_tier(capacity: int) -> tuple[SlotIndex, AdaptiveAdmission, AdaptivePolicy]:
    tier = SlotIndex(capacity, EvictionPolicy.ADAPTIVE)
    policy = tier.host_policy
    assert isinstance(policy, AdaptivePolicy)
    rule = make_admission(StoreAdmission.ALL, capacity, policy)
    assert isinstance(rule, AdaptiveAdmission)
    return tier, rule, policy


def test_adaptive_steers_the_tier_off_lru_on_a_loop_larger_than_it() -> None:
    tier, rule, policy = steered_tier(100)
    assert policy.live is EvictionPolicy.LRU  # where it starts
    hits = serve(tier, rule, (i % 150 for i in range(150 * 20)))
    assert policy.live is not EvictionPolicy.LRU and rule.leader == (policy.live, StoreAdmission.ALL)
    assert hits > 1000  # of 3,000: the loop-resistant expert keeps part of the loop from the switch on
    tier.check_integrity()


def test_the_loop_check_fails_when_the_policy_ignores_the_steering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AdaptivePolicy, "follow", lambda self, *args: None)
    tier, rule, policy = steered_tier(100)
    assert serve(tier, rule, (i % 150 for i in range(150 * 20))) == 0 and policy.live is EvictionPolicy.LRU


def test_adaptive_keeps_its_expert_where_every_expert_hits_alike() -> None:
    _, rule, policy = steered_tier(10)
    repeat_once_each(rule, 200)
    assert policy.live is EvictionPolicy.LRU and policy.switches == 0
    best = max(rule._shadows, key=lambda s: s.score)
    assert best.score <= rule._live.score * (1 + SWITCH_MARGIN)
