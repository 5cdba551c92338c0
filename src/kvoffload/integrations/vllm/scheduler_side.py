"""The connector's scheduler role: vLLM's scheduler hooks, translated for ``ConnectorScheduler``.

Lives where vLLM's scheduler lives (the engine-core process in multi-process mode, the caller's process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). It never touches tensors. Each step vLLM calls, in order:
``get_num_new_matched_tokens`` and ``update_state_after_alloc`` per admitted request, ``build_connector_meta``
once, then, with the workers' output, ``update_connector_output``, ``get_kv_connector_stats`` and
``take_events``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.blocks import Medium
from kvoffload.config import OffloadConfig
from kvoffload.connector.scheduler import NO_JOBS as CORE_NO_JOBS
from kvoffload.connector.scheduler import ConnectorScheduler
from kvoffload.integrations.vllm import adapters, compat
from kvoffload.integrations.vllm.events import GroupKinds, VllmDescriber, kv_events
from kvoffload.integrations.vllm.messages import KVOffloadMetadata, KVOffloadWorkerReport
from kvoffload.integrations.vllm.metrics import KVOffloadStats
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout
from kvoffload.tiers.sizing import host_slot_bytes, offload_factor

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

NO_JOBS = KVOffloadMetadata(CORE_NO_JOBS)
"""The metadata of a step without jobs (frozen, so one instance serves them all)."""


class SchedulerSide:
    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, block_size: int, namespace: Namespace,
                 publish_events: bool, blocks_change_while_running: bool, prompt_blocks_only: bool = False,
                 groups: GroupKinds | None = None) -> None:
        """``prompt_blocks_only``: store no block past a request's prompt (``adapters.stores_prompt_blocks_only``).

        ``publish_events``: vLLM publishes KV events; the blocks are then described for them (``events.py``),
        with ``groups``' spec kinds."""
        factor = offload_factor(config, block_size)
        describe = VllmDescriber(factor, block_size, frozenset(layout.state_groups)) if publish_events else None
        # vLLM's block pool hands out block 0 as its null block (the placeholder for dropped window blocks).
        self.core = ConnectorScheduler(config, layout, block_size, namespace, null_block_id=0,
                                       flush_stores_next_step=blocks_change_while_running, describe=describe)
        self.groups = groups
        self.prompt_blocks_only = prompt_blocks_only
        self.num_groups = len(layout.groups)
        self.block_tokens = self.core.offload_tokens
        self.slot_bytes = host_slot_bytes(layout, self.core.factor)
        self.publish_events = publish_events
        self._reported_host_bytes: int | None = None
        self._reported_pool: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not adapters.is_offloadable(request) or compat.skips_external_kv(request):
            # vLLM would drop the hit (prompt logprobs): no lookup, so no promotion is started for nothing.
            return 0, False
        engine_request = adapters.VllmRequest(request)
        if self.prompt_blocks_only:
            self.core.limit_stores(engine_request, request.num_prompt_tokens)
        return self.core.get_num_new_matched_tokens(engine_request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        if not adapters.is_offloadable(request) or compat.skips_external_kv(request):
            return False
        return self.core.may_hit(adapters.VllmRequest(request))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if not adapters.is_offloadable(request):
            return
        block_ids = adapters.block_ids_per_group(blocks.get_block_ids(), self.num_groups)
        self.core.update_state_after_alloc(adapters.VllmRequest(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVOffloadMetadata:
        meta = self.core.build_connector_meta(adapters.step_schedule(scheduler_output))
        return NO_JOBS if meta is CORE_NO_JOBS else KVOffloadMetadata(meta)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        report = output.kv_connector_worker_meta
        # type() first: an isinstance against vLLM's abstract base costs a microsecond, and this runs every step.
        if type(report) is KVOffloadWorkerReport or isinstance(report, KVOffloadWorkerReport):
            self.core.update_connector_output(report.report)

    def request_finished(self, request: Request) -> None:
        self.core.request_finished(str(request.request_id))

    def take_events(self) -> list[KVCacheEvent]:
        # Always drain the tiers' events, or they would pile up when vLLM does not publish KV events.
        if not self.publish_events:
            self.core.take_events()
            return []
        return kv_events(self.core.take_announcements(), self.groups)

    def reset(self) -> bool:
        return self.core.reset()

    def host_used_bytes(self) -> int:
        """Host tier bytes in use on every rank together: each rank's pool holds the same slots (one shard each,
        or under a replicated layout the same bytes), and the gauge counts what the engine's host RAM holds."""
        used = sum(u.used_blocks for u in self.core.usage() if u.medium == Medium.HOST)
        return used * self.slot_bytes * self.core.world_size

    def stats(self) -> KVOffloadStats | None:
        """Hit and miss tokens since the last call; the host tier's bytes in use and the node pool's counters when
        they changed."""
        if not self.core.take_usage_moved() and not self.core.has_stats():
            return None  # most decode steps: nothing to say
        lookups = self.core.take_stats()
        used = self.host_used_bytes()
        pool = self.core.pool_counters()  # other engines move it too: reported with this engine's own figures
        if used == self._reported_host_bytes and lookups.is_empty() and pool == self._reported_pool:
            return None
        gauge = used if used != self._reported_host_bytes else None
        self._reported_host_bytes = used
        changed = pool if pool != self._reported_pool else None
        self._reported_pool = pool
        return KVOffloadStats.of(lookups=lookups, host_used_bytes=gauge, node_pool=changed,
                                 node_pool_path=self.core.pool_directory() if changed else None)
