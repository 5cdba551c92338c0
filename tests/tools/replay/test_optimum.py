"""Belady's offline optimum: equal to a brute-force optimum on small traces, never below an online policy, never
above the unbounded maximum; and wrong variants of it are caught by the same comparison."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tools.replay.traces import brute_force_hits, chained_prompts, random_chained, trace

from kvoffload.config import EvictionPolicy
from kvoffload.keys import OffloadKey
from kvoffload.tools.replay import Bound, OptimumPolicy, Trace, int_key, next_uses, replay
from kvoffload.tools.replay.optimum import NEVER


def optimum_hits(*prompts: list[int], capacity: int, policy: type[OptimumPolicy] = OptimumPolicy) -> int:
    return replay(trace(*prompts), capacity, Bound.OPTIMUM, optimum=policy).hit_blocks


def test_next_uses_gives_the_next_request_of_each_block() -> None:
    future = next_uses(trace([0, 1], [0, 2], [0, 1]))
    assert future.after == ((1, 2), (2, NEVER), (NEVER, NEVER))
    assert sorted(future.depth.values()) == [0, 1, 1]


def test_optimum_keeps_the_block_used_soonest() -> None:
    # Capacity 1. LRU keeps the latest block; the optimum keeps A (used again first) and bypasses B, C: 2 hits.
    a, b, c = [0], [1], [2]
    assert optimum_hits(a, b, a, c, a, capacity=1) == 2
    assert replay(trace(a, b, a, c, a), 1, EvictionPolicy.LRU).hit_blocks == 0


def test_optimum_evicts_the_deeper_block_of_a_chain_first() -> None:
    # After the first request both blocks are next used by request 1: a tie. With one slot, keeping the ancestor 0
    # gets a hit in requests 1 and 2. Choosing block 0 to go instead leaves nothing worth storing in request 0 (block
    # 1 is useless without its parent), and only request 2 hits.
    assert optimum_hits([0, 1], [0, 1], [0], capacity=1) == 2
    assert optimum_hits([0, 1], [0, 1], [0], capacity=1, policy=_EvictsAncestorsOnTies) == 1


def test_optimum_bypasses_a_block_used_later_than_every_resident_one() -> None:
    result = replay(trace([0], [1], [0], [0]), 1, Bound.OPTIMUM)
    assert (result.hit_blocks, result.stored_blocks, result.declined_blocks) == (2, 1, 1)


@settings(max_examples=150, deadline=None)
@given(chained_prompts(), st.integers(1, 3))
def test_optimum_equals_the_brute_force_optimum(prompts: list[list[int]], capacity: int) -> None:
    assert optimum_hits(*prompts, capacity=capacity) == brute_force_hits(trace(*prompts), capacity)


@settings(max_examples=100, deadline=None)
@given(chained_prompts(max_requests=12, max_new=4), st.integers(1, 8))
def test_optimum_is_between_every_policy_and_the_unbounded_maximum(prompts: list[list[int]], capacity: int) -> None:
    t = trace(*prompts)
    optimum = replay(t, capacity, Bound.OPTIMUM).hit_blocks
    unbounded = replay(t, capacity, Bound.UNBOUNDED).hit_blocks
    online = {policy: replay(t, capacity, policy).hit_blocks for policy in EvictionPolicy}
    assert all(hits <= optimum for hits in online.values()), (online, optimum)
    assert optimum <= unbounded


class _EvictsNearest(OptimumPolicy):
    """Wrong: evicts (and bypasses) the block used soonest."""

    def _priority(self, key: OffloadKey) -> int:
        return -super()._priority(key)


class _NeverBypasses(OptimumPolicy):
    """Wrong: stores every missed block, evicting a block needed sooner."""

    def bypass(self, keys: list[OffloadKey], free_slots: int) -> int:  # type: ignore[override]
        return len(keys)


class _EvictsAncestorsOnTies(OptimumPolicy):
    """Wrong: between equal next uses, the shallower block goes first (a chain loses its head)."""

    def _priority(self, key: OffloadKey) -> int:
        return self._next.get(key, NEVER) * self._spread - self._depth.get(key, 0)


def test_the_brute_force_comparison_catches_wrong_optimum_variants() -> None:
    rng = random.Random(12)
    cases = [(random_chained(rng, rng.randint(2, 7)), rng.randint(1, 3)) for _ in range(150)]
    expected = [brute_force_hits(trace(*prompts), capacity) for prompts, capacity in cases]
    assert [optimum_hits(*p, capacity=c) for p, c in cases] == expected
    for wrong in (_EvictsNearest, _NeverBypasses, _EvictsAncestorsOnTies):
        got = [optimum_hits(*p, capacity=c, policy=wrong) for p, c in cases]
        assert got != expected, wrong.__name__


def policy_at(t: Trace, request: int) -> OptimumPolicy:
    """The policy with every block of ``t``'s requests up to ``request`` inserted, the future as of ``request``."""
    future = next_uses(t)
    policy = OptimumPolicy(future)
    for index in range(request + 1):
        policy.advance(t.requests[index].keys, future.after[index])
        policy.insert_all(t.requests[index].keys)
    return policy


def test_victims_go_farthest_next_use_first_and_deeper_first_on_ties() -> None:
    t = trace([0, 1], [2], [0], [2], [0, 1])
    policy = policy_at(t, 1)  # next uses: 0 at 2, 1 at 4, 2 at 3
    assert policy.victims(3, lambda key: True) == [int_key(1), int_key(2), int_key(0)]
    assert len(policy) == 0
    tie = policy_at(trace([0, 1], [0, 1]), 0)
    assert tie.victims(1, lambda key: True) == [int_key(1)]


def test_advance_gives_resident_keys_their_new_future() -> None:
    t = trace([0], [1], [0], [1])
    assert policy_at(t, 1).victims(1, lambda key: True) == [int_key(1)]  # 0 is next used at 2, 1 at 3
    # Request 2 uses block 0 for the last time: from then on it goes first, even before anything touches it.
    policy = policy_at(t, 1)
    policy.advance(t.requests[2].keys, next_uses(t).after[2])
    assert policy.victims(1, lambda key: True) == [int_key(0)]


def test_refused_victims_keep_their_place_and_a_short_choice_changes_nothing() -> None:
    t = trace([0, 1, 2], [0], [0, 1])
    policy = policy_at(t, 0)  # next uses: 0 at 1, 1 at 2, 2 never
    assert policy.victims(1, lambda key: key != int_key(2)) == [int_key(1)]
    assert policy.victims(3, lambda key: True) is None
    assert (len(policy), int_key(2) in policy, int_key(1) in policy) == (2, True, False)
    policy.remove(int_key(2))
    assert policy.victims(1, lambda key: True) == [int_key(0)]
