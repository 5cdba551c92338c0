"""LoadCost: a tier's speed from its recent promotions, the engine's prefill speed, and load-or-recompute."""

import pytest

from kvoffload.blocks import Medium
from kvoffload.connector.load_cost import EXPLORE_EVERY, LoadCost, LoadPolicy

BLOCK_TOKENS, BLOCK_BYTES = 32, 1 << 20  # 1 MiB per 32-token block


def cost(policy=LoadPolicy.AUTO, tps=10_000.0):
    return LoadCost(policy, BLOCK_TOKENS, BLOCK_BYTES, prefill_tokens_per_s=tps)


def test_the_fit_recovers_latency_and_bandwidth():
    c = cost()
    for blocks in (1, 2, 4, 8):  # 2 ms + 1 GB/s
        c.observe_transfer(Medium.DISK, blocks * BLOCK_BYTES, 0.002 + blocks * BLOCK_BYTES / 1e9)
    speed = c.speed(Medium.DISK)
    assert speed is not None
    assert speed.latency_s == pytest.approx(0.002, rel=1e-6)
    assert speed.bytes_per_s == pytest.approx(1e9, rel=1e-6)


def test_a_fast_tier_is_loaded_and_a_slow_one_is_skipped_and_counted():
    c = cost(tps=10_000.0)  # recomputing 8 blocks (256 tokens) takes 25.6 ms
    for blocks in (1, 8):
        c.observe_transfer(Medium.DISK, blocks * BLOCK_BYTES, 0.001 + blocks * BLOCK_BYTES / 2e9)  # 5 ms for 8
        c.observe_transfer(Medium.REMOTE, blocks * BLOCK_BYTES, 0.05 + blocks * BLOCK_BYTES / 1e8)  # 134 ms
    assert c.worth_loading(Medium.DISK, 8)
    assert not c.worth_loading(Medium.REMOTE, 8)
    assert c.skipped_blocks == 8


def test_without_samples_or_prefill_speed_it_loads_to_learn():
    assert cost().worth_loading(Medium.REMOTE, 4)
    unknown = LoadCost(LoadPolicy.AUTO, BLOCK_TOKENS, BLOCK_BYTES)
    for blocks in (1, 2):
        unknown.observe_transfer(Medium.REMOTE, blocks * BLOCK_BYTES, 10.0)
    assert unknown.worth_loading(Medium.REMOTE, 4)  # no prefill speed measured yet
    unknown.observe_step(prefill_tokens=1000, seconds=0.1)
    assert unknown.prefill_tokens_per_s == pytest.approx(10_000)
    assert not unknown.worth_loading(Medium.REMOTE, 4)


def test_a_skipped_tier_is_tried_again_now_and_then():
    c = cost()
    for blocks in (1, 2):
        c.observe_transfer(Medium.REMOTE, blocks * BLOCK_BYTES, 1.0 * blocks)
    answers = [c.worth_loading(Medium.REMOTE, 1) for _ in range(2 * EXPLORE_EVERY)]
    assert answers.count(True) == 2


def test_always_and_never_ignore_the_estimates():
    always, never = cost(LoadPolicy.ALWAYS), cost(LoadPolicy.NEVER)
    for c in (always, never):
        for blocks in (1, 2):
            c.observe_transfer(Medium.REMOTE, blocks * BLOCK_BYTES, 100.0)
    assert always.worth_loading(Medium.REMOTE, 3) and always.skipped_blocks == 0
    assert not never.worth_loading(Medium.DISK, 3) and never.skipped_blocks == 3
