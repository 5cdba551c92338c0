"""Both connector halves driven by the simulated engine: bytes come back bit-exact, hits skip exactly the expected
tokens, bookkeeping holds after every step, and preemption, abort and failed loads stay safe."""

import random

import pytest
import torch

from kvoffload.layout import StateSpec
from kvoffload.testing import layouts, sim_workload
from kvoffload.testing.block_pool import NULL_BLOCK
from kvoffload.testing.sim import Status
from kvoffload.testing.sim_workload import run_checked, tokens
from kvoffload.transfer import host_copier as host
from kvoffload.transfer.copy_plan import LOAD, build_plan

BLOCK = 4
LAYOUTS = {
    "attention": layouts.attention_layout,
    "kv_outermost": lambda **kw: layouts.attention_layout(kv_outermost=True, **kw),
    "padded": layouts.padded_layout,
    "shared_buffer": layouts.shared_buffer_layout,
    "multi_group": layouts.multi_group_layout,
    "mamba": layouts.mamba_layout,
    "cross_layer": layouts.cross_layer_layout,
    "gdn": layouts.gdn_layout,
}


def make_engine(layout="attention", factor=1, num_blocks=48, host_blocks=256, workers=1, windows=None, **config):
    return sim_workload.make_engine(LAYOUTS[layout], block_size=BLOCK, num_blocks=num_blocks, host_blocks=host_blocks,
                                    factor=factor, workers=workers, sliding_windows=windows, **config)


def assert_drained(engine):
    """Everything done: no job in flight, no pin, and the tier empties completely on reset."""
    assert engine.scheduler.num_pending_jobs == 0
    engine.scheduler.index.check_integrity()
    engine.scheduler.reset()
    assert all(u.used_blocks == 0 for u in engine.scheduler.usage())
    assert engine.corrupt_blocks == []


def test_the_gdn_layout_is_a_gated_delta_net_state_group_beside_full_attention():
    layout, _ = layouts.gdn_layout()
    state = layout.groups[0].specs["gdn.0"]
    assert isinstance(state, StateSpec)
    assert (state.shapes, state.dtypes) == (layouts.GDN_SHAPES, layouts.GDN_DTYPES)
    assert state.page_bytes == 3 * 16 * 2 + 2 * 4 * 4 * 4 < state.padded_page_bytes


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_evicted_prefix_comes_back_bit_exact_and_skips_exactly_the_stored_tokens(layout, factor):
    engine = make_engine(layout, factor)
    prompt = tokens(40, seed=1)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()  # the device cache lost it; kvoffload still has it
    b = engine.add_request("b", prompt + tokens(8, seed=2))
    run_checked(engine)
    offload_tokens = factor * BLOCK
    expected = 40 // offload_tokens * offload_tokens
    assert b.loaded_tokens == expected
    assert b.device_hit_tokens == 0
    assert engine.verified_blocks == expected // BLOCK
    assert b.status is Status.FINISHED
    assert_drained(engine)


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("layout", ["attention", "multi_group", "mamba", "gdn"])
def test_multi_turn_chat_with_a_small_device_cache_stays_correct(layout, factor):
    engine = make_engine(layout, factor, num_blocks=40)
    rng = random.Random(7)
    history = {c: tokens(24, seed=c) for c in range(4)}
    for turn in range(4):
        for c in history:
            req = engine.add_request(f"{c}-{turn}", history[c], max_new_tokens=3)
            run_checked(engine)
            history[c] = req.all_token_ids + [rng.randrange(1000) for _ in range(8)]
    loaded = sum(r.loaded_tokens for r in engine.requests.values())
    assert loaded > 0 and engine.verified_blocks == loaded // BLOCK
    assert_drained(engine)


def test_concurrent_requests_survive_preemption():
    engine = make_engine(num_blocks=24)
    shared = tokens(16, seed=3)
    for i in range(6):
        engine.add_request(f"r{i}", shared + tokens(12, seed=10 + i), max_new_tokens=12)
    run_checked(engine)
    assert sum(r.preemptions for r in engine.requests.values()) > 0
    assert all(r.status is Status.FINISHED and r.num_new_tokens == 12 for r in engine.requests.values())
    assert_drained(engine)


def test_abort_right_after_a_load_is_safe():
    engine = make_engine()
    prompt = tokens(40, seed=4)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    engine.add_request("b", [*prompt, 1])
    engine.step()
    assert engine.requests["b"].loaded_tokens == 40  # loaded (on CPU a load is copied within its step)...
    engine.abort("b")  # ...and aborted before it computed anything
    c = engine.add_request("c", [*prompt, 2])
    run_checked(engine)
    assert c.loaded_tokens + c.device_hit_tokens == 40
    assert_drained(engine)


def test_abort_during_a_store_is_safe_and_reused_blocks_are_not_corrupted():
    engine = make_engine(num_blocks=12)
    prompt = tokens(40, seed=5)
    engine.add_request("a", prompt, max_new_tokens=5)
    engine.step()  # prefill ran; its stores are deferred to the next step
    engine.abort("a")
    engine.add_request("other", tokens(40, seed=6))  # reuses a's freed device blocks
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 3])
    run_checked(engine)
    assert b.loaded_tokens == 40
    assert_drained(engine)


# gdn: the job's first slot is its state group's, which loads only the run's last block (9 of 0-9).
@pytest.mark.parametrize(("layout", "zeroed"), [("attention", 0), ("gdn", 9)])
def test_a_corrupted_load_is_caught_by_the_bit_exact_check(layout, zeroed):
    # The control for every simulated-engine test: a load that succeeds with wrong bytes must not go unseen.
    engine = make_engine(layout, inject_load_corruption=1)
    prompt = tokens(40, seed=8)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 1])
    run_checked(engine)
    assert b.loaded_tokens == 40  # the load "succeeded"
    assert engine.corrupt_blocks == [("b", zeroed)]  # and exactly the zeroed block was caught


def test_an_injected_load_failure_is_recomputed_with_correct_bytes():
    engine = make_engine(inject_load_failures=1)
    prompt = tokens(40, seed=8)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 1])
    run_checked(engine)
    assert b.loaded_tokens == 0  # the load failed: every token was recomputed
    assert b.status is Status.FINISHED
    engine.pool.drop_cache()
    c = engine.add_request("c", [*prompt, 2])
    run_checked(engine)
    assert c.loaded_tokens == 40  # b stored its recomputed blocks again
    assert_drained(engine)


def test_two_workers_both_load_and_a_job_counts_once_both_reported():
    engine = make_engine("shared_buffer", factor=4, workers=2)
    prompt = tokens(40, seed=9)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 1])
    run_checked(engine)
    assert b.loaded_tokens == 32
    assert engine.verified_blocks == 8
    assert_drained(engine)


def test_host_tier_smaller_than_the_workload_evicts_and_stays_consistent():
    engine = make_engine(host_blocks=6, num_blocks=24)
    for i in range(8):
        engine.add_request(f"r{i}", tokens(20, seed=20 + i % 3), max_new_tokens=2)
        run_checked(engine)
    used = engine.scheduler.usage()[0]
    assert used.used_blocks <= used.capacity_blocks == 6
    assert_drained(engine)


def record_loads(engine, monkeypatch):
    """Per load, in order: the real (non-null) destination blocks the engine allocated, and the blocks copied."""
    real, copied = [], []
    block_bytes = engine.kvs[0].group_block_bytes(0)
    assert all(kv.group_block_bytes(g) == block_bytes for kv in engine.kvs for g in range(engine.num_groups))
    allocated = engine.scheduler.update_state_after_alloc

    def alloc(req, block_ids, external):
        if external:
            first, last = req.num_computed_tokens // BLOCK, (req.num_computed_tokens + external) // BLOCK
            real.append(sum(b != NULL_BLOCK for ids in block_ids for b in ids[first:last]))
        allocated(req, block_ids, external)

    def plan(layout, job):
        built = build_plan(layout, job)
        if job.transfer_type == LOAD:
            copied.append(built.nbytes // block_bytes)
        return built

    monkeypatch.setattr(engine.scheduler, "update_state_after_alloc", alloc)
    monkeypatch.setattr(host, "build_plan", plan)
    return real, copied


@pytest.mark.parametrize("factor", [1, 4])
def test_sliding_window_loads_copy_only_real_blocks_and_never_write_the_null_block(monkeypatch, factor):
    engine = make_engine("shared_buffer", factor, num_blocks=40, windows={1: 2 * BLOCK})
    real, copied = record_loads(engine, monkeypatch)
    history = {c: tokens(24, seed=30 + c) for c in range(3)}
    for turn in range(3):
        for c in history:
            req = engine.add_request(f"{c}-{turn}", history[c], max_new_tokens=3)
            run_checked(engine)  # after every step: bit-exact blocks, and the null block still holds its sentinel
            history[c] = req.all_token_ids + tokens(8, seed=100 * turn + c)
    loaded = sum(r.loaded_tokens for r in engine.requests.values())
    assert loaded > 0 and engine.verified_blocks == loaded // BLOCK
    assert copied == real
    assert sum(real) < 2 * loaded // BLOCK  # the window did drop blocks from these loads
    stats = engine.transfer_stats[0]
    assert stats.by_type["host_to_device"].bytes == sum(real) * engine.kvs[0].group_block_bytes(0)
    assert_drained(engine)


def test_a_failed_sliding_window_load_is_recomputed_whole_without_writing_the_null_block():
    engine = make_engine("shared_buffer", windows={1: 2 * BLOCK}, inject_load_failures=1)
    prompt = tokens(40, seed=8)
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 1])
    run_checked(engine)
    assert b.loaded_tokens == 0 and b.status is Status.FINISHED
    assert engine.null_block_intact()
    assert_drained(engine)



def block_bytes(engine, blocks):
    """The bytes of engine block ``blocks[g]`` of every group ``g``, on every worker (copies)."""
    return [kv.views[ref.view][blocks[g], :ref.nbytes].clone()
            for kv in engine.kvs for g in range(engine.num_groups) for ref in kv.group_refs[g]]


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("layout", ["attention", "multi_group", "cross_layer", "mamba", "gdn"])
def test_a_block_aligned_prompt_hits_fully_and_its_loaded_last_block_is_what_recomputing_writes(layout, factor):
    engine = make_engine(layout, factor)
    prompt = tokens(48, seed=11)  # 12 engine blocks: 12 or 3 offload blocks
    engine.add_request("a", prompt)
    run_checked(engine)
    engine.pool.drop_cache()
    b = engine.add_request("b", prompt)
    last: list = []  # b's last blocks, and their bytes once loaded, before the engine computes the last token

    def on_step(e):
        e.check_all()
        if b.status is Status.WAITING and b.loaded_tokens and not last:
            last.append([ids[-1] for ids in b.block_ids])
            last.append(block_bytes(e, last[0]))

    engine.run(on_step=on_step)
    assert b.status is Status.FINISHED and engine.corrupt_blocks == []
    if engine.layout.state_groups:
        # The last block's state is the state after all 48 tokens, and the engine computes token 48 again: a
        # model with state groups loads up to the block before, and computes the last block's tokens.
        assert b.loaded_tokens == 48 - factor * BLOCK
        return
    assert b.device_hit_tokens + b.loaded_tokens == 47  # vLLM's cached tokens: all but the last token
    assert engine.verified_blocks == 12  # every loaded block checked bit for bit, the last one included
    # The engine then computed the last token into the loaded last block: the same bytes as loaded.
    (blocks, loaded) = last
    assert all(map(torch.equal, loaded, block_bytes(engine, blocks)))


def test_a_wrong_last_block_of_a_full_prompt_hit_is_caught():
    # The control for the test above: the device cache holds every block but the last (it never serves a prompt's
    # last token), so kvoffload loads only the last block, and the load corrupts it.
    engine = make_engine(inject_load_corruption=1)
    prompt = tokens(48, seed=11)
    engine.add_request("a", prompt)
    run_checked(engine)
    b = engine.add_request("b", prompt)
    run_checked(engine)
    assert (b.device_hit_tokens, b.loaded_tokens) == (44, 3)
    assert engine.corrupt_blocks == [("b", 11)]
