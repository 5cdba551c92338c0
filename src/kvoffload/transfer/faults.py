"""Fault injection for the recompute path: a handler wrapper that fails the first N load jobs.

Turned on by the ``inject_load_failures`` configuration key, so end-to-end tests can prove, against a real engine in
another process, that a failed load is recomputed and the outputs stay the same. The failed jobs copy nothing.
"""

from __future__ import annotations

from collections.abc import Collection

from kvoffload.specs import JobId, Medium, TransferJob
from kvoffload.transfer.base import TransferHandler, TransferResult


class FailFirstLoads(TransferHandler):
    def __init__(self, inner: TransferHandler, count: int) -> None:
        self._inner = inner
        self._left = count
        self._failed: list[TransferResult] = []

    def submit(self, job: TransferJob) -> bool:
        if self._left > 0 and job.dst.medium is Medium.DEVICE:
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
