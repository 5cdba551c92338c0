"""``SkipWrites``: a shared tier's handler on a rank that does not write the copy the ranks share.

A replicated namespace (latent attention: every rank holds the same bytes) keeps one copy in a tier the ranks
share: rank 0 writes it, and the other ranks report their writes done at once, so the scheduler's every-rank count
still completes the job (and rank 0's failure still fails it). Every rank reads the one copy.
"""

from __future__ import annotations

from kvoffload.blocks import Medium, TransferJob
from kvoffload.transfer.base import HandlerWrapper, TransferHandler


class SkipWrites(HandlerWrapper):
    """Jobs from the host to ``medium`` succeed at once, copying nothing (another rank writes the same bytes);
    every other job goes to ``inner``."""

    def __init__(self, inner: TransferHandler, medium: Medium) -> None:
        super().__init__(inner)
        self._skipped_type = (Medium.HOST, medium)

    def submit(self, job: TransferJob) -> bool:
        if job.transfer_type != self._skipped_type:
            return self._inner.submit(job)
        return self._answer(job, True)
