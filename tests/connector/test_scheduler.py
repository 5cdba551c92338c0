"""The scheduler half on its own: jobs it builds, completions it counts, fences it raises. No tensors."""

from tests.connector.schedulers import BLOCK, SPEC, Req, complete, make_scheduler, run_prefill

from kvoffload.blocks import NO_BLOCK, DeviceBlocks, HostBlocks
from kvoffload.config import OffloadConfig
from kvoffload.connector.metadata import ConnectorMetadata, WorkerReport
from kvoffload.connector.requests import ScheduledRequest, StepSchedule
from kvoffload.connector.scheduler import ConnectorScheduler
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout, KVGroup, StateSpec


def test_full_blocks_are_stored_after_the_step_that_fills_them():
    sched = make_scheduler()
    meta = run_prefill(sched, Req("a", list(range(70))))
    (job,) = meta.store_jobs
    assert isinstance(job.src, DeviceBlocks) and isinstance(job.dst, HostBlocks)
    assert job.src.block_ids == (0, 1, 2, 3)  # 70 tokens: 4 full blocks, the 5th is partial
    assert len(job.dst.slots) == 4


def test_a_stored_prefix_is_a_hit_for_the_next_request_but_not_its_last_token():
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("a", list(range(64)))))
    b = Req("b", [*list(range(64)), 9, 9])
    assert sched.get_num_new_matched_tokens(b, 0) == (64, True)
    same = Req("c", list(range(64)))
    assert sched.get_num_new_matched_tokens(same, 0) == (63, True)  # the last token must be computed


def test_load_job_fills_the_allocated_blocks_beyond_the_engine_prefix():
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("a", list(range(64)))))
    b = Req("b", list(range(80)))
    assert sched.get_num_new_matched_tokens(b, 16) == (48, True)
    sched.update_state_after_alloc(b, [[10, 11, 12, 13, 14]], 48)
    (load,) = sched.build_connector_meta(StepSchedule.of(())).load_jobs
    assert load.req_id == "b"
    assert load.job.dst == DeviceBlocks((11, 12, 13), (3,))
    assert isinstance(load.job.src, HostBlocks) and len(load.job.src.slots) == 3


def test_factor_four_hit_may_begin_inside_an_offload_block():
    sched = make_scheduler(factor=4)
    complete(sched, run_prefill(sched, Req("a", list(range(128)))))
    b = Req("b", list(range(129)))
    # The engine already holds 2 of the first offload block's 4 sub-blocks.
    assert sched.get_num_new_matched_tokens(b, 32) == (96, True)
    sched.update_state_after_alloc(b, [list(range(20, 29))], 96)
    (load,) = sched.build_connector_meta(StepSchedule.of(())).load_jobs
    assert load.job.src.skip_sub_blocks == 2
    assert load.job.dst.block_ids == (22, 23, 24, 25, 26, 27)


def test_a_block_whose_store_is_in_flight_is_pending_not_a_hit():
    sched = make_scheduler()
    meta = run_prefill(sched, Req("a", list(range(64))))
    assert sched.get_num_new_matched_tokens(Req("b", list(range(65))), 0) == (None, False)
    complete(sched, meta)
    assert sched.get_num_new_matched_tokens(Req("c", list(range(65))), 0) == (64, True)


def test_a_job_completes_only_when_every_worker_reported_it():
    sched = make_scheduler(world_size=2)
    meta = run_prefill(sched, Req("a", list(range(64))))
    complete(sched, meta, world_size=1)
    assert sched.num_pending_jobs == 1
    complete(sched, meta, world_size=1)
    assert sched.num_pending_jobs == 0
    assert sched.get_num_new_matched_tokens(Req("b", list(range(65))), 0) == (64, True)


def test_a_store_failed_on_any_worker_is_never_indexed():
    sched = make_scheduler(world_size=2)
    meta = run_prefill(sched, Req("a", list(range(64))))
    job = meta.store_jobs[0].job_id
    sched.update_connector_output(WorkerReport.of([job], []))
    sched.update_connector_output(WorkerReport.of([], [job]))
    assert sched.get_num_new_matched_tokens(Req("b", list(range(65))), 0) == (0, False)
    sched.index.check_integrity()


def test_a_failed_load_drops_its_keys():
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("a", list(range(64)))))
    b = Req("b", list(range(65)))
    assert sched.get_num_new_matched_tokens(b, 0) == (64, True)
    sched.update_state_after_alloc(b, [list(range(10, 15))], 64)
    meta = sched.build_connector_meta(StepSchedule.of(()))
    complete(sched, meta, failed={meta.load_jobs[0].job.job_id})
    assert sched.get_num_new_matched_tokens(Req("c", list(range(65))), 0) == (0, False)
    assert sched.take_stats().failed_load_tokens == 64


def test_finishing_a_request_fences_its_stores_in_flight():
    sched = make_scheduler()
    meta = run_prefill(sched, Req("a", list(range(64))))
    sched.request_finished("a")
    fence = sched.build_connector_meta(StepSchedule.of(()))
    assert fence.jobs_to_flush == {meta.store_jobs[0].job_id}
    assert sched.build_connector_meta(StepSchedule.of(())).jobs_to_flush == frozenset()


def test_preemption_fences_and_resumed_blocks_replace_old_ones():
    sched = make_scheduler()
    a = Req("a", list(range(40)))
    meta = run_prefill(sched, a)
    fence = sched.build_connector_meta(StepSchedule.of((), frozenset({"a"})))
    assert fence.jobs_to_flush == {meta.store_jobs[0].job_id}
    a.all_token_ids.extend(range(40, 64))
    resumed = ScheduledRequest("a", ((50, 51, 52, 53),), 64, resumed=True)
    (job,) = sched.build_connector_meta(StepSchedule.of((resumed,))).store_jobs
    assert job.src.block_ids == (52, 53)  # blocks 0-1 were stored before the preemption


def test_groups_get_their_own_keys_and_device_blocks():
    sched = make_scheduler(groups=2)
    meta = run_prefill(sched, Req("a", list(range(32))), num_groups=2)
    (job,) = meta.store_jobs
    assert job.src.group_sizes == (2, 2)
    assert job.dst.group_sizes == (2, 2)
    assert len(set(job.dst.slots)) == 4


def test_stats_count_query_and_hit_tokens():
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("a", list(range(64)))))
    b = Req("b", list(range(100)))
    hit, _ = sched.get_num_new_matched_tokens(b, 0)
    sched.update_state_after_alloc(b, [list(range(10, 17))], hit)
    assert sched.has_stats()
    stats = sched.take_stats()
    assert (stats.requests, stats.query_tokens, stats.hit_tokens) == (2, 164, 64)
    assert stats.miss_tokens == 100
    assert not sched.has_stats()  # what the adapter asks every step before taking anything
    assert sched.take_stats().requests == 0


def test_offload_blocks_holding_the_engines_null_block_are_never_stored():
    sched = make_scheduler(groups=2)
    sched.null_block_id = 0
    a = Req("a", list(range(32)))
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    ids = ((0, 5), (6, 7))  # group 0's first block was dropped (a sliding window)
    sched.update_state_after_alloc(a, ids, 0)
    (job,) = sched.build_connector_meta(StepSchedule.of((ScheduledRequest("a", ids, 32),))).store_jobs
    assert job.src == DeviceBlocks((5, 6, 7), (1, 2))


def test_a_load_leaves_holes_where_a_sliding_window_group_holds_the_null_block():
    sched = make_scheduler(groups=2)
    sched.null_block_id = 0
    complete(sched, run_prefill(sched, Req("a", list(range(64))), first_block=1, num_groups=2))
    b = Req("b", list(range(80)))
    assert sched.get_num_new_matched_tokens(b, 0) == (64, True)
    # Group 1 is a sliding window: vLLM put its null block where the window no longer reaches.
    sched.update_state_after_alloc(b, [[10, 11, 12, 13, 14], [0, 0, 22, 23, 24]], 64)
    (load,) = sched.build_connector_meta(StepSchedule.of(())).load_jobs
    assert load.job.dst == DeviceBlocks((10, 11, 12, 13, NO_BLOCK, NO_BLOCK, 22, 23), (4, 4))
    assert len(load.job.src.slots) == 8  # positions kept: hole i still pairs with host slot i


def test_a_load_starting_inside_an_offload_block_keeps_holes_in_place():
    sched = make_scheduler(factor=2, groups=2)
    sched.null_block_id = 0
    complete(sched, run_prefill(sched, Req("a", list(range(64))), first_block=1, num_groups=2))
    b = Req("b", list(range(65)))
    assert sched.get_num_new_matched_tokens(b, 16) == (48, True)
    sched.update_state_after_alloc(b, [[5, 6, 7, 8, 9], [0, 0, 17, 18, 19]], 48)
    (load,) = sched.build_connector_meta(StepSchedule.of(())).load_jobs
    assert load.job.src.skip_sub_blocks == 1
    assert load.job.dst == DeviceBlocks((6, 7, 8, NO_BLOCK, 17, 18), (3, 3))


def test_a_second_alloc_without_a_lookup_is_not_counted_twice():
    sched = make_scheduler()
    a = Req("a", list(range(40)))
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, [[1, 2, 3]], 0)
    sched.update_state_after_alloc(a, [[1, 2, 3]], 0)
    stats = sched.take_stats()
    assert (stats.requests, stats.query_tokens) == (1, 40)


def test_finishing_a_request_fences_its_load_in_flight():
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("a", list(range(64)))))
    b = Req("b", list(range(65)))
    sched.get_num_new_matched_tokens(b, 0)
    sched.update_state_after_alloc(b, [list(range(10, 15))], 64)
    (load,) = sched.build_connector_meta(StepSchedule.of(())).load_jobs
    sched.request_finished("b")  # aborted while its load runs: its blocks go back to the engine
    assert sched.build_connector_meta(StepSchedule.of(())).jobs_to_flush == {load.job.job_id}
    complete(sched, ConnectorMetadata(load_jobs=(load,)))
    sched.index.check_integrity()
    assert sched.get_num_new_matched_tokens(Req("c", list(range(65))), 0) == (64, True)


def test_engines_that_rewrite_running_blocks_get_every_store_flushed_next_step():
    sched = make_scheduler()
    sched.flush_stores_next_step = True
    meta = run_prefill(sched, Req("a", list(range(64))))
    assert meta.jobs_to_flush == frozenset()
    assert sched.build_connector_meta(StepSchedule.of(())).jobs_to_flush == {meta.store_jobs[0].job_id}


def test_a_second_live_request_with_the_same_id_gets_no_hits_and_stores_nothing():
    sched = make_scheduler()
    complete(sched, run_prefill(sched, Req("x", list(range(64)))))
    sched.request_finished("x")
    first = Req("a", [*list(range(64)), 1, 1])
    assert sched.get_num_new_matched_tokens(first, 0) == (64, True)  # its hashes are now cached
    twin = Req("a", [7] * 66, extra_keys=("salt:other",))  # same id, other tokens and salt, still live
    assert sched.get_num_new_matched_tokens(twin, 0) == (0, False)  # not the first request's hits
    sched.update_state_after_alloc(twin, [list(range(5))], 0)
    step = StepSchedule.of((ScheduledRequest("a", (tuple(range(5)),), 66),))
    assert sched.build_connector_meta(step).store_jobs == ()
    sched.request_finished("a")
    again = Req("a", [*list(range(64)), 9, 9])  # the id is free again: served normally
    assert sched.get_num_new_matched_tokens(again, 0) == (64, True)


def test_a_state_group_needs_only_the_last_block_of_a_hit_and_loads_only_that_one():
    state_spec = StateSpec([(256,)], ["int8"])  # one state page per block, like a ShortConv layer's
    layout = KVCacheLayout(num_blocks=128, groups=(KVGroup.uniform(["attn.l0"], SPEC),
                                                   KVGroup.uniform(["conv.l0"], state_spec)))
    config = OffloadConfig.from_dict({"host_bytes": 64 * SPEC.page_bytes})
    sched = ConnectorScheduler(config, layout, BLOCK, Namespace("m", "fp16", layout.describe()), null_block_id=0)
    a = Req("a", list(range(64)))
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    # vLLM keeps a state only where a prefill chunk ended (here after block 2); other columns hold the null block.
    table = ([1, 2, 3, 4], [0, 0, 12, 0])
    sched.update_state_after_alloc(a, table, 0)
    complete(sched, sched.build_connector_meta(StepSchedule.of((ScheduledRequest("a", tuple(map(tuple, table)), 64),))))

    b = Req("b", [*list(range(64)), 9, 9])
    assert sched.get_num_new_matched_tokens(b, 0) == (48, True)  # attention holds 4 blocks, the state only block 2
    sched.update_state_after_alloc(b, ([20, 21, 22, 23, 24], [0, 0, 30, 0, 0]), 48)
    (load,) = sched.build_connector_meta(StepSchedule.of(())).load_jobs
    assert load.job.dst == DeviceBlocks((20, 21, 22, NO_BLOCK, NO_BLOCK, 30), (3, 3))
    assert isinstance(load.job.src, HostBlocks) and load.job.src.group_sizes == (3, 3)
    state_slots = load.job.src.slots[3:]
    assert len(set(state_slots)) == 1 and state_slots[0] not in load.job.src.slots[:3]


# ---- the columnar step: decode steps, thresholds, the aligned cache -----------------------------------------------

def decode(sched, reqs, computed, new_blocks=None, offset=0):
    """One decode step of ``reqs`` (computed tokens after it per request, less ``offset``; new blocks per request
    or None)."""
    new_blocks = new_blocks or [None] * len(reqs)
    return sched.build_connector_meta(StepSchedule([r.request_id for r in reqs], new_blocks,
                                                   [c - offset for c in computed], offset))


def stored_blocks(meta):
    return [b for job in meta.store_jobs for b in job.src.block_ids]


def test_decode_steps_store_a_block_exactly_when_it_fills_with_its_new_block_tracked():
    sched = make_scheduler()
    a, b = Req("a", list(range(20))), Req("b", list(range(100, 130)))
    run_prefill(sched, a, first_block=0)  # blocks 0, 1: block 0 stored, 20 of 32 tokens computed
    run_prefill(sched, b, first_block=10)  # blocks 10, 11: block 10 stored, 30 of 32 computed
    a.all_token_ids += [1] * 20
    b.all_token_ids += [1] * 20
    assert stored_blocks(decode(sched, [a, b], [21, 31])) == []
    assert stored_blocks(decode(sched, [a, b], [22, 32])) == [11]  # b's second block is full now
    assert stored_blocks(decode(sched, [a, b], [23, 33], [None, ((12,),)])) == []  # b got block 12
    for computed in range(24, 32):
        assert stored_blocks(decode(sched, [a, b], [computed, computed + 10])) == []
    assert stored_blocks(decode(sched, [a, b], [32, 42])) == [1]
    assert stored_blocks(decode(sched, [b, a], [48, 33])) == [12]  # another order: the columns are rebuilt


def test_a_store_limit_keeps_blocks_past_it_from_being_stored():
    sched = make_scheduler()
    a = Req("a", list(range(40)))
    sched.limit_stores(a, 40)  # e.g. a model whose states are kept only for the prompt
    run_prefill(sched, a)  # blocks 0, 1 stored; the third (tokens 32-47) would end past the limit
    a.all_token_ids += [1] * 40
    for computed in range(41, 80):
        assert stored_blocks(decode(sched, [a], [computed], [((3,),)] if computed == 49 else None)) == []


def test_a_finished_and_readmitted_id_gets_a_fresh_threshold():
    sched = make_scheduler()
    a = Req("a", list(range(20)))
    run_prefill(sched, a)
    a.all_token_ids += [1] * 20
    decode(sched, [a], [21])
    sched.request_finished("a")
    again = Req("a", list(range(200, 240)))  # the same id, a new request: its state and threshold are new
    run_prefill(sched, again, first_block=20)  # blocks 20, 21, 22: 20 and 21 stored
    again.all_token_ids += [1] * 8
    assert stored_blocks(decode(sched, [again], [48])) == [22]


def test_the_engines_count_from_before_a_decode_step_with_offset_one_stores_the_same_blocks():
    for offset in (0, 1):
        sched = make_scheduler()
        a = Req("a", list(range(20)))
        run_prefill(sched, a)
        a.all_token_ids += [1] * 20
        stored = [stored_blocks(decode(sched, [a], [n], offset=offset)) for n in range(21, 34)]
        assert stored == [[]] * 11 + [[1], []], offset  # the block fills at 32 computed tokens, not before


def test_columns_of_different_lengths_are_refused():
    import pytest

    for bad in (StepSchedule(["a", "b"], [None], [1, 2]), StepSchedule(["a"], [None], [1], 2)):
        with pytest.raises(ValueError, match="columns"):
            make_scheduler().build_connector_meta(bad)


def test_usage_is_said_to_move_only_after_calls_that_can_move_it():
    sched = make_scheduler()
    a = Req("a", list(range(40)))
    meta = run_prefill(sched, a)  # a lookup and a store: host slots reserved
    assert sched.take_usage_moved() and not sched.take_usage_moved()
    a.all_token_ids += [1]
    decode(sched, [a], [41])  # no block filled: nothing reserved or freed
    assert not sched.take_usage_moved()
    complete(sched, meta)
    assert sched.take_usage_moved()
