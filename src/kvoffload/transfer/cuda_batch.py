"""Batched device<->host copies: a plan's many small copies become a few large ones and one kernel per view.

``cuda_copy.CudaCopier`` runs a ``CopyPlan``. Issued one by one, each plan copy is one ``cudaMemcpyAsync``,
a few microseconds of driver work whatever its size, so a job of thousands of small copies (per-layer pages
of 4-64 KiB) runs at a fraction of the link's speed. This module plans the batched alternative and runs it
with stock PyTorch ops, on any device (the tests run it on CPU tensors):

- Copies of at least ``LARGE_COPY_BYTES`` stay direct (one copy each: already near the link's speed).
- The small ones are laid out in a device staging buffer in *pool order*, so the bytes of a pool run (copies
  that continue each other in the pool: the layers of one slot, consecutive slots) sit side by side there.
  A store gathers the KV rows into staging (``index_select``, one kernel per view), then copies each pool
  run to the pinned pool in one copy; a load copies each run into staging, then scatters into the KV views
  (``index_copy_``). One host<->device copy per pool run instead of one per plan copy.
- Indices count rows of ``unit`` bytes, the gcd of the small copies' view offsets and sizes (at least
  ``MIN_UNIT_BYTES``), so index tensors stay small: 8 bytes of index per ``unit`` bytes moved.
- Staging holds ``staging_bytes`` (``STAGING_BYTES`` unless the copier is told otherwise); a larger job is cut
  into chunks that reuse it in turn, in stream order. A copy never straddles two chunks (small copies are
  smaller than the staging buffer), a pool run may.

``split`` chooses: batched only when it saves at least ``MIN_SAVED_COPIES`` host<->device copies and at
least halves their number; otherwise (few copies, or each pool run is a single copy: one layer, slots taken
at random) the whole plan goes copy by copy, as it would without this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.transfer.copy_plan import CopyPlan

Int64Array = npt.NDArray[np.int64]
ToIndex = Callable[[Int64Array], torch.Tensor]

KIB = 1 << 10
MIB = 1 << 20
LARGE_COPY_BYTES = 1 * MIB
"""A plan copy this large is issued on its own: at ~50 GB/s it takes 20 us, against ~2-5 us of overhead."""
MIN_UNIT_BYTES = 256
"""Below this row size the index tensors (8 bytes per row) would cost more than the copies they save."""
MIN_SAVED_COPIES = 16
"""Batching costs an index upload and two kernels per view and chunk; it must save at least this many copies."""
STAGING_BYTES = 32 * MIB
"""Default device staging buffer (and as much again of scratch when a chunk spans several views)."""


@dataclass(frozen=True)
class ViewRows:
    """The rows one view moves in one chunk: ``index[rows]`` in the view, ``index[staging]`` in staging."""

    view: int
    rows: slice
    staging: slice
    staging_start: int | None
    """First staging row when the staging rows are consecutive (no scratch pass needed), else None."""


@dataclass(frozen=True)
class Chunk:
    """What one fill of the staging buffer moves."""

    nbytes: int
    run_pool_offset: Int64Array
    run_staging_offset: Int64Array
    run_size: Int64Array
    index: Int64Array
    """Row indices of every ``ViewRows`` of the chunk, uploaded in one copy."""
    views: tuple[ViewRows, ...]


@dataclass(frozen=True)
class BatchedPlan:
    """A plan cut in two: ``direct`` copies issued one by one, ``chunks`` through staging in rows of ``unit``."""

    direct: CopyPlan
    unit: int
    chunks: tuple[Chunk, ...]
    copies: int
    """Small plan copies the chunks carry."""

    @property
    def runs(self) -> int:
        """Host<->device copies the chunks issue (pool runs, cut at chunk ends)."""
        return sum(len(c.run_size) for c in self.chunks)


def split(plan: CopyPlan, staging_bytes: int = STAGING_BYTES, large_bytes: int = LARGE_COPY_BYTES,
          min_saved: int = MIN_SAVED_COPIES) -> BatchedPlan | None:
    """The batched form of ``plan``, or None when copying it copy by copy is as good.

    Raises:
        ValueError: ``large_bytes`` exceeds ``staging_bytes`` (every small copy must fit one chunk).
    """
    if large_bytes > staging_bytes:
        raise ValueError(f"cuda_batch.split: copies up to {large_bytes} bytes go through staging, which holds "
                         f"only {staging_bytes}")
    small = plan.size < large_bytes
    if int(small.sum()) < min_saved:
        return None
    view, view_offset = plan.view[small], plan.view_offset[small]
    pool_offset, size = plan.pool_offset[small], plan.size[small]
    unit = int(np.gcd.reduce(np.concatenate((view_offset, size))))
    if unit < MIN_UNIT_BYTES:
        return None
    order = np.argsort(pool_offset, kind="stable")
    view, view_offset, pool_offset, size = view[order], view_offset[order], pool_offset[order], size[order]
    new_run = np.ones(len(size), dtype=bool)
    new_run[1:] = pool_offset[1:] != pool_offset[:-1] + size[:-1]
    runs = int(new_run.sum())
    if len(size) - runs < min_saved or len(size) < 2 * runs:
        return None
    chunks = tuple(_chunks(view, view_offset, pool_offset, size, new_run, unit, staging_bytes))
    large = ~small
    direct = CopyPlan(plan.view[large], plan.view_offset[large], plan.pool_offset[large], plan.size[large],
                      int(plan.size[large].sum()))
    return BatchedPlan(direct, unit, chunks, len(size))


def _chunks(view: Int64Array, view_offset: Int64Array, pool_offset: Int64Array, size: Int64Array,
            new_run: npt.NDArray[np.bool_], unit: int, staging_bytes: int) -> list[Chunk]:
    end = np.cumsum(size)
    chunks, start = [], 0
    while start < len(size):
        base = int(end[start] - size[start])
        stop = int(np.searchsorted(end, base + staging_bytes, side="right"))
        chunks.append(_chunk(view[start:stop], view_offset[start:stop], pool_offset[start:stop],
                             size[start:stop], new_run[start:stop], unit))
        start = stop
    return chunks


def _chunk(view: Int64Array, view_offset: Int64Array, pool_offset: Int64Array, size: Int64Array,
           new_run: npt.NDArray[np.bool_], unit: int) -> Chunk:
    staging_offset = np.cumsum(size) - size
    starts = np.flatnonzero(np.concatenate(([True], new_run[1:])))
    parts: list[Int64Array] = []
    views, at = [], 0
    for v in np.unique(view).tolist():
        mine = view == v
        counts = size[mine] // unit
        rows = _ragged_arange(view_offset[mine] // unit, counts)
        staging = _ragged_arange(staging_offset[mine] // unit, counts)
        n = len(rows)
        consecutive = bool(staging[-1] - staging[0] == n - 1)  # staging rows only ever increase
        views.append(ViewRows(int(v), slice(at, at + n), slice(at + n, at + 2 * n),
                              int(staging[0]) if consecutive else None))
        parts += [rows, staging]
        at += 2 * n
    return Chunk(int(size.sum()), pool_offset[starts], staging_offset[starts], np.add.reduceat(size, starts),
                 np.concatenate(parts), tuple(views))


def _ragged_arange(starts: Int64Array, counts: Int64Array) -> Int64Array:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without the Python loop."""
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def copy_each(views: Sequence[torch.Tensor], pool: torch.Tensor, plan: CopyPlan, store: bool) -> None:
    """Every copy of ``plan`` as its own slice copy between flat byte tensors (the per-copy path)."""
    for v, vo, po, n in zip(plan.view.tolist(), plan.view_offset.tolist(),
                            plan.pool_offset.tolist(), plan.size.tolist(), strict=True):
        device_bytes = views[v][vo:vo + n]
        host_bytes = pool[po:po + n]
        if store:
            host_bytes.copy_(device_bytes, non_blocking=True)
        else:
            device_bytes.copy_(host_bytes, non_blocking=True)


class BatchRunner:
    """Runs ``BatchedPlan`` chunks between flat byte views and a flat pool through one staging buffer.

    Every op is queued on the current stream (the copier's copy stream on CUDA), so chunks reuse ``staging``
    and ``scratch`` in stream order. ``to_index`` brings a chunk's int64 indices to the views' device.
    """

    def __init__(self, views: Sequence[torch.Tensor], pool: torch.Tensor, staging: torch.Tensor,
                 scratch: torch.Tensor, to_index: ToIndex) -> None:
        if staging.numel() != scratch.numel():
            raise ValueError(f"BatchRunner: scratch ({scratch.numel()} bytes) must be as large as staging "
                             f"({staging.numel()} bytes): a chunk passes through both")
        self._views, self._pool, self._to_index = views, pool, to_index
        self._staging, self._scratch = staging, scratch
        self._rows: dict[int, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]] = {}

    def run(self, plan: BatchedPlan, store: bool) -> None:
        views, staging, scratch = self._rows_of(plan.unit)
        for chunk in plan.chunks:
            index = self._to_index(chunk.index)
            if store:
                self._gather(chunk, index, views, staging, scratch)
                self._runs(chunk, store=True)
            else:
                self._runs(chunk, store=False)
                self._scatter(chunk, index, views, staging, scratch)

    def _gather(self, chunk: Chunk, index: torch.Tensor, views: list[torch.Tensor], staging: torch.Tensor,
                scratch: torch.Tensor) -> None:
        for part in chunk.views:
            rows = index[part.rows]
            if part.staging_start is not None:
                start = part.staging_start
                torch.index_select(views[part.view], 0, rows, out=staging[start:start + len(rows)])
            else:
                torch.index_select(views[part.view], 0, rows, out=scratch[:len(rows)])
                staging.index_copy_(0, index[part.staging], scratch[:len(rows)])

    def _scatter(self, chunk: Chunk, index: torch.Tensor, views: list[torch.Tensor], staging: torch.Tensor,
                 scratch: torch.Tensor) -> None:
        for part in chunk.views:
            rows = index[part.rows]
            if part.staging_start is not None:
                start = part.staging_start
                views[part.view].index_copy_(0, rows, staging[start:start + len(rows)])
            else:
                torch.index_select(staging, 0, index[part.staging], out=scratch[:len(rows)])
                views[part.view].index_copy_(0, rows, scratch[:len(rows)])

    def _runs(self, chunk: Chunk, store: bool) -> None:
        for po, so, n in zip(chunk.run_pool_offset.tolist(), chunk.run_staging_offset.tolist(),
                             chunk.run_size.tolist(), strict=True):
            if store:
                self._pool[po:po + n].copy_(self._staging[so:so + n], non_blocking=True)
            else:
                self._staging[so:so + n].copy_(self._pool[po:po + n], non_blocking=True)

    def _rows_of(self, unit: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Views, staging and scratch as rows of ``unit`` bytes, in the widest integer type all allow."""
        if unit not in self._rows:
            flats = [*self._views, self._staging, self._scratch]
            width = next(w for w in (8, 4, 2, 1) if unit % w == 0 and all(f.storage_offset() % w == 0
                                                                          for f in flats))
            dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[width]
            rows = [as_rows(f, unit, dtype) for f in flats]
            self._rows = {unit: (rows[:-2], rows[-2], rows[-1])}  # one unit at a time: units rarely change
        return self._rows[unit]


def as_rows(flat: torch.Tensor, unit: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D int8 tensor as rows of ``unit`` bytes typed ``dtype`` (a view: writing it writes ``flat``)."""
    n = flat.numel() // unit
    return flat[:n * unit].view(n, unit).view(dtype)
