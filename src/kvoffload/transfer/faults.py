"""Fault injection for end-to-end tests: handler wrappers that fail, or silently corrupt, the first N load jobs.

``FailFirstLoads`` (configuration key ``inject_load_failures``) lets tests prove, against a real engine in another
process, that a failed load is recomputed and the outputs stay the same; the failed jobs copy nothing.
``CorruptFirstLoads`` (``inject_load_corruption``) makes a load deliver wrong KV while reporting success, so the
tests can prove that their output comparisons catch a wrong load: a check that passes whatever kvoffload loads
would prove nothing.
"""

from __future__ import annotations

from collections.abc import Collection

from kvoffload.specs import HostBlocks, JobId, Medium, TransferJob
from kvoffload.transfer.base import TransferHandler, TransferResult
from kvoffload.transfer.host_pool import HostPool


class FailFirstLoads(TransferHandler):
    def __init__(self, inner: TransferHandler, count: int) -> None:
        self._inner = inner
        self._left = count
        self._failed: list[TransferResult] = []

    def submit(self, job: TransferJob) -> bool:
        if self._left > 0 and job.dst.medium == Medium.DEVICE:
            self._left -= 1
            self._failed.append(TransferResult(job.job_id, False, 0, 0.0, job.transfer_type))
            return True
        return self._inner.submit(job)

    def get_finished(self) -> list[TransferResult]:
        failed, self._failed = self._failed, []
        return failed + self._inner.get_finished()

    def wait(self, job_ids: Collection[JobId]) -> None:
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        self._inner.shutdown()


class CorruptFirstLoads(TransferHandler):
    """Zeroes the host copy of the first offload block of each of the first ``count`` load jobs, then loads.

    The job still succeeds, so the engine computes with wrong KV for that block (and for every later load of
    the same block, whose host copy stays zeroed): what a buggy copy or a lying tier would do.
    """

    def __init__(self, inner: TransferHandler, pool: HostPool, count: int) -> None:
        self._inner = inner
        self._pool = pool
        self._left = count

    def submit(self, job: TransferJob) -> bool:
        if self._left > 0 and job.dst.medium == Medium.DEVICE and isinstance(job.src, HostBlocks) and job.src.slots:
            self._left -= 1
            self._pool.slot(job.src.slots[0]).zero_()
        return self._inner.submit(job)

    def get_finished(self) -> list[TransferResult]:
        return self._inner.get_finished()

    def wait(self, job_ids: Collection[JobId]) -> None:
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        self._inner.shutdown()
