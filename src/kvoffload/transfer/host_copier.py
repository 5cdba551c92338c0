"""Device<->host transfers: the handler the worker's router uses for (DEVICE, HOST) and (HOST, DEVICE) jobs.

A store copies engine blocks into host-pool slots, a load copies slots back into engine blocks (see
``transfer/copy_plan.py`` for the exact mapping, offload factor and ``skip_sub_blocks`` included). This module
checks jobs and keeps the handler contract; the copies run in ``cpu_copy.CpuCopier`` (KV cache in host
memory: background threads for stores, the caller's thread for loads) or ``cuda_copy.CudaCopier`` (KV cache on
a GPU: a copy stream and events).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import torch

from kvoffload.blocks import JobId, TransferJob
from kvoffload.canonical import CanonicalKV
from kvoffload.transfer.base import TransferHandler, TransferResult
from kvoffload.transfer.copy_plan import PlanLayout, build_plan, validate_job
from kvoffload.transfer.cpu_copy import CpuCopier
from kvoffload.transfer.cuda_copy import CudaCopier
from kvoffload.transfer.host_pool import HostPool

logger = logging.getLogger(__name__)


class HostCopier(TransferHandler):
    """Copies blocks between the canonical KV views and a ``HostPool``, in both directions.

    Args:
        kv: the engine's KV cache, canonicalized; all views on one device (CPU or CUDA).
        pool: the host tier's slots; ``slot_bytes`` must hold ``factor`` blocks of the largest group.
        factor: engine blocks per offload block.
        threads: copy threads when the KV cache is on the CPU (ignored on CUDA).
        cuda_batching: let the CUDA copier batch plans of many small copies (``transfer/cuda_batch.py``);
            False keeps every copy its own ``cudaMemcpyAsync`` (benchmarks compare the two).

    Raises:
        ValueError: a view that is not a 2-D int8 tensor with contiguous rows, views on different devices,
            refs wider than their view's page, a pool too small for the factor, a non-positive factor or
            threads count.

    Jobs finish in submission order (one stream on CUDA; on CPU one queue for stores, loads during submit).
    ``plan_seconds`` adds up the time ``submit`` spent checking and planning jobs (the rest of a job's time is
    its copies, ``TransferResult.seconds``, and handing it between threads).
    """

    def __init__(self, kv: CanonicalKV, pool: HostPool, factor: int, threads: int = 2,
                 cuda_batching: bool = True) -> None:
        if factor < 1:
            raise ValueError(f"HostCopier: factor must be >= 1, got {factor}")
        if threads < 1:
            raise ValueError(f"HostCopier: threads must be >= 1, got {threads}")
        _check_views(kv)
        if pool.slot_bytes < factor * kv.max_block_bytes:
            raise ValueError(f"HostCopier: pool slot_bytes {pool.slot_bytes} < factor {factor} x "
                             f"max_block_bytes {kv.max_block_bytes}")
        self._layout = PlanLayout.of(kv, pool.num_slots, int(pool.buffer.stride(0)), factor)
        self._copier: CpuCopier | CudaCopier
        if kv.views[0].is_cuda:
            self._copier = CudaCopier(kv.views, pool.buffer, self._before_copy, batching=cuda_batching)
        else:
            self._copier = CpuCopier(kv.views, pool.buffer, threads, self._before_copy)
        self._closed = False
        self.plan_seconds = 0.0

    def submit(self, job: TransferJob) -> bool:
        if self._closed:
            return False
        start = time.perf_counter()
        validate_job(self._layout, job)
        plan = build_plan(self._layout, job)
        self.plan_seconds += time.perf_counter() - start
        self._copier.start(job.job_id, job.transfer_type, plan)
        return True

    def get_finished(self) -> list[TransferResult]:
        return self._copier.get_finished()

    def wait(self, job_ids: Collection[JobId]) -> None:
        self._copier.wait(frozenset(job_ids))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._copier.shutdown()

    def _before_copy(self, job_id: JobId) -> None:
        """Called in the copy path just before a job's copies; an exception here fails the job like any copy
        error would. A seam for fault injection in tests (``kvoffload.testing.conformance``)."""


def _check_views(kv: CanonicalKV) -> None:
    if not kv.views:
        raise ValueError("HostCopier: the KV cache has no views")
    device = kv.views[0].device
    for i, v in enumerate(kv.views):
        if v.dtype != torch.int8 or v.dim() != 2 or v.stride(1) != 1 or v.stride(0) < v.shape[1]:
            raise ValueError(f"HostCopier: view {i} must be a 2-D int8 tensor with contiguous rows, "
                             f"got {v.dtype} shape {tuple(v.shape)} strides {v.stride()}")
        if v.device != device:
            raise ValueError(f"HostCopier: view {i} is on {v.device}, view 0 on {device}")
        if v.shape[0] < kv.num_blocks:
            raise ValueError(f"HostCopier: view {i} has {v.shape[0]} rows, fewer than num_blocks "
                             f"{kv.num_blocks}")
    for g, refs in enumerate(kv.group_refs):
        for r in refs:
            if not 0 <= r.view < len(kv.views) or not 0 < r.nbytes <= kv.views[r.view].shape[1]:
                raise ValueError(f"HostCopier: group {g} ref {r} does not fit view {r.view}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"HostCopier: views on {device}; only cpu and cuda are supported")
