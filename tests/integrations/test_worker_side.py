"""The connector's worker role driven by vLLM's own model-runner code, every runner the installed vLLM has: the V1
runner's ``KVConnectorModelRunnerMixin`` (up to 0.33) and Model Runner V2's ``ActiveKVConnector`` (GPU, and the
standalone CPU runner's from 0.34), each in its orders: ``wait_for_save`` before the step's reports, and, as with
speculative decoding, after them (V1's ``defer_finalize`` then ``finalize_kv_connector``; V2's ``finalize_step``,
from 0.33). Either way a step's store goes out at the start of the next step and is reported once. And the report
hooks: one poll per step, each hook taking its part of it once."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.config import OffloadConfig
from kvoffload.connector.metadata import ConnectorMetadata, LoadJob
from kvoffload.integrations.vllm import adapters
from kvoffload.integrations.vllm.messages import KVOffloadMetadata
from kvoffload.integrations.vllm.scheduler_side import NO_JOBS
from kvoffload.integrations.vllm.worker_side import WorkerSide
from kvoffload.keys import Namespace
from kvoffload.testing import layouts

STORE = JobId(0)


RUNNERS = ["v1 save_first", "v1 report_first", "gpu save_first", "gpu report_first", "cpu save_first"]
"""Model runner and order. The V1 runner is gone from 0.34; the standalone CPU runner (0.34 on) never defers."""


def runner_step(runner: str, config: Any, made: Any, kv_caches: dict[str, Any]) -> Callable[[KVOffloadMetadata], Any]:
    """One engine step as the named model runner calls the connector (skipped where the installed vLLM lacks it)."""

    from vllm.forward_context import set_forward_context
    from vllm.v1.core.sched.output import SchedulerOutput

    kind, order = runner.split()
    defer = order == "report_first"
    if kind == "v1":
        mixin = pytest.importorskip("vllm.v1.worker.kv_connector_model_runner_mixin",
                                    reason="vLLM 0.34 removed Model Runner V1")
        made.register_kv_caches(kv_caches)
        v1 = mixin.KVConnectorModelRunnerMixin

        def v1_step(meta: KVOffloadMetadata) -> Any:
            out = SchedulerOutput.make_empty()
            out.kv_connector_metadata = meta
            made.handle_preemptions(meta)
            with (set_forward_context(None, config),
                  v1.maybe_get_kv_connector_output(out, defer_finalize=defer) as output):
                pass  # the forward pass
            if defer:
                v1.finalize_kv_connector()  # after the drafter ran
            return output
        return v1_step
    module = pytest.importorskip(f"vllm.v1.worker.{kind}.kv_connector", reason=f"no {kind} Model Runner V2")
    v2 = module.ActiveKVConnector(config, kv_caches)  # registers the KV caches, as the runner does
    if defer and "defer_finalize" not in inspect.signature(v2.post_forward).parameters:
        pytest.skip("this vLLM's Model Runner V2 never defers wait_for_save (0.33 added finalize_step)")

    def v2_step(meta: KVOffloadMetadata) -> Any:
        out = SchedulerOutput.make_empty()
        out.kv_connector_metadata = meta
        v2.pre_forward(out)  # handle_preemptions, bind
        with set_forward_context(None, config):
            v2.finish_forward()  # the forward pass
        output = v2.post_forward(set(), defer_finalize=True) if defer else v2.post_forward(set())
        if defer:
            v2.finalize_step()  # after the drafter ran
        return output
    return v2_step


@pytest.fixture(params=RUNNERS)
def step(request: pytest.FixtureRequest, vllm_configs: tuple[Any, Any],
         monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Callable[[KVOffloadMetadata], Any]]]:
    """A worker-role KVOffloadConnector over engine-shaped KV tensors, installed as vLLM's KV transfer group, and
    one engine step of the model runner ``request.param`` names."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    config, kv_cache = vllm_configs
    made = KVOffloadConnector(config, KVConnectorRole.WORKER, kv_cache)
    kv_caches = layouts.make_kv_caches(adapters.kv_cache_layout(kv_cache, "LBNHC"))
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", made)
    yield made, runner_step(request.param, config, made, kv_caches)
    made.shutdown()


def completed(output: Any) -> Counter[JobId]:
    report = output.kv_connector_worker_meta
    return Counter() if report is None else Counter(report.report.completed)


def test_a_store_goes_out_at_the_next_step_and_is_reported_once(
        step: tuple[Any, Callable[[KVOffloadMetadata], Any]]) -> None:
    connector, run_step = step
    core = connector.worker.core
    submitted: list[JobId] = []
    submit = core.transfers.submit
    core.transfers.submit = lambda job: submitted.append(job.job_id) or submit(job)
    store = TransferJob(STORE, DeviceBlocks((3,), (1,)), HostBlocks((0,), (1,)))

    first = run_step(KVOffloadMetadata(ConnectorMetadata(store_jobs=(store,))))
    assert submitted == [] and completed(first) == Counter()  # deferred: the copy never delays sampling
    second = run_step(NO_JOBS)
    assert submitted == [STORE]  # the next step's first hook sent it
    core.transfers.wait([STORE])
    later = [run_step(NO_JOBS) for _ in range(2)]

    assert sum((completed(o) for o in (second, *later)), Counter()) == Counter({STORE: 1})
    assert submitted == [STORE]


def make_side(**config: Any) -> WorkerSide:
    """A worker role over one KV-cache group (failed loads go to vLLM as block ids)."""
    layout, make_kv = layouts.attention_layout(num_blocks=8, block_size=4)
    side = WorkerSide(OffloadConfig.from_dict({"host_bytes": 1 << 20, **config}), layout, 4,
                      Namespace("m", "fp16", layout.describe()))
    side.register_kv_caches(make_kv())
    return side


def test_each_report_hook_takes_its_part_of_the_step_s_one_poll_once() -> None:
    side = make_side(inject_load_failures=1)
    load = TransferJob(JobId(7), HostBlocks((0,), (1,)), DeviceBlocks((6,), (1,)))
    side.start_load_kv(ConnectorMetadata(load_jobs=(LoadJob("r", load),)))
    side.core.wait_all()
    assert side.take_load_errors() == set() and side.stats() is None  # nothing polled yet
    assert side.report() is None

    assert side.transfer_results().finished_recving == {"r"}  # vLLM's first report hook polls

    assert (side.take_load_errors(), side.take_load_errors()) == ({6}, set())
    stats = side.stats()
    assert stats is not None and stats.transfers.by_type["host_to_device"].failed_jobs == 1
    assert side.stats() is None
    report = side.report()
    assert report is not None and report.report.failed == {JobId(7): 1}
    assert side.report() is None
    side.shutdown()


def test_a_part_whose_hook_was_skipped_comes_with_the_next_poll_s() -> None:
    side = make_side()
    for job in (0, 1):
        side.wait_for_save(ConnectorMetadata(store_jobs=(
            TransferJob(JobId(job), DeviceBlocks((job + 2,), (1,)), HostBlocks((job,), (1,))),)))
        side.core.wait_all()
        assert side.transfer_results().finished_recving == set()

    report, stats = side.report(), side.stats()
    assert report is not None and report.report.completed == {JobId(0): 1, JobId(1): 1}
    assert stats is not None and stats.transfers.by_type["device_to_host"].jobs == 2
    side.shutdown()
