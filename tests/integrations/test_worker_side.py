"""The connector's worker role driven by vLLM's own model-runner code (``KVConnectorModelRunnerMixin``), in both
of its orders: ``wait_for_save`` before the step's reports, and, as with speculative decoding, after them
(``defer_finalize``, then ``finalize_kv_connector``; vLLM 0.33's Model Runner V2 does the same in
``finalize_step``). Either way a step's store goes out at the start of the next step and is reported once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.connector.metadata import ConnectorMetadata
from kvoffload.integrations.vllm import adapters
from kvoffload.integrations.vllm.messages import KVOffloadMetadata
from kvoffload.integrations.vllm.scheduler_side import NO_JOBS
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
