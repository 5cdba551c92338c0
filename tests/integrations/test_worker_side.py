"""The connector's worker role driven by vLLM's own model-runner code (``KVConnectorModelRunnerMixin``), in both
of its orders: ``wait_for_save`` before the step's reports, and, as with speculative decoding, after them
(``defer_finalize``, then ``finalize_kv_connector``; vLLM 0.33's Model Runner V2 does the same in
``finalize_step``). Either way a step's store goes out at the start of the next step and is reported once. And
the report hooks: one poll per step, each hook taking its part of it once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.config import OffloadConfig
from kvoffload.connector.metadata import ConnectorMetadata, LoadJob
from kvoffload.integrations.vllm import adapters
from kvoffload.integrations.vllm.messages import KVOffloadMetadata
from kvoffload.integrations.vllm.scheduler_side import NO_JOBS
from kvoffload.integrations.vllm.worker_side import WorkerSide
from kvoffload.keys import Namespace
from kvoffload.specs import DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.testing import layouts

STORE = JobId(0)


@pytest.fixture
def connector(vllm_configs: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """A worker-role KVOffloadConnector over engine-shaped KV tensors, installed as vLLM's KV transfer group, and
    its VllmConfig."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    config, kv_cache = vllm_configs
    made = KVOffloadConnector(config, KVConnectorRole.WORKER, kv_cache)
    made.register_kv_caches(layouts.make_kv_caches(adapters.kv_cache_layout(kv_cache, "LBNHC")))
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", made)
    yield made, config
    made.shutdown()


def run_step(connector: tuple[Any, Any], meta: KVOffloadMetadata, defer_finalize: bool) -> Any:
    """One engine step as vLLM's V1 model runner calls the connector (execute_model, then sample_tokens)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Runner

    ours, config = connector
    out = SchedulerOutput.make_empty()
    out.kv_connector_metadata = meta
    ours.handle_preemptions(meta)
    with (set_forward_context(None, config),
          Runner.maybe_get_kv_connector_output(out, defer_finalize=defer_finalize) as output):
        pass  # the forward pass
    if defer_finalize:
        Runner.finalize_kv_connector()  # after the drafter ran
    return output


def completed(output: Any) -> Counter[JobId]:
    report = output.kv_connector_worker_meta
    return Counter() if report is None else Counter(report.report.completed)


@pytest.mark.parametrize("defer_finalize", [False, True], ids=["save_first", "report_first"])
def test_a_store_goes_out_at_the_next_step_and_is_reported_once(connector: tuple[Any, Any],
                                                                defer_finalize: bool) -> None:
    core = connector[0].worker.core
    submitted: list[JobId] = []
    submit = core.transfers.submit
    core.transfers.submit = lambda job: submitted.append(job.job_id) or submit(job)
    store = TransferJob(STORE, DeviceBlocks((3,), (1,)), HostBlocks((0,), (1,)))

    first = run_step(connector, KVOffloadMetadata(ConnectorMetadata(store_jobs=(store,))), defer_finalize)
    assert submitted == [] and completed(first) == Counter()  # deferred: the copy never delays sampling
    second = run_step(connector, NO_JOBS, defer_finalize)
    assert submitted == [STORE]  # the next step's first hook sent it
    core.transfers.wait([STORE])
    later = [run_step(connector, NO_JOBS, defer_finalize) for _ in range(2)]

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
    assert side.worker_meta() is None

    assert side.transfer_results().finished_recving == {"r"}  # vLLM's first report hook polls

    assert (side.take_load_errors(), side.take_load_errors()) == ({6}, set())
    stats = side.stats()
    assert stats is not None and stats.transfers.by_type["host_to_device"].failed_jobs == 1
    assert side.stats() is None
    report = side.worker_meta()
    assert report is not None and report.report.failed == {JobId(7): 1}
    assert side.worker_meta() is None
    side.shutdown()


def test_a_part_whose_hook_was_skipped_comes_with_the_next_poll_s() -> None:
    side = make_side()
    for job in (0, 1):
        side.wait_for_save(ConnectorMetadata(store_jobs=(
            TransferJob(JobId(job), DeviceBlocks((job + 2,), (1,)), HostBlocks((job,), (1,))),)))
        side.core.wait_all()
        assert side.transfer_results().finished_recving == set()

    report, stats = side.worker_meta(), side.stats()
    assert report is not None and report.report.completed == {JobId(0): 1, JobId(1): 1}
    assert stats is not None and stats.transfers.by_type["device_to_host"].jobs == 2
    side.shutdown()
