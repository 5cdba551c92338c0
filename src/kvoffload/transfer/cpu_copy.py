"""CPU copier: runs the copy plans of device<->host jobs when the KV cache itself is in host memory.

Stores go through one ordered queue, so they finish in submission order (which covers the interface's rule
that two jobs touching the same destination finish in order). Loads are copied during ``start``, in the
caller's thread (why: see ``start``); a load writes device blocks and a store writes host slots, so the two
never share a destination. A job's plan is turned into absolute addresses once (``Ranges``), then cut into
byte-balanced pieces (at least 1 MiB each, up to 4 per thread) that ``threads`` threads (the dispatcher or the
caller, plus helpers) take in turn. Taking pieces rather than fixed halves matters on a shared machine: a thread
the OS preempts delays the job by one piece, not by half of it. Torch's intra-op thread count is left alone: it
is process-wide and belongs to the engine.

Why raw ``memmove``: each copy is a ``memmove`` between addresses computed from the tensors' data pointers, and
``kvoffload._blockcopy.copy_ranges`` (a small C extension) runs a whole piece of them in one call without the
GIL. Measured on a 2-core box: a torch ``copy_`` per block costs ~3 us of dispatch, ``index_select`` /
``index_copy_`` reach well under 1 GB/s on int8 rows, and a Python loop of ``ctypes.memmove`` pays about a
microsecond per call, a quarter of the speed at 4 KiB pages. Safety
rests on ``copy_plan`` (every block id and slot is in range before a plan exists) and on this object holding
the tensors whose memory it addresses.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from kvoffload._blockcopy import copy_ranges
from kvoffload.blocks import JobId, Medium
from kvoffload.transfer.base import TransferResult
from kvoffload.transfer.copy_plan import STORE, CopyPlan, Int64Array

logger = logging.getLogger(__name__)

# Below this many bytes per piece, handing work to another thread costs more than it saves.
MIN_PIECE_BYTES = 1 << 20
PIECES_PER_THREAD = 4

BeforeCopy = Callable[[JobId], None]
_Queued = tuple[JobId, tuple[Medium, Medium], CopyPlan]


class CpuCopier:
    """Background copies between CPU KV views and a CPU host pool; results come out in submission order."""

    def __init__(self, views: tuple[torch.Tensor, ...], pool: torch.Tensor, threads: int,
                 before_copy: BeforeCopy) -> None:
        self._views = views  # held so the addresses below stay valid
        self._pool = pool
        self._view_base = np.asarray([v.data_ptr() for v in views], dtype=np.int64)
        self._pool_base = pool.data_ptr()
        self._threads = threads
        self._before_copy = before_copy
        self._helpers = ThreadPoolExecutor(threads - 1, "kvoffload-copy") if threads > 1 else None
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending: set[JobId] = set()
        self._results: list[TransferResult] = []
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="kvoffload-copy-dispatch",
                                            daemon=True)
        self._dispatcher.start()

    def start(self, job_id: JobId, transfer_type: tuple[Medium, Medium], plan: CopyPlan) -> None:
        with self._done:
            self._pending.add(job_id)
        if transfer_type == STORE:
            self._queue.put((job_id, transfer_type, plan))
        else:
            # A load is copied here, in the engine's thread. In the background it would need the GIL between
            # memmoves while the engine thread spins through empty steps waiting for it: with Python's 5 ms
            # switch interval that cost 100-300 ms per hit in real vLLM, for a copy of a few milliseconds.
            # Stores stay in the background: nothing waits for them.
            self._execute((job_id, transfer_type, plan))

    def get_finished(self) -> list[TransferResult]:
        with self._done:
            results, self._results = self._results, []
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        with self._done:
            self._done.wait_for(lambda: self._pending.isdisjoint(job_ids))

    def shutdown(self) -> None:
        """Finish every queued job, then stop the threads."""
        self._queue.put(None)
        self._dispatcher.join()
        if self._helpers is not None:
            self._helpers.shutdown()

    def _dispatch_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._execute(item)

    def _execute(self, item: _Queued) -> None:
        job_id, transfer_type, plan = item
        start = time.perf_counter()
        try:
            self._before_copy(job_id)
            self._run(plan, transfer_type == STORE)
            success = True
        except Exception:
            logger.exception("device<->host job %d failed", job_id)
            success = False
        seconds = time.perf_counter() - start
        result = TransferResult(job_id, success, plan.nbytes if success else 0, seconds, transfer_type)
        with self._done:
            self._pending.discard(job_id)
            self._results.append(result)
            self._done.notify_all()

    def _run(self, plan: CopyPlan, store: bool) -> None:
        ranges = self._ranges(plan, store)
        parts = max(1, min(self._threads * PIECES_PER_THREAD, int(ranges.size.sum()) // MIN_PIECE_BYTES))
        pieces = iter(split_ranges(ranges, parts))
        lock = threading.Lock()

        def drain() -> None:
            # Threads take pieces until none are left, so a thread the OS preempts delays the job by at
            # most one piece instead of by half of it.
            while True:
                with lock:
                    piece = next(pieces, None)
                if piece is None:
                    return
                copy_ranges(*piece)

        futures: list[Future[None]] = []
        if self._helpers is not None and parts > 1:
            futures = [self._helpers.submit(drain) for _ in range(min(parts, self._threads) - 1)]
        errors: list[BaseException] = []
        try:
            drain()
        except Exception as e:
            errors.append(e)
        # All pieces must be over before the job is reported, even when one failed: all write its destination.
        for f in futures:
            if (error := f.exception()) is not None:
                errors.append(error)
        if errors:
            raise errors[0]

    def _ranges(self, plan: CopyPlan, store: bool) -> Ranges:
        """The plan in absolute addresses, for the whole job at once (not per piece: fewer numpy calls)."""
        base = self._view_base[0] if len(self._view_base) == 1 else self._view_base[plan.view]
        view_addr, pool_addr = plan.view_offset + base, plan.pool_offset + self._pool_base
        dst, src = (pool_addr, view_addr) if store else (view_addr, pool_addr)
        return Ranges(dst, src, np.ascontiguousarray(plan.size))


class Ranges(NamedTuple):
    """``size[i]`` bytes from address ``src[i]`` to address ``dst[i]``: the arguments of ``copy_ranges``."""

    dst: Int64Array
    src: Int64Array
    size: Int64Array


def split_ranges(ranges: Ranges, parts: int) -> list[Ranges]:
    """Cut into at most ``parts`` pieces of near-equal bytes, in order; a range may be cut, more than once."""
    size = ranges.size
    if parts <= 1 or len(size) == 0:
        return [ranges]
    # One numpy call over the whole job (each costs ~10 us in the cold caches a job meets, np.insert and the like
    # far more), then plain Python on the few cut points.
    ends = np.cumsum(size)
    total = int(ends[-1])
    cuts = sorted({k * total // parts for k in range(1, parts)} - {0})
    holders = np.searchsorted(ends, cuts, side="right").tolist()  # the range that holds each cut's byte
    starts = (ends[holders] - size[holders]).tolist()
    pieces, lo, skip = [], 0, 0  # the next piece starts ``skip`` bytes into range ``lo``
    for cut, holder, start in zip(cuts, holders, starts, strict=True):
        pieces.append(_piece(ranges, lo, skip, holder, cut - start))
        lo, skip = holder, cut - start
    pieces.append(_piece(ranges, lo, skip, len(size), 0))
    return pieces


def _piece(ranges: Ranges, lo: int, skip: int, hi: int, tail: int) -> Ranges:
    """Ranges ``lo`` to ``hi`` (excluded) less the first ``skip`` bytes, then the first ``tail`` bytes of ``hi``."""
    dst, src, size = ranges
    stop = hi + 1 if tail else hi
    if not skip and not tail:
        return Ranges(dst[lo:stop], src[lo:stop], size[lo:stop])
    d, s, n = dst[lo:stop].copy(), src[lo:stop].copy(), size[lo:stop].copy()
    if tail:
        n[-1] = tail
    if skip:
        d[0] += skip
        s[0] += skip
        n[0] -= skip
    return Ranges(d, s, n)
