"""The worker half's router: sends each job to the handler for its (source medium, destination medium).

It adds the guarantee that no handler exception escapes into the engine step: a handler that raises in
``submit`` has refused the job, and the caller reports it as failed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from kvoffload.blocks import JobId, Medium, TransferJob
from kvoffload.transfer.base import TransferHandler, TransferResult

logger = logging.getLogger(__name__)


class JobRouter:
    def __init__(self) -> None:
        self._routes: dict[tuple[Medium, Medium], TransferHandler] = {}
        self._handler_of: dict[JobId, TransferHandler] = {}

    def register(self, src: Medium, dst: Medium, handler: TransferHandler) -> None:
        if (src, dst) in self._routes:
            raise ValueError(f"a handler for {src.value} -> {dst.value} is already registered")
        self._routes[(src, dst)] = handler

    @property
    def pending_job_ids(self) -> list[JobId]:
        """Accepted jobs whose results have not been collected yet."""
        return list(self._handler_of)

    @property
    def handlers(self) -> list[TransferHandler]:
        return list({id(h): h for h in self._routes.values()}.values())

    def submit(self, job: TransferJob) -> bool:
        """Start ``job``; False if it was refused (no result will come for it)."""
        handler = self._routes.get(job.transfer_type)
        if handler is None:
            raise ValueError(f"job {job.job_id}: no handler for {job.src.medium.value} -> {job.dst.medium.value}")
        try:
            accepted = handler.submit(job)
        except ValueError:
            raise  # a malformed job is a bug in the scheduler half, not a data-path failure
        except Exception:
            logger.exception("transfer handler %s raised on submit of job %d", type(handler).__name__, job.job_id)
            return False
        if accepted:
            self._handler_of[job.job_id] = handler
        return accepted

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        for handler in self.handlers:
            try:
                results.extend(handler.get_finished())
            except Exception:
                logger.exception("transfer handler %s raised in get_finished", type(handler).__name__)
        for r in results:
            self._handler_of.pop(r.job_id, None)
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        by_handler: dict[int, tuple[TransferHandler, list[JobId]]] = {}
        for job_id in job_ids:
            handler = self._handler_of.get(job_id)
            if handler is not None:
                by_handler.setdefault(id(handler), (handler, []))[1].append(job_id)
        for handler, ids in by_handler.values():
            try:
                handler.wait(ids)
            except Exception:
                logger.exception("transfer handler %s raised in wait", type(handler).__name__)

    def shutdown(self) -> None:
        for handler in self.handlers:
            try:
                handler.shutdown()
            except Exception:
                logger.exception("transfer handler %s raised in shutdown", type(handler).__name__)
