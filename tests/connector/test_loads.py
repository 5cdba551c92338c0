"""Where a hit ends and which device blocks its load writes: a prompt whose last offload block is full loads that
block too, leaving the engine only the last token to compute (not with state groups). No tensors."""

import pytest
from tests.connector.schedulers import BLOCK, SPEC, Req, complete, make_scheduler, run_prefill

from kvoffload.blocks import NO_BLOCK, DeviceBlocks, HostBlocks
from kvoffload.config import OffloadConfig
from kvoffload.connector.requests import ScheduledRequest, StepSchedule
from kvoffload.connector.scheduler import ConnectorScheduler
from kvoffload.keys import Namespace
from kvoffload.layout import AttentionSpec, KVCacheLayout, KVGroup, StateSpec


def stored(sched, tokens, groups=1):
    """``sched`` with a prompt of ``tokens`` stored and indexed (its blocks from 1 on: 0 is the null block)."""
    complete(sched, run_prefill(sched, Req("a", tokens), first_block=1, num_groups=groups))
    return sched


def load_of(sched, req, block_ids, external):
    sched.update_state_after_alloc(req, block_ids, external)
    (load,) = sched.build_connector_meta(StepSchedule.of(())).load_jobs
    return load.job


def test_a_full_prompt_hit_loads_every_block_and_leaves_only_the_last_token():
    sched = stored(make_scheduler(), list(range(64)))
    b = Req("b", list(range(64)))
    assert sched.get_num_new_matched_tokens(b, 0) == (63, True)
    # vLLM allocates blocks for the 63 tokens: the fourth holds token 62, so it is allocated and loaded whole.
    job = load_of(sched, b, [[10, 11, 12, 13]], 63)
    assert job.dst == DeviceBlocks((10, 11, 12, 13), (4,))
    assert isinstance(job.src, HostBlocks) and len(job.src.slots) == 4
    assert sched.take_stats().hit_tokens == 63


def test_a_full_prompt_hit_after_the_engines_own_prefix_loads_only_the_last_block():
    sched = stored(make_scheduler(), list(range(64)))
    b = Req("b", list(range(64)))
    assert sched.get_num_new_matched_tokens(b, 48) == (15, True)  # the device cache stops before the last token
    assert load_of(sched, b, [[20, 21, 22, 13]], 15).dst == DeviceBlocks((13,), (1,))


def test_a_full_prompt_hit_with_offload_blocks_of_two_engine_blocks_loads_the_last_one_whole():
    sched = stored(make_scheduler(factor=2), list(range(64)))
    assert sched.get_num_new_matched_tokens(Req("b", list(range(64))), 0) == (63, True)
    c = Req("c", list(range(64)))
    assert sched.get_num_new_matched_tokens(c, 16) == (47, True)  # the engine holds the first sub-block
    job = load_of(sched, c, [[20, 11, 12, 13]], 47)
    assert job.src.skip_sub_blocks == 1
    assert job.dst == DeviceBlocks((11, 12, 13), (3,))


def test_a_prompt_ending_inside_an_offload_block_never_loads_that_block():
    sched = stored(make_scheduler(factor=2), list(range(64)))
    assert sched.get_num_new_matched_tokens(Req("b", list(range(48))), 0) == (32, True)


def test_a_full_prompt_hit_of_a_sliding_window_group_loads_its_last_block_beside_the_null_block():
    sched = make_scheduler(groups=2)
    sched.null_block_id = 0
    stored(sched, list(range(64)), groups=2)
    b = Req("b", list(range(64)))
    assert sched.get_num_new_matched_tokens(b, 0) == (63, True)
    job = load_of(sched, b, [[10, 11, 12, 13], [0, 0, 22, 23]], 63)
    assert job.dst == DeviceBlocks((10, 11, 12, 13, NO_BLOCK, NO_BLOCK, 22, 23), (4, 4))


def test_a_model_with_a_state_group_stops_a_full_prompt_hit_before_the_last_block():
    state_spec = StateSpec([(256,)], ["int8"])
    layout = KVCacheLayout(num_blocks=128, groups=(KVGroup.uniform(["attn.l0"], SPEC),
                                                   KVGroup.uniform(["conv.l0"], state_spec)))
    config = OffloadConfig.from_dict({"host_bytes": 64 * SPEC.page_bytes})
    sched = ConnectorScheduler(config, layout, BLOCK, Namespace("m", "fp16", layout.describe()), null_block_id=0)
    a = Req("a", list(range(64)))
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    table = ((1, 2, 3, 4), (11, 12, 13, 14))  # a state after every block, the last one's included
    sched.update_state_after_alloc(a, table, 0)
    complete(sched, sched.build_connector_meta(StepSchedule.of((ScheduledRequest("a", table, 64),))))

    b = Req("b", list(range(64)))
    # Block 3's state is the state after token 63, which the engine must compute again: loading it would count
    # that token twice. The hit ends with block 2's state, and the engine computes block 3's tokens.
    assert sched.get_num_new_matched_tokens(b, 0) == (48, True)
    job = load_of(sched, b, ([20, 21, 22, 23], [0, 0, 30, 31]), 48)
    assert job.dst == DeviceBlocks((20, 21, 22, NO_BLOCK, NO_BLOCK, 30), (3, 3))
    c = Req("c", list(range(64)))
    assert sched.get_num_new_matched_tokens(c, 0) == (48, True)
    with pytest.raises(ValueError, match="took 32 external tokens of a hit of 48"):
        sched.update_state_after_alloc(c, ([40, 41], [0, 50]), 32)  # a state after 48 tokens serves no fewer


def test_a_hit_the_engine_cut_back_to_an_engine_block_loads_only_the_blocks_it_took():
    sched = stored(make_scheduler(), list(range(64)))
    b = Req("b", list(range(64)))
    assert sched.get_num_new_matched_tokens(b, 0) == (63, True)
    job = load_of(sched, b, [[10, 11, 12]], 48)  # vLLM under DeepSeek V4's bounded replay: ext % block_size cut
    assert job.dst == DeviceBlocks((10, 11, 12), (3,)) and len(job.src.slots) == 3
    sched.index.check_integrity()


def test_an_engine_taking_more_than_the_hit_is_refused():
    sched = stored(make_scheduler(), list(range(64)))
    b = Req("b", list(range(64)))
    sched.get_num_new_matched_tokens(b, 0)
    with pytest.raises(ValueError, match="'b': the engine took 64 external tokens of a hit of 63"):
        sched.update_state_after_alloc(b, [[10, 11, 12, 13]], 64)


def test_one_token_engine_blocks_leave_the_unallocated_last_one_a_hole():
    spec = AttentionSpec(block_size=1, num_kv_heads=2, head_size=8, dtype="float16")
    layout = KVCacheLayout(num_blocks=128, groups=(KVGroup.uniform(["l0"], spec),))
    config = OffloadConfig.from_dict({"offload_block_tokens": 4, "host_bytes": 64 * 4 * spec.page_bytes})
    sched = ConnectorScheduler(config, layout, 1, Namespace("m", "fp16", layout.describe()))
    a = Req("a", list(range(8)))
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, [list(range(1, 9))], 0)
    complete(sched, sched.build_connector_meta(StepSchedule.of((ScheduledRequest("a", (tuple(range(1, 9)),), 8),))))
    b = Req("b", list(range(8)))
    assert sched.get_num_new_matched_tokens(b, 0) == (7, True)
    # 7 tokens take 7 one-token blocks: the eighth, holding only the last token, was never allocated.
    job = load_of(sched, b, [list(range(20, 27))], 7)
    assert job.dst == DeviceBlocks((*range(20, 27), NO_BLOCK), (8,))


def test_a_failed_load_counts_the_tokens_the_engine_recomputes():
    sched = stored(make_scheduler(factor=4), list(range(128)))
    b = Req("b", list(range(128)))
    assert sched.get_num_new_matched_tokens(b, 32) == (95, True)  # 2 sub-blocks held, the last token computed
    sched.update_state_after_alloc(b, [list(range(20, 28))], 95)
    meta = sched.build_connector_meta(StepSchedule.of(()))
    complete(sched, meta, failed={meta.load_jobs[0].job.job_id})
    stats = sched.take_stats()
    assert stats.hit_tokens == stats.failed_load_tokens == 95  # not the two offload blocks' 128
