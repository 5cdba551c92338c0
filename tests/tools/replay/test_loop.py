"""The replay loop: hit counting (the partial last block), stores, evictions, waste, and prompts larger than
the tier, on hand-worked traces through the real manager."""

from __future__ import annotations

import pytest
from tests.tools.replay.traces import BLOCK, trace

from kvoffload.config import EvictionPolicy
from kvoffload.tools.replay import Bound, replay


def test_a_hit_on_a_partial_last_block_counts_only_its_tokens() -> None:
    # Two blocks of 4 tokens, the second holding 2: the repeat hits both blocks but 6 tokens, not 8.
    result = replay(trace([0, 1], [0, 1], lengths=[6, 6]), 8)
    assert (result.hit_blocks, result.hit_tokens, result.input_tokens) == (2, 6, 12)
    assert result.token_hit_rate == 0.5
    assert result.block_hit_rate == 0.5


def test_a_lookup_hits_only_the_leading_run() -> None:
    # Block 1 is evicted (LRU, 2 slots): the third request finds 0 and stops at 1, although 2 is resident.
    result = replay(trace([0, 1], [0, 2], [0, 1, 2]), 2)
    assert result.hit_blocks == 1 + 1


def test_a_block_evicted_before_any_read_counts_as_waste() -> None:
    result = replay(trace([0], [1], [1]), 1, EvictionPolicy.LRU)
    assert (result.stored_blocks, result.evicted_blocks, result.wasted_blocks, result.hit_blocks) == (2, 1, 1, 1)
    assert result.unread_blocks == 0
    assert result.waste == 0.5


def test_a_prompt_longer_than_the_tier_stores_its_leading_part() -> None:
    result = replay(trace([0, 1, 2], [0, 1, 2]), 2, EvictionPolicy.LRU)
    # Request 0 stores 0 and 1, declines 2; request 1 hits both, then stores 2 by evicting 1 (LRU: after the touch,
    # block 0 is the most recent), which was read: no waste, and 2 is left unread.
    assert (result.stored_blocks, result.declined_blocks, result.hit_blocks) == (3, 1, 2)
    assert (result.evicted_blocks, result.wasted_blocks, result.unread_blocks) == (1, 0, 1)


def test_unbounded_never_evicts_and_ignores_the_capacity() -> None:
    t = trace([0, 1], [2, 3], [0, 1], [2, 3])
    result = replay(t, 1, Bound.UNBOUNDED)
    assert (result.capacity_blocks, result.evicted_blocks, result.hit_blocks) == (4, 0, 4)
    assert replay(t, 1).hit_blocks == 0


def test_bytes_count_whole_blocks() -> None:
    result = replay(trace([0, 1], [0, 1], lengths=[6, 6]), 8)
    assert result.loaded_bytes(10) == 2 * BLOCK * 10
    assert result.stored_bytes(10) == 2 * BLOCK * 10
    assert result.to_dict(10)["loaded_bytes"] == 80
    assert "loaded_bytes" not in result.to_dict()


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_every_policy_replays_through_the_manager(policy: EvictionPolicy) -> None:
    t = trace([0, 1, 2], [0, 1, 3], [4], [0, 1, 2], [5, 6], [0, 1])
    result = replay(t, 3, policy)
    assert result.strategy == policy.value
    assert 0 < result.hit_blocks <= replay(t, 3, Bound.OPTIMUM).hit_blocks


def test_replay_refuses_a_capacity_below_one_block() -> None:
    with pytest.raises(ValueError, match="capacity 0 blocks"):
        replay(trace([0]), 0)
