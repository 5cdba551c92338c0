"""Worker side: moving bytes. The handler interface every transfer path implements, and its result type.

A handler moves blocks between two media (device and host, host and disk, ...). It decides nothing: the scheduler
half chose every block id, slot and key in the job. Handlers run jobs in the background: ``submit``
starts a job and returns (a handler may also finish a short job before ``submit`` returns).

Failure model: a handler never raises out of ``submit``, ``get_finished`` or ``wait`` because of a data-path problem
(I/O error, corrupt data, timeout, an exception inside a copy). Such a job finishes with ``success=False`` and the
caller recomputes or forgets the blocks. Handlers raise only for programming errors (a malformed job).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass

from kvoffload.blocks import JobId, Medium, TransferJob


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one job: ``bytes`` and ``seconds`` count only what was copied (0 for a rejected job)."""

    job_id: JobId
    success: bool
    bytes: int
    seconds: float
    transfer_type: tuple[Medium, Medium]


class TransferHandler(ABC):
    """Runs jobs between one pair of media.

    Thread-safety: ``submit``, ``get_finished``, ``wait`` and ``shutdown`` are called from one thread (the engine
    worker's); handlers may use background threads or streams internally.
    Ordering: each submitted job's result is reported exactly once, by ``get_finished``. Jobs may finish in any
    order, except that two jobs of one handler touching the same destination blocks complete in submission order.
    """

    @abstractmethod
    def submit(self, job: TransferJob) -> bool:
        """Start ``job`` (in the background, or at once when that is cheaper: the result still comes from
        ``get_finished``).

        Returns:
            True if the job was accepted; its result will come from ``get_finished``. False if it was refused
            (e.g. the handler is shut down or switched off); then no result is ever reported for it.
        """

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Results of jobs that finished since the last call; never blocks."""

    @abstractmethod
    def wait(self, job_ids: Collection[JobId]) -> None:
        """Block until each of ``job_ids`` that this handler accepted has finished.

        Results stay queued for ``get_finished``. Unknown or already reported ids are ignored.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Finish or cancel running jobs and release resources; idempotent."""


class HandlerWrapper(TransferHandler):
    """A handler that decorates ``inner`` (fault injection, checks, skipped writes): it forwards what it does not
    change. Results it decides itself at submit (``_answer``) are reported first, then ``inner``'s, each passed
    through ``_checked``."""

    def __init__(self, inner: TransferHandler) -> None:
        self._inner = inner
        self._answers: list[TransferResult] = []

    def submit(self, job: TransferJob) -> bool:
        return self._inner.submit(job)

    def get_finished(self) -> list[TransferResult]:
        answers, self._answers = self._answers, []
        return answers + [self._checked(result) for result in self._inner.get_finished()]

    def wait(self, job_ids: Collection[JobId]) -> None:
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def _answer(self, job: TransferJob, success: bool) -> bool:
        """Report ``job`` done (``success``) without ``inner``, having copied nothing; accepted."""
        self._answers.append(TransferResult(job.job_id, success, 0, 0.0, job.transfer_type))
        return True

    def _checked(self, result: TransferResult) -> TransferResult:
        """``inner``'s result as this wrapper reports it (unchanged here)."""
        return result
