"""The small values that cross between the connector's two halves each engine step.

Scheduler -> workers: ``ConnectorMetadata`` (which jobs to start, which to flush).
Workers -> scheduler: ``WorkerReport`` (which jobs finished), summed over workers with ``aggregate``.
Both are plain frozen dataclasses of ints, strings and specs: cheap to pickle across processes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvoffload.blocks import JobId, TransferJob


@dataclass(frozen=True)
class LoadJob:
    """Copy a request's hit blocks into its device blocks."""

    req_id: str
    job: TransferJob


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the workers do this step.

    ``store_jobs`` copy blocks that became full during the previous step; workers submit them at the start of the
    next step so they never delay sampling. ``jobs_to_flush`` must finish before the engine reuses device blocks
    that they read or write (their request finished, was preempted or aborted).
    ``tier_jobs`` are background copies between lower tiers (host <-> disk); they touch no device block.
    """

    load_jobs: tuple[LoadJob, ...] = ()
    store_jobs: tuple[TransferJob, ...] = ()
    tier_jobs: tuple[TransferJob, ...] = ()
    jobs_to_flush: frozenset[JobId] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not (self.load_jobs or self.store_jobs or self.tier_jobs or self.jobs_to_flush)


@dataclass(frozen=True)
class WorkerReport:
    """Jobs that finished since the last report, counted per worker (one worker reports counts of 1)."""

    completed: Mapping[JobId, int] = field(default_factory=dict)
    failed: Mapping[JobId, int] = field(default_factory=dict)

    @classmethod
    def of(cls, completed: Iterable[JobId], failed: Iterable[JobId]) -> WorkerReport:
        return cls(dict(Counter(completed)), dict(Counter(failed)))

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        """Sum two reports (from two workers, or two steps)."""
        return WorkerReport(
            dict(Counter(self.completed) + Counter(other.completed)),
            dict(Counter(self.failed) + Counter(other.failed)),
        )

    @property
    def is_empty(self) -> bool:
        return not (self.completed or self.failed)
