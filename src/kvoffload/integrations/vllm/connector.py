"""``KVOffloadConnector``: kvoffload as a vLLM KV connector (tested with vLLM 0.31 to 0.34: compat.py).

vLLM builds one instance per role: the scheduler role (``SchedulerSide``, in the process that runs vLLM's
scheduler) and the worker role (``WorkerSide``, in every worker process). This class only parses the
configuration, describes the KV cache, and forwards each vLLM hook to the side that owns it; the two sides
talk only through the metadata vLLM carries between them (``KVOffloadMetadata`` down,
``KVOffloadWorkerReport`` up).

Configuration: ``kv_connector_extra_config`` goes to ``OffloadConfig.from_dict`` and nowhere else; a bad key
stops start-up with one ``ConfigError`` naming every culprit, as does an ``offload_block_tokens`` that is not
a multiple of vLLM's block size. Hybrid models (several KV-cache groups) are supported (``SupportsHMA``);
state layers only where their blocks can be restored (``adapters.check_state_layers``), else start-up stops
with ``UnsupportedKVCacheError``. A vLLM outside the tested releases stops it with ``UntestedVLLMError``
(``compat.require_tested_vllm``) unless ``KVOFFLOAD_ALLOW_UNTESTED_VLLM=1``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm import adapters, compat, logs
from kvoffload.integrations.vllm.events import GroupKinds
from kvoffload.integrations.vllm.messages import KVOffloadMetadata, KVOffloadWorkerReport
from kvoffload.integrations.vllm.metrics import KVOffloadPromMetrics, KVOffloadStats
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.integrations.vllm.worker_side import WorkerSide
from kvoffload.tiers.sizing import offload_factor

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVOffloadConnector(compat.VersionHooks, KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        logs.join_vllm_logging()  # first: vLLM has configured logging in this process by now
        compat.require_tested_vllm(compat.installed_vllm_version(), os.environ)
        super().__init__(vllm_config, role, kv_cache_config)
        config = OffloadConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config)
        adapters.check_state_layers(vllm_config, kv_cache_config)
        layout_name = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
        layout = adapters.kv_cache_layout(kv_cache_config, layout_name)
        block_size = adapters.engine_block_size(kv_cache_config, vllm_config.cache_config.block_size)
        offload_factor(config, block_size)  # raises ConfigError now, not at the first request
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            events = vllm_config.kv_events_config
            publish = bool(events is not None and events.enable_kv_cache_events)
            ns = adapters.namespace(vllm_config, layout, config, 0)
            self._scheduler = SchedulerSide(config, layout, block_size, ns, publish,
                                            adapters.blocks_change_while_running(kv_cache_config),
                                            adapters.stores_prompt_blocks_only(kv_cache_config),
                                            GroupKinds(kv_cache_config))
        else:
            rank = _worker_rank()
            self._worker = WorkerSide(config, layout, block_size,
                                      adapters.namespace(vllm_config, layout, config, rank))
        logger.info("kvoffload %s role: %d KV-cache group(s), block size %d, offload block %d tokens",
                    role.name.lower(), len(layout.groups), block_size,
                    (config.offload_block_tokens or block_size))

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store dropped by a preemption is a future miss, never wrong output.
        return False

    # ---- worker role ---------------------------------------------------------------------------------------

    @property
    def worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side hook called on the scheduler-role KVOffloadConnector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    # vLLM 0.33 added these two, called around sleep mode only (which compat.VersionHooks refuses); 0.34 also
    # calls them without it, when its extensible KV cache releases the pages (release_kv_cache_memory, a process
    # checkpoint, a weight update borrowing their memory). vLLM 0.31 and 0.32 never call them.

    def unregister_kv_caches(self) -> None:
        """Before the pages go (they still hold their bytes): no job reads or writes them after this returns."""
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """Fresh pages at the same addresses: device jobs run again."""
        self.worker.restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(_meta(kv_connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(_meta(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: vLLM schedules a request only once its load finished."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Stores copy whole blocks at the start of the next step, not per layer."""

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(_meta(self._get_connector_metadata()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVOffloadWorkerReport | None:
        return self._worker.report() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.core.close()

    # ---- scheduler role ------------------------------------------------------------------------------------

    @property
    def scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side hook called on the worker-role KVOffloadConnector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        # vLLM 0.34, with --max-num-inflight-kv-loads only: a request said to load asynchronously waits in vLLM's
        # queue of such requests, where a load past the cap holds back only that queue; one said not to, whose
        # lookup then hits, ends the whole waiting scan of the step when past the cap. So yes exactly when its
        # first block is in a tier now (SchedulerSide.may_load_async); older vLLMs never ask.
        return self.scheduler.may_load_async(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset()

    # ---- both roles: stats and metrics ---------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        if self._worker is not None:
            return self._worker.stats()
        return self.scheduler.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        return KVOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVOffloadPromMetrics:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _meta(meta: KVConnectorMetadata) -> Any:
    if not isinstance(meta, KVOffloadMetadata):
        raise TypeError(f"KVOffloadConnector got {type(meta).__name__}, not KVOffloadMetadata")
    return meta.meta


def _worker_rank() -> int:
    """This worker's rank among all of the engine's workers (0 when vLLM runs without a process group)."""
    from vllm.distributed.parallel_state import get_world_group

    try:
        return int(get_world_group().rank_in_group)
    except AssertionError:
        return 0
