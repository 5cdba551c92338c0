"""The connector's messages in vLLM's envelope types.

vLLM carries a connector's per-step values inside its own abstract types: ``KVConnectorMetadata`` (scheduler
-> workers, inside ``SchedulerOutput``) and ``KVConnectorWorkerMetadata`` (workers -> scheduler, summed with
``aggregate``). These wrappers hold the core's frozen values; they pickle across vLLM's process boundary as
is.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvoffload.connector.metadata import ConnectorMetadata, WorkerReport


@dataclass(frozen=True)
class KVOffloadMetadata(KVConnectorMetadata):
    """This step's jobs for every worker."""

    meta: ConnectorMetadata


@dataclass(frozen=True)
class KVOffloadWorkerReport(KVConnectorWorkerMetadata):
    """Jobs one worker (or, once aggregated, all workers) finished since its last report."""

    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerReport:
        if not isinstance(other, KVOffloadWorkerReport):
            raise TypeError(f"cannot aggregate kvoffload worker metadata with {type(other).__name__}")
        return KVOffloadWorkerReport(self.report.aggregate(other.report))
