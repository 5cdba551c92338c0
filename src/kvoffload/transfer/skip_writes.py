"""``SkipWrites``: a shared tier's handler on a rank that does not write the copy the ranks share.

A replicated namespace (latent attention: every rank holds the same bytes) keeps one copy in a tier the ranks
share: rank 0 writes it, and the other ranks report their writes done at once, so the scheduler's every-rank count
still completes the job (and rank 0's failure still fails it). Every rank reads the one copy.
"""

from __future__ import annotations

from collections.abc import Collection

from kvoffload.specs import JobId, Medium, TransferJob
from kvoffload.transfer.base import TransferHandler, TransferResult


class SkipWrites(TransferHandler):
    """Jobs from the host to ``medium`` succeed at once, copying nothing (another rank writes the same bytes);
    every other job goes to ``inner``."""

    def __init__(self, inner: TransferHandler, medium: Medium) -> None:
        self._inner = inner
        self._skipped_type = (Medium.HOST, medium)
        self._skipped: list[TransferResult] = []

    def submit(self, job: TransferJob) -> bool:
        if job.transfer_type != self._skipped_type:
            return self._inner.submit(job)
        self._skipped.append(TransferResult(job.job_id, True, 0, 0.0, job.transfer_type))
        return True

    def get_finished(self) -> list[TransferResult]:
        skipped, self._skipped = self._skipped, []
        return skipped + self._inner.get_finished()

    def wait(self, job_ids: Collection[JobId]) -> None:
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        self._inner.shutdown()
