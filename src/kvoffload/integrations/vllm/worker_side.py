"""The connector's worker role: vLLM's model-runner hooks, translated for ``ConnectorWorker``.

Lives in each vLLM worker process (one per rank). Per engine step vLLM calls ``handle_preemptions`` (before
blocks are reused), binds the step's metadata, runs the forward pass, ``start_load_kv`` (before the forward
when it has synchronous loads, else after), ``wait_for_save``, then collects ``get_transfer_results``,
``get_block_ids_with_load_errors``, ``get_kv_connector_stats`` and ``build_connector_worker_meta`` into the
step's ``KVConnectorOutput``. With speculative decoding vLLM collects those first and calls ``wait_for_save``
once the drafter ran (V1's ``finalize_kv_connector``, Model Runner V2's ``finalize_step`` in vLLM 0.33, with the
metadata still bound); ``wait_for_save`` only queues the step's stores, so both orders submit them at the next
step's ``handle_preemptions`` and report each once (``CALL_ORDERS`` in tools/vllm/api_surface.py pins vLLM's
orders).

One poll per step: vLLM asks for the step's reports in four hooks, one after another and always in this order
(``get_transfer_results``, ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
``build_connector_worker_meta``; ``CALL_ORDERS``). The first, ``transfer_results``, polls the worker half
(``ConnectorWorker.get_finished``) and hands out the finished loads at once; the poll's other parts wait here,
unclaimed, until their own hook takes them (``take_load_errors``, ``stats``, ``report``). A part taken twice is empty
the second time; a hook vLLM skips leaves its part to be added to the next poll's, so nothing is lost or reported
twice, and a failed block never reaches vLLM before its request's finish does (both come from the same poll).

Failed loads: with one KV-cache group the failed device blocks go to vLLM (``invalid_block_ids``), which
recomputes from the first bad block. With several groups block ids are not unique across groups and vLLM
refuses block-level errors, so the requests whose loads failed go out as ``failed_recving`` and are recomputed
whole.

A release of the KV cache's pages (vLLM 0.34): ``unregister_kv_caches`` and ``restore_kv_caches`` go to the core
(``ConnectorWorker``); the jobs it fails there reach vLLM through the next step's polls, like any other failure.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvoffload.config import OffloadConfig
from kvoffload.connector.metadata import ConnectorMetadata, WorkerReport
from kvoffload.connector.stats import TransferStats
from kvoffload.connector.worker import ConnectorWorker
from kvoffload.integrations.vllm.messages import KVOffloadWorkerReport
from kvoffload.integrations.vllm.metrics import KVOffloadStats
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout

logger = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, block_size: int,
                 namespace: Namespace) -> None:
        self.core = ConnectorWorker(config, layout, block_size, namespace)
        self.single_group = len(layout.groups) == 1
        # The last polls' parts that their hooks have not taken yet.
        self._load_errors: set[int] = set()
        self._stats: TransferStats | None = None
        self._report = WorkerReport()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.core.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        self.core.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.core.restore_kv_caches()

    def handle_preemptions(self, meta: ConnectorMetadata) -> None:
        self.core.handle_preemptions(meta)

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        self.core.start_kv_transfers(meta)

    def wait_for_save(self, meta: ConnectorMetadata) -> None:
        self.core.prepare_store_kv(meta)

    def transfer_results(self) -> KVConnectorTransferResults:
        """Poll: requests whose loads finished; failures as block ids (one group) or request ids (several)."""
        poll = self.core.get_finished()
        if self.single_group:
            self._load_errors |= poll.load_errors
        if poll.stats is not None:
            self._stats = poll.stats if self._stats is None else self._stats.aggregate(poll.stats)
        self._report = poll.report if self._report.is_empty else self._report.aggregate(poll.report)
        finished = set(poll.finished_loads)
        if self.single_group:
            return KVConnectorTransferResults(finished_recving=finished)
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=set(poll.failed_loads))

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> KVOffloadStats | None:
        transfers, self._stats = self._stats, None
        return None if transfers is None else KVOffloadStats.of(transfers=transfers)

    def report(self) -> KVOffloadWorkerReport | None:
        report, self._report = self._report, WorkerReport()
        return None if report.is_empty else KVOffloadWorkerReport(report)

    def shutdown(self) -> None:
        self.core.shutdown()
