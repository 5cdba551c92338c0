"""A gated-delta-net hybrid (Qwen3-Next-like state layers beside full attention) in the simulated engine: state
blocks come back from kvoffload bit-exact, alone and in a multi-turn workload, and a wrong one is caught."""

import random

import pytest

from kvoffload.config import OffloadConfig
from kvoffload.layout import StateSpec
from kvoffload.testing.layouts import GDN_DTYPES, GDN_SHAPES, gdn_layout
from kvoffload.testing.sim import SimEngine, Status

BLOCK = 4


def make_engine(factor: int = 1, num_blocks: int = 48, **config: object) -> SimEngine:
    layout, make_kv = gdn_layout(num_blocks=num_blocks, block_size=BLOCK)
    slot = factor * max(layout.group_block_bytes(g) for g in range(len(layout.groups)))
    raw = {"offload_block_tokens": factor * BLOCK, "host_bytes": 256 * slot, **config}
    return SimEngine(layout, make_kv, OffloadConfig.from_dict(raw), block_size=BLOCK)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def run_checked(engine: SimEngine) -> None:
    engine.run(on_step=lambda e: e.check_all())


def test_the_layout_is_a_gdn_state_group_beside_full_attention() -> None:
    layout, _ = gdn_layout()
    state = layout.groups[0].specs["gdn.0"]
    assert isinstance(state, StateSpec)
    assert (state.shapes, state.dtypes) == (GDN_SHAPES, GDN_DTYPES)
    assert state.page_bytes == 3 * 16 * 2 + 2 * 4 * 4 * 4 < state.padded_page_bytes


@pytest.mark.parametrize("factor", [1, 4])
def test_evicted_prefix_state_and_attention_blocks_come_back_bit_exact(factor: int) -> None:
    engine = make_engine(factor)
    prompt = tokens(40, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", prompt + tokens(8, seed=2))
    run_checked(engine)
    expected = 40 // (factor * BLOCK) * factor * BLOCK
    assert b.loaded_tokens == expected and b.device_hit_tokens == 0
    assert engine.verified_blocks == expected // BLOCK
    assert b.status is Status.FINISHED and engine.corrupt_blocks == []


def test_multi_turn_chat_with_a_small_device_cache_stays_bit_exact() -> None:
    engine = make_engine(num_blocks=40)
    rng = random.Random(7)
    history = {c: tokens(24, seed=c) for c in range(4)}
    for turn in range(4):
        for c in history:
            req = engine.add_request(f"{c}-{turn}", history[c], max_new_tokens=3)
            run_checked(engine)
            history[c] = req.all_token_ids + [rng.randrange(1000) for _ in range(8)]
    loaded = sum(r.loaded_tokens for r in engine.requests.values())
    assert loaded > 0 and engine.verified_blocks == loaded // BLOCK
    assert engine.corrupt_blocks == []


def test_a_corrupted_state_load_is_caught() -> None:
    # The control: a load that succeeds with its first block zeroed (group 0: a GDN state block) must not go unseen.
    engine = make_engine(inject_load_corruption=1)
    prompt = tokens(40, seed=8)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 1])
    run_checked(engine)
    assert b.loaded_tokens == 40
    assert engine.corrupt_blocks == [("b", 0)]
