"""kvoffload under vLLM's real scheduler (scheduler_harness.py): prefix hits after vLLM's own prefix cache is
emptied, preemption and resumption, aborts while a store or a load is under way, speculative decoding with
rejected drafts, sliding-window and state (Mamba-style) hybrids, and vLLM 0.34's ``--max-num-inflight-kv-loads``.
Each test checks the hits (vLLM's ``num_external_cached_tokens``, kvoffload's stats), that every byte the stand-in
forward pass read back is what recomputing would have written, and the outputs; the controls show those checks
failing on a deliberately wrong load or answer.

No engine and no model run; the same file runs on vLLM 0.32 (the CPU build) and on 0.33 and 0.34, which have no
CPU build (``.venv-vllm034/bin/python -m pytest tests/integrations/test_vllm_scheduler.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.scheduler_harness import (
    VOCAB,
    Engine,
    full_attention,
    hybrid_state,
    hybrid_window,
    make_engine,
    mix,
    write_model_config,
)
from vllm.config import SchedulerConfig
from vllm.v1.kv_cache_interface import KVCacheSpec
from vllm.v1.request import RequestStatus

from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.messages import KVOffloadMetadata
from kvoffload.specs import NO_BLOCK, DeviceBlocks

BLOCK = 16


class Engines:
    """Builds a test's engines (``make_engine`` over one model directory) and shuts them all down (``close``)."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.made: list[Engine] = []

    def __call__(self, specs: Mapping[str, KVCacheSpec] | None = None, **config: Any) -> Engine:
        self.made.append(make_engine(self.model, specs or full_attention(2), **config))
        return self.made[-1]

    def close(self) -> None:
        for engine in self.made:
            engine.shutdown()


def tokens(seed: int, count: int) -> list[int]:
    """``count`` deterministic token ids; different seeds share no prefix."""
    return [mix(seed, i) % VOCAB for i in range(count)]


def assert_served_right(engine: Engine, *req_ids: str) -> None:
    """Every byte read back was what recomputing writes, and each request finished with the reference output."""
    assert engine.wrong == []
    for req_id in req_ids:
        record = engine.records[req_id]
        assert record.finish_reason is not None, req_id
        assert record.output == engine.expected(req_id), req_id


def store_then_reset(engine: Engine, prompts: Mapping[str, Sequence[int]], max_tokens: int = 6) -> None:
    """Serve ``prompts`` (kvoffload stores their blocks), then empty vLLM's device prefix cache."""
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, max_tokens)
    engine.run()
    engine.reset_prefix_cache()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("model"))


@pytest.fixture
def build(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engines]:
    """Engines on vLLM's scheduler, shut down after the test (also on releases the adapter does not yet declare
    tested: that refusal is compat.py's business, not this test's)."""
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    engines = Engines(model_dir)
    yield engines
    engines.close()


# ---- hits ------------------------------------------------------------------------------------------------------


def test_a_prefix_stored_by_one_request_is_loaded_for_the_next_once_vllms_prefix_cache_is_emptied(
        build: Engines) -> None:
    engine = build()
    first = tokens(1, 70)
    store_then_reset(engine, {"a": first})
    engine.add_request("b", first[:64] + tokens(2, 9), 6)
    engine.run()
    assert engine.records["b"].external_cached_tokens == 64  # four full blocks, from kvoffload's host tier
    assert engine.records["b"].local_cached_tokens == 0
    assert engine.stats.lookups.hit_tokens == engine.external_hits == 64
    assert engine.stats.transfers.by_type["host_to_device"].bytes > 0
    assert_served_right(engine, "a", "b")


def test_requests_admitted_together_share_the_loaded_prefix(build: Engines) -> None:
    engine = build(max_num_seqs=4)
    shared = tokens(3, 48)
    store_then_reset(engine, {"a": shared + tokens(4, 20)})
    for i in range(4):
        engine.add_request(f"r{i}", shared + tokens(10 + i, 5 + i), 5)
    engine.run()
    assert all(engine.records[f"r{i}"].external_cached_tokens == 48 for i in range(4))
    assert_served_right(engine, "a", *(f"r{i}" for i in range(4)))


def test_the_control_a_corrupted_load_is_caught_by_the_byte_comparison_and_changes_the_output(
        build: Engines) -> None:
    """The workload of the first test with kvoffload's ``inject_load_corruption``: the first load zeroes a host
    block. The hit is the same; the bytes read back and the outputs are not."""
    engine = build(extra={"inject_load_corruption": 1})
    first = tokens(1, 70)
    store_then_reset(engine, {"a": first})
    engine.add_request("b", first[:64] + tokens(2, 9), 6)
    engine.run()
    assert engine.records["b"].external_cached_tokens == 64
    assert {w.req_id for w in engine.wrong} == {"b"}
    assert {w.reason for w in engine.wrong} == {"differs"}
    assert {w.position // BLOCK for w in engine.wrong} == {0}  # the zeroed block, the load's first
    assert engine.records["b"].output != engine.expected("b")
    assert engine.records["a"].output == engine.expected("a")


# ---- preemption ------------------------------------------------------------------------------------------------


def test_requests_preempted_by_vllms_reset_resume_from_kvoffload(build: Engines) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts every running request and empties the device
    cache: the resumed requests find their computed blocks, prompt and output, in kvoffload."""
    engine = build(max_num_seqs=2)
    engine.add_request("a", tokens(5, 40), 40)
    engine.add_request("b", tokens(6, 50), 40)
    while len(engine.records["a"].output) < 30:
        engine.step()
    engine.reset_prefix_cache(preempt_running=True)
    engine.run()
    assert engine.preempted == {"a", "b"}
    # Each resumes from its last full block (a: 40 + 30 tokens or more computed, so at least 64).
    assert engine.external_hits >= 64 + 64
    assert_served_right(engine, "a", "b")


def test_requests_preempted_for_lack_of_device_blocks_resume_with_the_right_kv(build: Engines) -> None:
    """A device cache too small for every running request's decode: vLLM preempts, and a preempted request's
    freed blocks are taken by others, so it resumes from kvoffload or by recomputing, never from a stale block."""
    engine = build(num_blocks=17, max_num_seqs=4, max_model_len=128)
    for i in range(4):
        engine.add_request(f"r{i}", tokens(20 + i, 40), 40)
    engine.run()
    assert engine.preempted
    assert engine.external_hits > 0
    assert_served_right(engine, *(f"r{i}" for i in range(4)))


# ---- aborts ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2], ids=["store-deferred", "store-submitted"])
def test_a_request_aborted_while_its_blocks_are_being_stored_leaves_only_right_blocks(build: Engines,
                                                                                      steps: int) -> None:
    """Aborted once its prefill filled four blocks (their store is deferred to the next step), or a step later
    (the store then runs in the background): the next request takes those blocks at once, and what kvoffload
    stored from them is a's KV, never x's."""
    engine = build(num_blocks=12, max_num_batched_tokens=128, max_model_len=128)
    prompt = tokens(7, 64)
    engine.add_request("a", prompt + tokens(8, 4), 10)
    engine.run_steps(steps)
    engine.abort("a")
    engine.add_request("x", tokens(9, 124), 2)  # 8 of the 11 blocks: takes blocks a freed in this step
    x_step = engine.step()
    assert set(x_step.scheduled_new_reqs[0].block_ids[0]) & {1, 2, 3, 4}  # a's prompt blocks
    engine.run()
    engine.reset_prefix_cache()
    engine.add_request("b", prompt + tokens(10, 3), 4)
    engine.run()
    assert "a" not in engine.scheduler.requests
    assert engine.records["b"].external_cached_tokens == 64
    assert_served_right(engine, "x", "b")


def test_the_control_without_the_fence_a_late_store_carries_the_next_requests_kv(
        build: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """The abort above with the fence taken away (the workers see no ``jobs_to_flush``) and a's store held back
    until x's forward pass has run: kvoffload then stores x's KV under a's keys, and b's load reads it back."""
    from kvoffload.integrations.vllm import connector
    from kvoffload.specs import HostBlocks
    from kvoffload.transfer.host_copier import HostCopier

    meta, submit = connector._meta, HostCopier.submit
    monkeypatch.setattr(connector, "_meta", lambda m: dataclasses.replace(meta(m), jobs_to_flush=frozenset()))
    held: list[tuple[HostCopier, Any]] = []

    def hold_stores(copier: HostCopier, job: Any) -> bool:
        if isinstance(job.dst, HostBlocks):
            held.append((copier, job))
            return True
        return submit(copier, job)

    monkeypatch.setattr(HostCopier, "submit", hold_stores)
    engine = build(num_blocks=12, max_num_batched_tokens=128, max_model_len=128)
    prompt = tokens(7, 64)
    engine.add_request("a", prompt + tokens(8, 4), 10)
    engine.step()
    engine.abort("a")
    engine.add_request("x", tokens(9, 124), 2)
    engine.step()  # submits a's store (held back) and runs x's forward pass over blocks a freed
    monkeypatch.setattr(HostCopier, "submit", submit)
    for copier, job in held:
        submit(copier, job)
    engine.run()
    engine.reset_prefix_cache()
    engine.add_request("b", prompt + tokens(10, 3), 4)
    engine.run()
    assert engine.records["b"].external_cached_tokens == 64
    assert engine.wrong and {w.req_id for w in engine.wrong} == {"b"}
    assert engine.records["b"].output != engine.expected("b")


class LateLoads:
    """Makes a load finish at the worker's poll one step after the step that submitted it, as on a GPU copy
    stream it may, instead of inside ``submit`` as kvoffload's CPU copier does; a ``wait`` (the fence) for it
    finishes it at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvoffload.connector.worker import ConnectorWorker
        from kvoffload.specs import DeviceBlocks
        from kvoffload.transfer.host_copier import HostCopier

        self.submitted: list[tuple[Any, Any]] = []  # loads submitted in this step
        self.in_flight: list[tuple[Any, Any]] = []  # loads that finish at the next poll
        submit, wait, poll = HostCopier.submit, HostCopier.wait, ConnectorWorker.poll

        def late_submit(copier: Any, job: Any) -> bool:
            if not isinstance(job.dst, DeviceBlocks):
                return submit(copier, job)
            self.submitted.append((copier, job))
            return True

        def fence(copier: Any, job_ids: Any) -> None:
            self._finish(submit, lambda job: job.job_id in job_ids)
            wait(copier, job_ids)

        def late_poll(worker: Any) -> Any:
            self._finish(submit, lambda job: any(job is j for _, j in self.in_flight))
            self.in_flight, self.submitted = self.submitted, []
            return poll(worker)

        monkeypatch.setattr(HostCopier, "submit", late_submit)
        monkeypatch.setattr(HostCopier, "wait", fence)
        monkeypatch.setattr(ConnectorWorker, "poll", late_poll)

    def _finish(self, submit: Any, due: Any) -> None:
        for queue in (self.in_flight, self.submitted):
            for item in [item for item in queue if due(item[1])]:
                queue.remove(item)
                submit(*item)  # kvoffload's CPU copier copies a load inside submit


def test_a_request_aborted_while_its_load_is_in_flight_keeps_its_blocks_until_the_load_is_reported(
        build: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM frees an aborted request's blocks only once the connector reports its load finished; kvoffload reports
    it, so x, which needs those blocks, is admitted a step later and sees only its own KV."""
    loads = LateLoads(monkeypatch)
    engine = build(num_blocks=12, max_num_batched_tokens=128, max_model_len=128)
    prompt = tokens(11, 80)
    store_then_reset(engine, {"a": prompt})
    engine.add_request("b", prompt + tokens(12, 5), 6)
    engine.step()  # starts b's load after the forward pass; it finishes at the next step's poll
    assert engine.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = [job for _, job in loads.in_flight]
    engine.abort("b")
    engine.add_request("x", tokens(13, 124), 4)  # 8 of the 11 blocks: b's too
    assert engine.step().num_scheduled_tokens == {}  # b's blocks are held while its load runs
    x_step = engine.step()
    assert set(x_step.scheduled_new_reqs[0].block_ids[0]) & set(load.dst.block_ids)
    engine.run()
    engine.add_request("c", prompt + tokens(14, 2), 6)
    engine.run()
    assert engine.records["c"].external_cached_tokens == 80
    assert_served_right(engine, "a", "x", "c")


# ---- speculative decoding --------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def flawed_drafter(engine: Engine, req_id: str) -> list[int]:
    """Proposes the model's own next three tokens with one wrong (the second or the third, alternately), so each
    verification accepts some drafts and rejects the rest. Stands in for vLLM's n-gram proposer, which the
    stand-in model's tokens would never match."""
    known = list(engine.scheduler.requests[req_id].all_token_ids)
    drafts = engine.model.reference(known, 3)
    wrong = 1 if len(known) % 2 else 2
    drafts[wrong] = (drafts[wrong] + 1) % VOCAB
    return drafts


def test_a_block_filled_while_speculating_is_stored_only_with_the_accepted_tokens_kv(build: Engines) -> None:
    """a's prompt ends four tokens before a block boundary, so the step that verifies its first drafts fills
    block 3 and leaves a rejected draft's KV in it; kvoffload must store that block only once a later step
    recomputed the position. After vLLM's prefix cache is emptied, b starts with a's first four blocks."""
    engine = build(speculative=NGRAM)
    engine.drafter = flawed_drafter
    prompt = tokens(30, 60)
    engine.add_request("a", prompt, 20)
    engine.step()  # the prefill, and the first drafts
    verify = engine.step()
    assert verify.num_scheduled_tokens == {"a": 4}  # positions 60-63: a token and three drafts
    # The sharpness of this test: position 62 holds the KV of the rejected draft, in block 3, for now.
    assert {w.position for w in engine.kv_differences("a", range(60, 63))} == {62}
    engine.run()
    engine.reset_prefix_cache()
    engine.add_request("b", prompt + engine.records["a"].output[:6] + tokens(31, 5), 4)
    engine.run()
    drafted, accepted = engine.drafts
    assert 0 < accepted < drafted  # drafts were verified, some accepted, some rejected
    assert engine.records["b"].external_cached_tokens == 64  # block 3 (tokens 48-63) too
    assert_served_right(engine, "a", "b")


# ---- hybrid layouts --------------------------------------------------------------------------------------------


def test_a_sliding_window_model_loads_the_window_and_every_full_attention_block(build: Engines) -> None:
    engine = build(hybrid_window(4, window=32))
    assert len(engine.scheduler.kv_cache_config.kv_cache_groups) == 2
    prompt = tokens(40, 100)
    store_then_reset(engine, {"a": prompt}, max_tokens=10)
    engine.add_request("b", prompt[:96] + tokens(41, 7), 8)
    meta = engine.step().kv_connector_metadata
    assert isinstance(meta, KVOffloadMetadata)
    (load,) = meta.meta.load_jobs
    assert isinstance(load.job.dst, DeviceBlocks)
    window_blocks, full_blocks = load.job.dst.block_ids[:6], load.job.dst.block_ids[6:]
    assert window_blocks[:4] == (NO_BLOCK,) * 4 and NO_BLOCK not in window_blocks[4:]  # the window's two blocks
    assert NO_BLOCK not in full_blocks
    engine.run()
    assert engine.records["b"].external_cached_tokens == 96
    assert_served_right(engine, "a", "b")


def serve_state_model(engine: Engine) -> None:
    """Chunks of two 32-token blocks leave a state at tokens 64 and 128 (vLLM keeps a state only where a chunk
    ends); b starts with a's first 128 tokens."""
    prompt = tokens(50, 150)
    store_then_reset(engine, {"a": prompt})
    engine.add_request("b", prompt[:128] + tokens(51, 7), 6)
    engine.run()


def test_a_state_model_loads_the_state_where_the_prefix_ends_and_the_attention_blocks(build: Engines) -> None:
    engine = build(hybrid_state(4), max_num_batched_tokens=64)
    assert engine.model.block_size == 32
    serve_state_model(engine)
    assert engine.records["b"].external_cached_tokens == 128
    assert_served_right(engine, "a", "b")


def test_the_control_a_corrupted_state_load_is_caught_by_the_byte_comparison(build: Engines) -> None:
    engine = build(hybrid_state(4), max_num_batched_tokens=64, extra={"inject_load_corruption": 1})
    serve_state_model(engine)
    assert engine.records["b"].external_cached_tokens == 128
    assert engine.wrong and {w.layer for w in engine.wrong} <= {"model.layers.0.mixer", "model.layers.2.mixer"}
    assert {(w.req_id, w.position, w.reason) for w in engine.wrong} == {("b", 127, "differs")}


# ---- vLLM 0.34's cap on loads in flight ------------------------------------------------------------------------

needs_inflight_cap = pytest.mark.skipif(
    "max_num_inflight_kv_loads" not in {f.name for f in dataclasses.fields(SchedulerConfig)},
    reason="this vLLM has no --max-num-inflight-kv-loads (vLLM 0.34 added it)")


def start_capped_loads(engine: Engine) -> dict[str, int]:
    """Two stored prefixes, then x1 and x2 (each a hit) and y (no hit) arrive together; one step, under a cap of
    one load in flight: returns the step's scheduled tokens."""
    p1, p2 = tokens(60, 64), tokens(61, 64)
    store_then_reset(engine, {"a1": p1, "a2": p2}, max_tokens=2)
    engine.add_request("x1", p1 + tokens(62, 3), 4)
    engine.add_request("x2", p2 + tokens(63, 3), 4)
    engine.add_request("y", tokens(64, 20), 4)
    return dict(engine.step().num_scheduled_tokens)


@needs_inflight_cap
def test_a_hit_past_the_inflight_load_cap_waits_without_holding_back_other_requests(build: Engines) -> None:
    engine = build(scheduler={"max_num_inflight_kv_loads": 1})
    scheduled = start_capped_loads(engine)
    status = {r: engine.scheduler.requests[r].status for r in ("x1", "x2")}
    assert status == {"x1": RequestStatus.WAITING_FOR_REMOTE_KVS, "x2": RequestStatus.WAITING}
    assert scheduled == {"y": 20}
    engine.run()
    assert engine.records["x1"].external_cached_tokens == engine.records["x2"].external_cached_tokens == 64
    assert_served_right(engine, "x1", "x2", "y")


@needs_inflight_cap
def test_the_control_a_hit_vllm_is_told_will_not_load_async_holds_back_the_whole_waiting_queue(
        build: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``may_load_async`` answering no, x2 waits in vLLM's plain waiting queue, and a load past the cap there
    ends the step's whole waiting scan: y is not admitted."""
    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    monkeypatch.setattr(KVOffloadConnector, "may_load_async", lambda self, request: False)
    engine = build(scheduler={"max_num_inflight_kv_loads": 1})
    assert "y" not in start_capped_loads(engine)
