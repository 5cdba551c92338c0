"""The scheduler half's job book: job ids, the jobs in flight, fences, and what finishing a job means.

Load planning (``loads.py``) and the store scan (``stores.py``) open jobs here; ``ConnectorScheduler`` hands the
index's tier transfers here as jobs, puts the jobs to flush into each step's ``ConnectorMetadata``, and passes the
workers' reports (``WorkerReport``) to ``report``. A job is done once every worker reported it and failed if any
worker failed it; finishing it tells the index (a completed store makes its blocks loadable, a failed load drops
its keys) and, for a promotion from a lower tier, times it for cost-aware loading (``load_cost.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvoffload.blocks import BlockSpec, JobId, Medium, TransferJob
from kvoffload.connector.load_cost import LoadCost
from kvoffload.connector.metadata import WorkerReport
from kvoffload.connector.requests import RequestState
from kvoffload.connector.stats import SchedulerStats
from kvoffload.index.base import BlockIndex, TierTransfer
from kvoffload.keys import OffloadKey

logger = logging.getLogger(__name__)


class JobKind(Enum):
    LOAD = "load"
    STORE = "store"
    TIER = "tier"


@dataclass
class _PendingJob:
    kind: JobKind
    req_ids: tuple[str, ...]
    keys: tuple[OffloadKey, ...] = ()
    transfer: TierTransfer | None = None
    """A tier job's transfer, handed back to the index with its outcome."""
    tokens: int = 0
    """A load's tokens: those the engine counts as loaded by it (recomputed if it fails)."""
    ok: int = 0
    failed: int = 0


class JobBook:
    """The jobs the scheduler half handed to the workers and has not yet seen finish, and the jobs to flush.

    ``requests`` is the scheduler's live map of request states (shared, not copied): a finished job leaves the
    ``jobs`` of the states that still exist. Not thread-safe: the engine's scheduler calls it from one thread.
    """

    def __init__(self, index: BlockIndex, requests: dict[str, RequestState], stats: SchedulerStats,
                 load_cost: LoadCost, world_size: int, clock: Callable[[], float]) -> None:
        self._index = index
        self._requests = requests
        self._stats = stats
        self._load_cost = load_cost
        self.world_size = world_size
        """Workers that report each job."""
        self._clock = clock
        self._jobs: dict[JobId, _PendingJob] = {}
        self._job_ids = itertools.count()
        self._promotions: dict[JobId, tuple[Medium, int, float]] = {}
        self.to_flush: set[JobId] = set()
        """Jobs the workers must wait for at the start of the next step (fenced requests' jobs)."""
        self.to_flush_next: set[JobId] = set()
        """Stores that the workers flush at the start of the next step (``flush_stores_next_step``)."""

    def __len__(self) -> int:
        return len(self._jobs)

    def new_job(self, kind: JobKind, req_ids: tuple[str, ...], keys: tuple[OffloadKey, ...],
                transfer: TierTransfer | None = None, tokens: int = 0) -> JobId:
        """Open a job of ``kind`` that reads or writes the device blocks of ``req_ids`` (a load: ``tokens`` of
        them); returns its id."""
        job_id = JobId(next(self._job_ids))
        self._jobs[job_id] = _PendingJob(kind, req_ids, tuple(keys), transfer, tokens=tokens)
        return job_id

    def tier_job(self, transfer: TierTransfer) -> TransferJob:
        """The job for one of the index's tier transfers; a promotion (into host) is timed for its tier."""
        job = self.new_job(JobKind.TIER, (), (), transfer)
        if transfer.dst.medium == Medium.HOST:  # a promotion: timed for the tier's speed (load_cost)
            nbytes = sum(transfer.src.group_sizes) * self._load_cost.block_bytes
            self._promotions[job] = (transfer.src.medium, nbytes, self._clock())
        return TransferJob(job, transfer.src, transfer.dst)

    def fence(self, state: RequestState) -> None:
        """The request's device blocks may be reused: its jobs in flight go into the next step's flush."""
        self.to_flush |= state.jobs
        state.jobs = set()

    def take_flush(self) -> set[JobId]:
        """The jobs to flush in the step being built (the caller owns the set)."""
        flush, self.to_flush, self.to_flush_next = self.to_flush, self.to_flush_next, set()
        return flush

    def report(self, report: WorkerReport) -> bool:
        """Count one worker's report; finish a job once every worker has reported it.

        Returns whether any job finished (tier usage may have moved). A report for an unknown job is logged and
        ignored.
        """
        finished = False
        for job_ids, ok in ((report.completed, True), (report.failed, False)):
            for job_id, count in job_ids.items():
                job = self._jobs.get(job_id)
                if job is None:
                    logger.warning("report for unknown job %d ignored", job_id)
                    continue
                if ok:
                    job.ok += count
                else:
                    job.failed += count
                if job.ok + job.failed >= self.world_size:
                    self._finish(job_id, job)
                    finished = True
        return finished

    def _finish(self, job_id: JobId, job: _PendingJob) -> None:
        del self._jobs[job_id]
        success = job.failed == 0
        for req_id in job.req_ids:
            if (state := self._requests.get(req_id)) is not None:
                state.jobs.discard(job_id)
        if job.kind is JobKind.LOAD:
            self._index.complete_load(job.keys, success)
            if not success:
                self._stats.failed_load_tokens += job.tokens
        elif job.kind is JobKind.STORE:
            self._index.complete_store(job.keys, success)
        else:
            assert job.transfer is not None  # a tier job is only opened by tier_job, with its transfer
            self._index.complete_transfer(job.transfer, success)
            timed = self._promotions.pop(job_id, None)
            if timed is not None and success:
                medium, nbytes, started = timed
                self._load_cost.observe_transfer(medium, nbytes, self._clock() - started)


def regroup(spec: BlockSpec, group_sizes: tuple[int, ...]) -> BlockSpec:
    """An index returns one flat group; the job needs the per-group split of the same entries."""
    return dataclasses.replace(spec, group_sizes=group_sizes)
