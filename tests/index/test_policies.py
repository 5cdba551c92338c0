"""Eviction policies: every policy through the conformance suite; then what each one does that LRU does not (scan
and loop resistance, ARC's adaptation; S3-FIFO's ghost and TinyLFU's duels in test_policies_s3fifo.py and
test_policies_tinylfu.py), batch operations that equal key-by-key ones, and the adaptive policy's switches."""

from __future__ import annotations

import random

import pytest
from tests.index.workloads import anything, filled, key, keys, scan

from kvoffload.config import EvictionPolicy
from kvoffload.index.base import IntegrityError
from kvoffload.index.policies import (
    AdaptivePolicy,
    ARCPolicy,
    CanEvict,
    LRUPolicy,
    Policy,
    S3FIFOPolicy,
    TinyLFUPolicy,
    make_policy,
)
from kvoffload.index.policies.arc import _FAST_RUNS
from kvoffload.keys import OffloadKey
from kvoffload.testing.policy_conformance import POLICY_CHECKS, PolicyFactory, check_policy

POLICIES = [pytest.param(kind, id=kind.value) for kind in EvictionPolicy]


def factory(kind: EvictionPolicy) -> PolicyFactory:
    return lambda capacity: make_policy(kind, capacity)


def test_make_policy_builds_the_named_policy() -> None:
    assert isinstance(make_policy(EvictionPolicy.LRU), LRUPolicy)
    assert isinstance(make_policy(EvictionPolicy.ARC, 16), ARCPolicy)
    assert isinstance(make_policy(EvictionPolicy.S3FIFO, 16), S3FIFOPolicy)
    assert isinstance(make_policy(EvictionPolicy.TINYLFU, 16), TinyLFUPolicy)
    assert isinstance(make_policy(EvictionPolicy.ADAPTIVE, 16), AdaptivePolicy)


@pytest.mark.parametrize("kind", POLICIES)
def test_make_policy_rejects_non_positive_capacity(kind: EvictionPolicy) -> None:
    with pytest.raises(ValueError, match="capacity 0"):
        make_policy(kind, 0)


@pytest.mark.parametrize("kind", [EvictionPolicy.S3FIFO, EvictionPolicy.TINYLFU, EvictionPolicy.ADAPTIVE])
def test_make_policy_needs_the_capacity_of_policies_sized_by_it(kind: EvictionPolicy) -> None:
    with pytest.raises(ValueError, match="needs the tier's capacity"):
        make_policy(kind)


@pytest.mark.parametrize("kind", POLICIES)
@pytest.mark.parametrize("check", POLICY_CHECKS, ids=lambda c: c.__name__)
def test_every_policy_passes_the_conformance_check(check, kind: EvictionPolicy) -> None:  # type: ignore[no-untyped-def]
    check(factory(kind))


def test_arc_without_a_capacity_conforms() -> None:
    check_policy(lambda capacity: ARCPolicy())


def test_lru_touch_moves_a_key_to_the_back() -> None:
    policy = filled(LRUPolicy(), 1, 2, 3)
    policy.touch(key(1))
    assert policy.victims(3, anything) == keys(2, 3, 1)


def test_lru_reinsert_counts_as_a_use() -> None:
    policy = filled(LRUPolicy(), 1, 2)
    policy.insert(key(1))
    assert len(policy) == 2
    assert policy.victims(1, anything) == keys(2)


SCAN_RESISTANT = [pytest.param(kind, id=kind.value) for kind in EvictionPolicy
                  if kind not in (EvictionPolicy.LRU, EvictionPolicy.ADAPTIVE)]
"""The adaptive policy is LRU until its shadow tiers steer it (test_admission.py)."""


@pytest.mark.parametrize("kind", SCAN_RESISTANT)
def test_a_one_time_scan_flushes_lrus_used_keys_but_not_theirs(kind: EvictionPolicy) -> None:
    for policy, survive in ((LRUPolicy(), False), (make_policy(kind, 10), True)):
        filled(policy, *range(1, 6))
        policy.touch_all(keys(1, 2))
        scan(policy, 10, range(100, 140))
        assert (key(1) in policy and key(2) in policy) is survive, type(policy).__name__
        policy.check_integrity()


def loop_hits(policy: Policy, capacity: int, loop: int, rounds: int) -> int:
    """Hits of a tier of ``capacity`` keys used in a loop over ``loop`` keys (one miss stores the key)."""
    hits = 0
    for i in range(loop * rounds):
        k = key(i % loop)
        if k in policy:
            policy.touch(k)
            hits += 1
            continue
        if len(policy) == capacity:
            assert policy.victims(1, anything) is not None
        policy.insert(k)
    return hits


@pytest.mark.parametrize("kind", [EvictionPolicy.S3FIFO, EvictionPolicy.TINYLFU])
def test_a_loop_larger_than_the_tier_never_hits_in_lru_but_does_in_theirs(kind: EvictionPolicy) -> None:
    assert loop_hits(LRUPolicy(), 100, 150, 6) == 0
    assert loop_hits(make_policy(kind, 100), 100, 150, 6) > 150


def test_arc_used_keys_outlive_recent_ones() -> None:
    policy = filled(ARCPolicy(4), 1, 2, 3)
    policy.touch(key(1))
    assert policy.victims(3, anything) == keys(2, 3, 1)


def test_arc_ghost_hit_in_recent_history_grows_the_recent_target() -> None:
    policy = ARCPolicy(4)
    scan(policy, 4, range(8))
    assert policy.target_recent == 0
    policy.victims(1, anything)
    policy.insert(key(4))  # evicted earlier, still remembered in B1
    assert policy.target_recent >= 1
    assert key(4) in policy
    policy.check_integrity()


def test_arc_ghost_hit_in_frequent_history_shrinks_the_recent_target() -> None:
    policy = filled(ARCPolicy(4), 1, 2)
    for k in keys(1, 2):
        policy.touch(k)
    assert policy.victims(2, anything) == keys(1, 2)  # out of T2, into B2
    filled(policy, 3)
    assert policy.victims(1, anything) == keys(3)  # into B1
    policy.insert(key(3))  # B1 hit: target up
    grown = policy.target_recent
    policy.insert(key(1))  # B2 hit: target down
    assert policy.target_recent < grown
    policy.check_integrity()


def test_arc_remove_forgets_without_history() -> None:
    policy = filled(ARCPolicy(4), 1)
    policy.remove(key(1))
    policy.insert(key(1))  # a brand-new key again: recent list, target unchanged
    assert policy.target_recent == 0


@pytest.mark.parametrize("capacity", [None, 3])
def test_arc_history_stays_bounded_under_random_use(capacity: int | None) -> None:
    rng = random.Random(7)
    policy = ARCPolicy(capacity)
    for _ in range(2000):
        k = key(rng.randrange(12))
        op = rng.random()
        if op < 0.5 and k not in policy:
            if len(policy) == 3:
                policy.victims(1, lambda c: rng.random() < 0.8)  # may refuse all: then no insert
            if len(policy) < 3:
                policy.insert(k)
        elif op < 0.8:
            policy.touch(k)
        else:
            policy.remove(k)
        policy.check_integrity()
    assert len(policy) <= 3


def test_arc_check_integrity_raises_on_a_key_in_two_lists() -> None:
    policy = filled(ARCPolicy(4), 1, 2)
    policy.touch(key(1))
    policy._t1[key(1)] = None  # corrupt on purpose: key 1 is now in T1 and T2
    with pytest.raises(IntegrityError, match="two of"):
        policy.check_integrity()


def snapshot(policy: Policy) -> tuple[object, ...]:
    """Everything a policy's later choices depend on: its lists in order (and ARC's target)."""
    if isinstance(policy, LRUPolicy):
        return (list(policy._order),)
    assert isinstance(policy, ARCPolicy)
    return list(policy._t1), list(policy._t2), list(policy._b1), list(policy._b2), policy.target_recent


def twins(new, rng: random.Random) -> tuple[Policy, Policy]:  # type: ignore[no-untyped-def]
    """Two policies in the same random state: keys 0-15 resident, some used twice, some evicted into history."""
    pair = (new(), new())
    ids = list(range(16))
    rng.shuffle(ids)
    used, evicted = ids[:6], rng.randrange(5)
    for policy in pair:
        filled(policy, *ids)
        for i in used:
            policy.touch(key(i))
        policy.victims(evicted, anything)
        filled(policy, *range(16, 16 + evicted))
    assert snapshot(pair[0]) == snapshot(pair[1])
    return pair


def touch_each(policy: Policy, ks: list[OffloadKey]) -> None:
    for k in ks:
        policy.touch(k)


@pytest.mark.parametrize("new", [LRUPolicy, lambda: ARCPolicy(16)], ids=["lru", "arc"])
@pytest.mark.parametrize("seed", range(10))
def test_touch_all_is_touch_key_by_key(new, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    batch, single = twins(new, rng)
    for _ in range(30):
        # Keys 0-29: resident, in history, or unknown; runs of neighbours as well as scattered keys and repeats.
        start = rng.randrange(30)
        ks = keys(*(range(start, start + rng.randrange(12)) if rng.random() < 0.5 else
                    [rng.randrange(30) for _ in range(rng.randrange(12))]))
        batch.touch_all(iter(ks))
        touch_each(single, ks)
        assert snapshot(batch) == snapshot(single)
        batch.check_integrity()


@pytest.mark.parametrize("new", [LRUPolicy, lambda: ARCPolicy(64)], ids=["lru", "arc"])
def test_touch_all_of_frequent_keys_alternating_with_others_is_touch_key_by_key(new) -> None:  # type: ignore[no-untyped-def]
    # More alternations than ARC's fast runs, so that its key-by-key tail runs too; odd keys are recent, or
    # (from 100) not resident at all.
    batch, single = filled(new(), *range(64)), filled(new(), *range(64))
    frequent = keys(*range(0, 64, 2))
    touch_each(batch, frequent)
    touch_each(single, frequent)
    ks = [k for i in range(2 * _FAST_RUNS + 4) for k in (key(2 * i), key(2 * i + (1 if i % 3 else 101)))]
    batch.touch_all(ks)
    touch_each(single, ks)
    assert snapshot(batch) == snapshot(single)
    batch.check_integrity()


def refusing(refused: set[OffloadKey]) -> CanEvict:
    return lambda k: k not in refused


def churned(rng: random.Random, steps: int) -> list[ARCPolicy]:
    """ARC(16) states along one random run of inserts, uses, evictions and removals over keys 0-39 (so keys
    come back from history and move ARC's target both ways)."""
    policy, states = ARCPolicy(16), []
    for _ in range(steps):
        k, op = key(rng.randrange(40)), rng.random()
        if op < 0.5 and k not in policy:
            if len(policy) == 16:
                policy.victims(rng.randrange(1, 4), anything)
            policy.insert(k)
        elif op < 0.9:
            policy.touch(k)
        else:
            policy.remove(k)
        states.append(arc_copy(policy))
    return states


def arc_copy(policy: ARCPolicy) -> ARCPolicy:
    clone = ARCPolicy(policy._capacity)
    clone._t1, clone._t2 = policy._t1.copy(), policy._t2.copy()
    clone._b1, clone._b2, clone._p = policy._b1.copy(), policy._b2.copy(), policy._p
    return clone


@pytest.mark.parametrize("seed", range(5))
def test_arc_victims_from_one_list_are_the_key_by_key_choice(seed: int) -> None:
    # ``victims`` takes its fast paths (all from T1, all from T2) whenever it can; ``_victims_mixed`` is the
    # key-by-key REPLACE. Same keys, same lists afterwards, same refusals (a refused key keeps its place).
    rng = random.Random(seed)
    for state in churned(rng, 300):
        twin = arc_copy(state)
        may_go = refusing({k for k in state._t1.keys() | state._t2.keys() if rng.random() < 0.2})
        n = rng.randrange(1, 8)
        assert state.victims(n, may_go) == twin._victims_mixed(n, may_go)
        assert snapshot(state) == snapshot(twin)
        state.check_integrity()


@pytest.mark.parametrize("new", [LRUPolicy, lambda: ARCPolicy(16)], ids=["lru", "arc"])
@pytest.mark.parametrize("seed", range(5))
def test_insert_all_is_insert_key_by_key(new, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    batch, single = twins(new, rng)
    for _ in range(20):
        # Resident keys (a use), keys in ARC's history, new keys and repeats; then room for the next batch.
        ks = keys(*(rng.randrange(30) for _ in range(rng.randrange(6))))
        batch.insert_all(iter(ks))
        for k in ks:
            single.insert(k)
        assert snapshot(batch) == snapshot(single)
        batch.check_integrity()
        extra = max(0, len(batch) - 16)
        assert batch.victims(extra, anything) == single.victims(extra, anything)


def test_the_adaptive_policy_is_lru_until_it_follows_another_expert() -> None:
    policy = make_policy(EvictionPolicy.ADAPTIVE, 100)
    assert isinstance(policy, AdaptivePolicy) and policy.live is EvictionPolicy.LRU
    assert loop_hits(policy, 100, 150, 4) == 0  # LRU's: a loop over more keys than the tier never hits
    policy.follow(EvictionPolicy.S3FIFO)
    assert policy.live is EvictionPolicy.S3FIFO and policy.switches == 1
    assert loop_hits(policy, 100, 150, 6) > 150  # S3-FIFO's: part of the loop stays
    policy.check_integrity()


def test_following_an_expert_keeps_every_resident_key_in_its_eviction_order() -> None:
    policy = make_policy(EvictionPolicy.ADAPTIVE, 8)
    assert isinstance(policy, AdaptivePolicy)
    filled(policy, 1, 2, 3, 4)
    policy.touch(key(1))
    policy.follow(EvictionPolicy.ARC)
    policy.follow(EvictionPolicy.ARC)  # already live: nothing moves
    assert policy.switches == 1 and len(policy) == 4 and all(key(i) in policy for i in (1, 2, 3, 4))
    assert policy.victims(4, anything) == keys(2, 3, 4, 1)  # LRU's order, handed over


def test_the_adaptive_policy_follows_only_its_experts() -> None:
    policy = make_policy(EvictionPolicy.ADAPTIVE, 8)
    assert isinstance(policy, AdaptivePolicy)
    with pytest.raises(ValueError, match="not one of its experts"):
        policy.follow(EvictionPolicy.ADAPTIVE)
