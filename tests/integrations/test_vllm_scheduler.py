"""kvoffload under vLLM's real scheduler (scheduler_harness.py): prefix hits after vLLM's own prefix cache is
emptied, preemption and resumption, and aborts while a store or a load is under way (speculative decoding, hybrid
models and vLLM 0.34's load cap: test_vllm_scheduler_layouts.py). Each test checks the hits (vLLM's
``num_external_cached_tokens``, kvoffload's stats), that every byte the stand-in forward pass read back is what
recomputing would have written, and the outputs; the controls show those checks failing on a deliberately wrong
load or a missing fence.

No engine and no model run: the same file runs on vLLM 0.31 and 0.32 (CPU builds) and on 0.33 and 0.34, which have
no CPU build (``.venv-vllm034/bin/python -m pytest tests/integrations/test_vllm_scheduler.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.scheduler_harness import (
    Engine,
    Engines,
    assert_served_right,
    store_then_reset,
    tokens,
    write_model_config,
)
from vllm.v1.request import RequestStatus

from kvoffload.blocks import DeviceBlocks
from kvoffload.integrations.vllm import compat

BLOCK = 16


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


# ---- the KV cache released and recommitted (vLLM 0.33's sleep mode, 0.34's extensible KV cache) --------------


def release_and_recommit(engine: Engine) -> None:
    """What vLLM does around a release of the KV cache's memory: ``unregister_kv_caches`` while the pages still
    hold their bytes, the pages replaced by fresh zeroed ones at the same addresses, the device prefix cache
    forgotten (every running request preempted), then ``restore_kv_caches``."""
    engine.worker.unregister_kv_caches()
    for layer in engine.model.layers:
        layer.pages.zero_()
    engine.reset_prefix_cache(preempt_running=True)
    engine.worker.restore_kv_caches()


@pytest.mark.parametrize("hooks", ["kvoffload's", "no-ops"])
def test_stores_deferred_across_a_release_of_the_kv_cache_never_publish_the_new_pages(
        build: Engines, monkeypatch: pytest.MonkeyPatch, hooks: str) -> None:
    """a's prefill fills four blocks, whose store is deferred to the next step; the KV cache is released and
    recommitted before that step. With kvoffload's hooks the deferred store fails and a later request loads only
    blocks stored after the restore; with the hooks as no-ops (what kvoffload inherited from vLLM's base class) the
    store copies the zeroed pages and publishes them, and the byte comparison catches the loads of them (the
    control)."""
    engine = build()
    if hooks == "no-ops":
        monkeypatch.setattr(engine.worker, "unregister_kv_caches", lambda: None)
        monkeypatch.setattr(engine.worker, "restore_kv_caches", lambda: None)
    prompt = tokens(7, 70)
    engine.add_request("a", prompt, 10)
    engine.step()  # 64 prompt tokens computed: four full blocks, stored at the next step
    release_and_recommit(engine)
    engine.run()
    for req_id, seed in (("b", 8), ("c", 9)):  # b stores the prefix if nobody did after the restore; c loads it
        engine.reset_prefix_cache()
        engine.add_request(req_id, prompt[:64] + tokens(seed, 9), 6)
        engine.run()

    assert engine.preempted == {"a"}
    if hooks == "no-ops":
        assert engine.wrong and engine.records["b"].output != engine.expected("b")
        return
    assert engine.records["c"].external_cached_tokens == 64
    assert_served_right(engine, "a", "b", "c")


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
    from kvoffload.blocks import HostBlocks
    from kvoffload.integrations.vllm import connector
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
        from kvoffload.transfer.host_copier import HostCopier

        self.submitted: list[tuple[Any, Any]] = []  # loads submitted in this step
        self.in_flight: list[tuple[Any, Any]] = []  # loads that finish at the next poll
        submit, wait, poll = HostCopier.submit, HostCopier.wait, ConnectorWorker.get_finished

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
        monkeypatch.setattr(ConnectorWorker, "get_finished", late_poll)

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
