"""The connector across a release of the KV cache's pages, called the way vLLM's worker calls it (0.33's sleep,
0.34's extensible KV cache): ``get_kv_transfer_group().unregister_kv_caches()`` before the pages go,
``restore_kv_caches()`` once fresh ones are mapped. What the release failed reaches vLLM in the next step's
reports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.blocks import DeviceBlocks, HostBlocks, JobId, TransferJob
from kvoffload.connector.metadata import ConnectorMetadata, LoadJob
from kvoffload.integrations.vllm import adapters
from kvoffload.integrations.vllm.messages import KVOffloadMetadata
from kvoffload.integrations.vllm.scheduler_side import NO_JOBS
from kvoffload.testing import layouts


@pytest.fixture
def connector(vllm_configs: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A worker-role KVOffloadConnector over engine-shaped KV tensors, installed as vLLM's KV transfer group."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    config, kv_cache = vllm_configs
    made = KVOffloadConnector(config, KVConnectorRole.WORKER, kv_cache)
    made.register_kv_caches(layouts.make_kv_caches(adapters.kv_cache_layout(kv_cache, "LBNHC")))
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", made)
    yield made
    made.shutdown()


def step(connector: Any, meta: KVOffloadMetadata) -> tuple[Any, Any]:
    """One engine step's hooks, forward pass left out; the step's transfer results and worker report."""
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    connector.wait_for_save()
    results = connector.get_transfer_results(set())
    report = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return results, report


def release() -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    get_kv_transfer_group().unregister_kv_caches()
    get_kv_transfer_group().restore_kv_caches()


def test_what_a_release_cut_short_is_reported_failed_at_the_next_step(connector: Any) -> None:
    store = TransferJob(JobId(0), DeviceBlocks((3,), (1,)), HostBlocks((0,), (1,)))
    load = TransferJob(JobId(1), HostBlocks((1,), (1,)), DeviceBlocks((5,), (1,)))
    # The load is copied and the store deferred, but vLLM asks for the step's reports only after the release.
    connector.bind_connector_metadata(
        KVOffloadMetadata(ConnectorMetadata(load_jobs=(LoadJob("r", load),), store_jobs=(store,))))
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.clear_connector_metadata()

    release()
    results, report = step(connector, NO_JOBS)

    assert results.finished_recving == {"r"}
    assert connector.get_block_ids_with_load_errors() == {5}
    assert report is not None and report.report.failed == {0: 1, 1: 1} and report.report.completed == {}


def test_a_store_after_the_release_completes(connector: Any) -> None:
    release()
    store = TransferJob(JobId(0), DeviceBlocks((3,), (1,)), HostBlocks((0,), (1,)))

    step(connector, KVOffloadMetadata(ConnectorMetadata(store_jobs=(store,))))
    connector.worker.core.wait_all()
    _, report = step(connector, NO_JOBS)

    assert report is not None and report.report.completed == {0: 1} and report.report.failed == {}
