"""Eviction policies: victim order, atomicity, refused keys, ARC scan resistance and adaptation."""

from __future__ import annotations

import random

import pytest

from kvoffload.config import EvictionPolicy
from kvoffload.keys import OffloadKey
from kvoffload.manager.base import IntegrityError
from kvoffload.manager.policies import ARCPolicy, CanEvict, LRUPolicy, Policy, make_policy
from kvoffload.manager.policies.arc import _FAST_RUNS


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


BOTH = [pytest.param(LRUPolicy, id="lru"), pytest.param(lambda: ARCPolicy(8), id="arc")]


def test_make_policy_builds_the_named_policy() -> None:
    assert isinstance(make_policy(EvictionPolicy.LRU), LRUPolicy)
    assert isinstance(make_policy(EvictionPolicy.ARC, 16), ARCPolicy)


def test_make_policy_rejects_non_positive_capacity() -> None:
    with pytest.raises(ValueError, match="capacity 0"):
        make_policy(EvictionPolicy.ARC, 0)


@pytest.mark.parametrize("new", BOTH)
def test_victims_come_oldest_first_and_stop_being_resident(new) -> None:
    policy = filled(new(), 1, 2, 3)
    assert policy.victims(2, anything) == keys(1, 2)
    assert len(policy) == 1
    assert key(1) not in policy and key(3) in policy


@pytest.mark.parametrize("new", BOTH)
def test_victims_is_atomic_when_too_few_keys_may_go(new) -> None:
    policy = filled(new(), 1, 2, 3)
    assert policy.victims(3, lambda k: k != key(2)) is None
    assert len(policy) == 3
    assert policy.victims(3, anything) == keys(1, 2, 3)


@pytest.mark.parametrize("new", BOTH)
def test_refused_keys_are_skipped_and_keep_their_place(new) -> None:
    policy = filled(new(), 1, 2, 3)
    assert policy.victims(1, lambda k: k != key(1)) == keys(2)
    assert policy.victims(1, anything) == keys(1)


@pytest.mark.parametrize("new", BOTH)
def test_zero_victims_is_an_empty_list(new) -> None:
    assert filled(new(), 1).victims(0, anything) == []
    assert new().victims(0, anything) == []


@pytest.mark.parametrize("new", BOTH)
def test_removed_and_unknown_keys(new) -> None:
    policy = filled(new(), 1, 2)
    policy.remove(key(1))
    policy.remove(key(9))
    policy.touch(key(9))
    assert len(policy) == 1 and key(1) not in policy
    assert policy.victims(2, anything) is None


def test_lru_touch_moves_a_key_to_the_back() -> None:
    policy = filled(LRUPolicy(), 1, 2, 3)
    policy.touch(key(1))
    assert policy.victims(3, anything) == keys(2, 3, 1)


def test_lru_reinsert_counts_as_a_use() -> None:
    policy = filled(LRUPolicy(), 1, 2)
    policy.insert(key(1))
    assert len(policy) == 2
    assert policy.victims(1, anything) == keys(2)


def scan(policy: Policy, capacity: int, ids: range) -> None:
    """Insert each key once, evicting one resident key per insert when full (what a tier does)."""
    for i in ids:
        if len(policy) == capacity:
            assert policy.victims(1, anything) is not None
        policy.insert(key(i))


def test_a_scan_flushes_lru_but_not_arcs_frequent_keys() -> None:
    for policy in (LRUPolicy(), ARCPolicy(4)):
        filled(policy, 1, 2)
        policy.touch(key(1))
        policy.touch(key(2))
        scan(policy, 4, range(100, 120))
        survivors = {k for k in keys(1, 2) if k in policy}
        assert survivors == (set() if isinstance(policy, LRUPolicy) else set(keys(1, 2)))


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
