"""The worker half: executes the scheduler half's jobs in one engine worker process (one per device / rank).

Semantics of vLLM's original ``OffloadingConnectorWorker``, plus failures end to end:
- stores are deferred: ``prepare_store_kv`` (after the forward pass) only queues them; they are submitted at the start
  of the next step, so copying never delays sampling;
- ``handle_preemptions`` submits the deferred stores and waits for ``jobs_to_flush`` before the engine reuses
  device blocks those jobs read or write;
- ``start_kv_transfers`` submits deferred stores first, then background tier jobs, then this step's loads;
- ``get_finished`` reports, in one ``WorkerFinished``, everything finished since the last poll: the requests whose loads
  finished, a failed load's request and device blocks (the engine recomputes them), the finished job ids for the
  scheduler half and the transfer stats. One poll, one look at the handlers' results: its parts agree (a request
  reported finished has every failure of its load in the same poll), whatever order the engine reads them in.

Around a release of the KV cache's pages (vLLM 0.34: sleep, ``release_kv_cache_memory``, a process checkpoint,
a weight update that borrows their memory), ``unregister_kv_caches`` comes while the pages still hold their
bytes: it fails the deferred stores, waits for the device jobs already submitted (a store among them reports what
it copied; a load not yet reported fails, since the engine recomputes what the released pages held), and from
then on fails every device job without touching the pages; tier jobs go on. ``restore_kv_caches``, after fresh
pages are mapped at the same addresses, lets device jobs run again. Each job is still reported once, by
``get_finished``.

``get_finished`` may come before or after ``prepare_store_kv``: vLLM calls ``wait_for_save`` after the step's reports
when it runs a speculative drafter (testing/sim.HookOrder). Nothing here depends on which: ``prepare_store_kv`` only
queues, the next step's ``handle_preemptions`` submits, and a job is reported once, from the handler's result,
after it was submitted.

The host pool and every handler, the device<->host one included, come from ``tiers.stack.build_worker``; this half
only routes jobs to them and keeps their books. The host pool is per rank: each rank's own memory, or its rank's
slots of the node pool that every engine on the machine maps (``host_scope`` node, ``tiers/node/``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvoffload.blocks import DeviceBlocks, JobId, Medium, TransferJob
from kvoffload.canonical import CanonicalKV, canonicalize
from kvoffload.config import OffloadConfig
from kvoffload.connector.metadata import ConnectorMetadata, WorkerReport
from kvoffload.connector.stats import TransferStats
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout
from kvoffload.tiers.sizing import offload_factor
from kvoffload.tiers.spec import TierContext
from kvoffload.tiers.stack import build_worker
from kvoffload.transfer.host_pool import HostPool
from kvoffload.transfer.router import JobRouter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerFinished:
    """What one worker finished since its last ``get_finished``, all taken from one look at the handlers' results."""

    finished_loads: frozenset[str] = frozenset()
    """Requests whose loads finished, successfully or not."""
    failed_loads: frozenset[str] = frozenset()
    """Those of them whose load failed (for engines that recompute whole requests)."""
    load_errors: frozenset[int] = frozenset()
    """The failed loads' device blocks (for engines that recompute from the first bad block); never a hole."""
    report: WorkerReport = field(default_factory=WorkerReport)
    """Finished job ids (loads, stores, tier jobs), for the scheduler half."""
    stats: TransferStats | None = None
    """Bytes and seconds per transfer type of the jobs the handlers finished; None when they finished none."""


class ConnectorWorker:
    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, engine_block_size: int,
                 namespace: Namespace) -> None:
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self.factor = offload_factor(config, engine_block_size)
        self.transfers = JobRouter()
        self.kv: CanonicalKV | None = None
        self.pool: HostPool | None = None
        self._deferred_stores: list[TransferJob] = []
        self._loads: dict[JobId, tuple[str, DeviceBlocks]] = {}
        self._completed: list[JobId] = []
        self._failed: list[JobId] = []
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._stats = TransferStats()
        self._fenced: ConnectorMetadata | None = None
        self._device_jobs: set[JobId] = set()  # submitted jobs that read or write device pages, not yet collected
        self._doomed: set[JobId] = set()  # reported failed whatever their handler says: the pages went under them
        self._unregistered = False

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Canonicalize the engine's KV tensors, allocate the host pool and start the handlers."""
        self.kv = canonicalize(self.layout, kv_caches)
        tiers = build_worker(self.config, TierContext(self.namespace, self.layout, self.factor), self.kv)
        self.pool = tiers.pool
        for routes, handler in tiers.handlers:
            for src, dst in routes:
                self.transfers.register(src, dst, handler)
        logger.info("kvoffload worker rank %d: %d host slots of %d bytes (%.2f GiB)", self.namespace.rank,
                    self.pool.num_slots, self.pool.slot_bytes, self.pool.nbytes / 2**30)

    def handle_preemptions(self, meta: ConnectorMetadata) -> None:
        """Make the device blocks of finished, preempted or aborted requests safe to reuse."""
        self._submit_deferred_stores()
        if meta.jobs_to_flush and self._fenced is not meta:
            self.transfers.wait(meta.jobs_to_flush)
        self._fenced = meta

    def start_kv_transfers(self, meta: ConnectorMetadata) -> None:
        self.handle_preemptions(meta)
        for job in meta.tier_jobs:
            self._submit(job)
        for load in meta.load_jobs:
            if not isinstance(load.job.dst, DeviceBlocks):
                raise ValueError(f"load job {load.job.job_id} does not target device blocks")
            self._loads[load.job.job_id] = (load.req_id, load.job.dst)
            self._submit(load.job)

    def prepare_store_kv(self, meta: ConnectorMetadata) -> None:
        if self._unregistered:  # blocks computed while the pages were away: nothing true to copy
            for job in meta.store_jobs:
                self._record(job.job_id, success=False)
            return
        self._deferred_stores.extend(meta.store_jobs)

    def get_finished(self) -> WorkerFinished:
        """Everything finished since the last poll; each part is reset on read."""
        self._collect()
        poll = WorkerFinished(frozenset(self._finished_loads), frozenset(self._failed_loads),
                          frozenset(self._load_errors), WorkerReport.of(self._completed, self._failed),
                          None if self._stats.is_empty() else self._stats)
        self._finished_loads, self._failed_loads, self._load_errors = set(), set(), set()
        self._completed, self._failed = [], []
        if poll.stats is not None:
            self._stats = TransferStats()
        return poll

    def wait_all(self) -> None:
        """Submit deferred stores and wait for every job in flight: a test's way to reach a quiet state
        (``shutdown`` leaves the deferred stores unsubmitted: the engine is going away)."""
        self._submit_deferred_stores()
        self.transfers.wait(list(self.transfers.pending_job_ids))

    def shutdown(self) -> None:
        self.transfers.shutdown()

    def unregister_kv_caches(self) -> None:
        """The engine is about to release the KV cache's pages; they still hold their bytes now. Idempotent.

        Deferred stores fail unsubmitted. Device jobs already submitted are waited for, so none reads or writes
        a page once this returns: a store reports what it copied (the pages' bytes before the release); a load
        whose result was not yet reported fails (the engine recomputes its blocks, which the release empties).
        Until ``restore_kv_caches``, device jobs fail without touching the pages; tier jobs go on.
        """
        if self._unregistered:
            return
        self._unregistered = True
        deferred, self._deferred_stores = self._deferred_stores, []
        for job in deferred:
            self._record(job.job_id, success=False)
        self._doomed |= self._loads.keys()
        self.transfers.wait(list(self._device_jobs))
        self._collect()
        self._doomed |= self._device_jobs  # a handler whose wait failed: what it still runs is not trusted
        logger.info("kvoffload worker rank %d: KV cache unregistered: %d deferred store(s) failed, %d device "
                    "job(s) still running", self.namespace.rank, len(deferred), len(self._device_jobs))

    def restore_kv_caches(self) -> None:
        """The engine mapped fresh pages for the KV cache again: device jobs run again. Idempotent.

        Nothing to re-bind: vLLM hands no tensors and keeps the pages' addresses (the extensible KV cache keeps
        its reservation, sleep mode maps the same range again), so the canonical views from
        ``register_kv_caches`` address the new pages, block ids at the same offsets.
        """
        if self._unregistered:
            self._unregistered = False
            logger.info("kvoffload worker rank %d: KV cache restored", self.namespace.rank)

    def _collect(self) -> None:
        for result in self.transfers.get_finished():
            self._stats.record(result)
            self._device_jobs.discard(result.job_id)
            doomed = result.job_id in self._doomed
            self._doomed.discard(result.job_id)
            self._record(result.job_id, result.success and not doomed)

    def _submit_deferred_stores(self) -> None:
        stores, self._deferred_stores = self._deferred_stores, []
        for job in stores:
            self._submit(job)

    def _submit(self, job: TransferJob) -> None:
        touches_device = Medium.DEVICE in job.transfer_type
        if touches_device and self._unregistered:
            self._record(job.job_id, success=False)  # the pages are released or about to be
        elif not self.transfers.submit(job):
            self._record(job.job_id, success=False)
        elif touches_device:
            self._device_jobs.add(job.job_id)

    def _record(self, job_id: JobId, success: bool) -> None:
        (self._completed if success else self._failed).append(job_id)
        load = self._loads.pop(job_id, None)
        if load is not None:
            req_id, dst = load
            self._finished_loads.add(req_id)
            if not success:
                self._load_errors.update(dst.real_block_ids)  # holes (the null block) are no block to recompute
                self._failed_loads.add(req_id)
