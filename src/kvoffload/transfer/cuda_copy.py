"""CUDA copier: runs the copy plans of device<->host jobs on a dedicated copy stream.

At submit, the copy stream first waits on the engine's current (compute) stream, so a store reads blocks
only after the kernels that wrote them, then every copy of the plan is queued as a ``non_blocking`` copy
between a slice of a KV view and a slice of the pinned host pool, bracketed by two CUDA events. Nothing
blocks at submit: the copies run while the engine computes. ``get_finished`` asks the end events (never waits);
``wait`` synchronizes only the events of the asked jobs. One stream means jobs finish in submission order.

The views and the pool are flattened once into 1-D byte tensors (row 0 to the end of the last row), so each
plan copy is one contiguous slice copy, i.e. one ``cudaMemcpyAsync``. A plan of many small copies goes the
batched way instead (``cuda_batch``: one gather or scatter kernel per view through a device staging buffer,
one copy per run of the host pool), queued on the same stream between the same events, so ordering and
completion are the same on both paths. A load's bytes are in the KV views once its end event has fired: the
engine reads them only after ``get_finished`` reported the job, and a store's gather runs after the compute stream's
work queued before ``start``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from kvoffload.blocks import JobId, Medium
from kvoffload.transfer import cuda_batch
from kvoffload.transfer.base import TransferResult
from kvoffload.transfer.copy_plan import STORE, CopyPlan

logger = logging.getLogger(__name__)

BeforeCopy = Callable[[JobId], None]


@dataclass(frozen=True)
class _InFlight:
    job_id: JobId
    transfer_type: tuple[Medium, Medium]
    nbytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    failed: bool


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D int8 view of a 2-D int8 tensor, from row 0 to the end of its last row (padding included)."""
    extent = (t.shape[0] - 1) * t.stride(0) + t.shape[1] if t.shape[0] else 0
    return t.as_strided((extent,), (1,))


class CudaCopier:
    """Asynchronous copies between CUDA KV views and a (pinned) host pool, on one copy stream.

    ``batching=False`` keeps every plan on the per-copy path (benchmarks compare the two). ``staging_bytes``
    sizes the batched path's device staging buffer (allocated at the first batched job, twice: staging and
    scratch); it must be at least ``cuda_batch.LARGE_COPY_BYTES``.
    """

    def __init__(self, views: tuple[torch.Tensor, ...], pool: torch.Tensor, before_copy: BeforeCopy,
                 batching: bool = True, staging_bytes: int = cuda_batch.STAGING_BYTES) -> None:
        if staging_bytes < cuda_batch.LARGE_COPY_BYTES:
            raise ValueError(f"CudaCopier: staging_bytes {staging_bytes} < {cuda_batch.LARGE_COPY_BYTES}, the "
                             "size of the largest copy that goes through staging")
        self._device = views[0].device
        self._views = [flat_bytes(v) for v in views]
        self._pool = flat_bytes(pool)
        self._before_copy = before_copy
        self._batching, self._staging_bytes = batching, staging_bytes
        self._runner: cuda_batch.BatchRunner | None = None
        self.batched_jobs = 0
        """Jobs that went (at least partly) the batched way; the rest went copy by copy."""
        self._stream = torch.cuda.Stream(self._device)
        self._in_flight: deque[_InFlight] = deque()
        self._results: list[TransferResult] = []
        if not pool.is_pinned():
            logger.warning("host pool is not pinned: CUDA copies to and from it will not overlap compute")

    def start(self, job_id: JobId, transfer_type: tuple[Medium, Medium], plan: CopyPlan) -> None:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        failed = False
        try:
            self._before_copy(job_id)
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                start.record(self._stream)
                self._enqueue(plan, transfer_type == STORE)
        except Exception:
            logger.exception("device<->host job %d failed to start", job_id)
            failed = True
        try:
            # A failed job is reported only once the copies it did queue are over: they write its destination.
            end.record(self._stream)
        except Exception:
            logger.exception("device<->host job %d: cannot record its end event", job_id)
            self._results.append(TransferResult(job_id, False, 0, 0.0, transfer_type))
            return
        self._in_flight.append(_InFlight(job_id, transfer_type, plan.nbytes, start, end, failed))

    def _enqueue(self, plan: CopyPlan, store: bool) -> None:
        batched = cuda_batch.split(plan, self._staging_bytes) if self._batching else None
        if batched is None:
            cuda_batch.copy_each(self._views, self._pool, plan, store)
            return
        self.batched_jobs += 1
        cuda_batch.copy_each(self._views, self._pool, batched.direct, store)
        self._batch_runner().run(batched, store)

    def _batch_runner(self) -> cuda_batch.BatchRunner:
        if self._runner is None:
            # On the copy stream (the caller is inside its context): the buffers are only ever used there.
            staging = torch.empty(self._staging_bytes, dtype=torch.int8, device=self._device)
            scratch = torch.empty(self._staging_bytes, dtype=torch.int8, device=self._device)
            self._runner = cuda_batch.BatchRunner(self._views, self._pool, staging, scratch, self._to_device)
            logger.info("CUDA copier: batched path on, 2 x %d bytes of device staging", self._staging_bytes)
        return self._runner

    def _to_device(self, index: cuda_batch.Int64Array) -> torch.Tensor:
        # From pinned memory, so the upload is asynchronous; the caching host allocator keeps the pinned block
        # until the copy stream has read it, so dropping it here is safe.
        return torch.from_numpy(index).pin_memory().to(self._device, non_blocking=True)

    def get_finished(self) -> list[TransferResult]:
        # One stream: if a job's end event has not fired, no later job's has.
        while self._in_flight and self._finished(self._in_flight[0]):
            self._results.append(self._result(self._in_flight.popleft()))
        results, self._results = self._results, []
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        for job in list(self._in_flight):
            if job.job_id in job_ids:
                try:
                    job.end.synchronize()
                except Exception:
                    logger.exception("device<->host job %d: waiting for its copies failed", job.job_id)

    def shutdown(self) -> None:
        """Let queued copies finish; their results stay available to ``get_finished``."""
        try:
            self._stream.synchronize()
        except Exception:
            logger.exception("device<->host copy stream failed at shutdown")

    def _finished(self, job: _InFlight) -> bool:
        try:
            return bool(job.end.query())
        except Exception:
            return True  # reported as failed by _result

    def _result(self, job: _InFlight) -> TransferResult:
        if job.failed:
            return TransferResult(job.job_id, False, 0, 0.0, job.transfer_type)
        try:
            seconds = job.start.elapsed_time(job.end) / 1000.0
        except Exception:
            logger.exception("device<->host job %d failed on the copy stream", job.job_id)
            return TransferResult(job.job_id, False, 0, 0.0, job.transfer_type)
        return TransferResult(job.job_id, True, job.nbytes, seconds, job.transfer_type)
