"""Turn a device<->host job into a flat list of byte-range copies, the input of the CPU and CUDA copiers.

``HostCopier`` (``transfer/host_copier.py``) validates each job here, at ``submit``, then builds a
``CopyPlan``: for every (engine block, layer ref) one copy between row ``block_id`` of a canonical KV view
and its place in a host-pool slot. Offsets are relative to the start of each view (row 0) and of the pool
buffer, so one plan serves raw pointer copies on CPU and tensor-slice copies on CUDA. Copies that continue
each other on both sides (runs of consecutive block ids landing in consecutive slots) are merged into one,
which is what makes large jobs run near memcpy speed. Copies of one job may run in any order (and are split
across threads); the plan lists them with the source in address order, which is worth a third of the copy time
at 4 KiB pages (the hardware prefetcher helps, and copies that continue each other end up side by side). A
load's holes (``specs.NO_BLOCK``: the engine's null block) get no copy, and so count in no byte total; a store
with a hole is malformed (stores are whole offload blocks).

The plan itself is built by one call into ``kvoffload._blockplan`` (C): it reads the job's ints, checks them,
radix-sorts each group by source address and emits the merged copies in one pass. A numpy version of the same
took 0.2-0.3 ms at 4096 blocks in the cold caches a forward pass leaves behind (twenty-odd numpy calls, each
missing them), a tenth of the copy time of 4 KiB pages; the C call takes a tenth of that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvoffload import _blockplan
from kvoffload.blocks import DeviceBlocks, HostBlocks, Medium, TransferJob
from kvoffload.canonical import CanonicalKV

Int64Array = npt.NDArray[np.int64]

STORE = (Medium.DEVICE, Medium.HOST)
LOAD = (Medium.HOST, Medium.DEVICE)


@dataclass(frozen=True)
class PlanLayout:
    """What plans need to know about the KV views and the pool, computed once per handler."""

    group_refs: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per group, per ref: (view index, byte offset inside the group's block, nbytes)."""
    group_block_bytes: tuple[int, ...]
    view_row_stride: tuple[int, ...]
    num_blocks: int
    num_slots: int
    slot_stride: int
    factor: int

    @classmethod
    def of(cls, kv: CanonicalKV, num_slots: int, slot_stride: int, factor: int) -> PlanLayout:
        refs = []
        for g_refs in kv.group_refs:
            offset, placed = 0, []
            for r in g_refs:
                placed.append((r.view, offset, r.nbytes))
                offset += r.nbytes
            refs.append(tuple(placed))
        return cls(
            group_refs=tuple(refs),
            group_block_bytes=tuple(kv.group_block_bytes(g) for g in range(len(kv.group_refs))),
            view_row_stride=tuple(int(v.stride(0)) for v in kv.views),
            num_blocks=kv.num_blocks,
            num_slots=num_slots,
            slot_stride=slot_stride,
            factor=factor,
        )

    @functools.cached_property
    def packed(self) -> bytes:
        """The layout as ``_blockplan.plan`` reads it: int64 values, in the order its source describes."""
        values = [self.num_blocks, self.num_slots, self.slot_stride, self.factor, len(self.view_row_stride),
                  len(self.group_refs), *self.view_row_stride]
        for block_bytes, refs in zip(self.group_block_bytes, self.group_refs, strict=True):
            values += [block_bytes, len(refs), *(value for ref in refs for value in ref)]
        return np.asarray(values, dtype=np.int64).tobytes()


@dataclass(frozen=True)
class CopyPlan:
    """Parallel arrays, one entry per copy: ``view[i]`` bytes at ``view_offset[i]`` <-> pool bytes at
    ``pool_offset[i]``, ``size[i]`` bytes. The direction comes from the job."""

    view: Int64Array
    view_offset: Int64Array
    pool_offset: Int64Array
    size: Int64Array
    nbytes: int

    def __len__(self) -> int:
        return len(self.size)


def validate_job(layout: PlanLayout, job: TransferJob) -> None:
    """Check that ``job`` is a well-formed device<->host job for this layout.

    Raises:
        ValueError: wrong media, group sizes that do not match the factor, or a block id or slot out of range.
    """
    if job.transfer_type == STORE:
        device, host = job.src, job.dst
    elif job.transfer_type == LOAD:
        device, host = job.dst, job.src
    else:
        raise ValueError(f"job {job.job_id}: transfer type {job.transfer_type} is not device<->host")
    assert isinstance(device, DeviceBlocks) and isinstance(host, HostBlocks)
    _check_sizes(layout, job, device, host)
    # Block ids, holes and slots are checked by build_plan, on the arrays it builds anyway.


def _check_sizes(layout: PlanLayout, job: TransferJob, device: DeviceBlocks, host: HostBlocks) -> None:
    groups = len(layout.group_refs)
    if len(device.group_sizes) != groups or len(host.group_sizes) != groups:
        raise ValueError(f"job {job.job_id}: group_sizes must have {groups} entries, got "
                         f"device {device.group_sizes}, host {host.group_sizes}")
    skip, factor = host.skip_sub_blocks, layout.factor
    if job.transfer_type == STORE and skip:
        raise ValueError(f"job {job.job_id}: a store cannot skip sub-blocks (skip_sub_blocks={skip})")
    if skip >= factor:
        raise ValueError(f"job {job.job_id}: skip_sub_blocks {skip} must be below the factor {factor}")
    expected = tuple(m * factor - skip if m else 0 for m in host.group_sizes)
    if device.group_sizes != expected:
        raise ValueError(f"job {job.job_id}: device group_sizes {device.group_sizes} do not match host "
                         f"{host.group_sizes} x factor {factor} - skip {skip} = {expected}")


def build_plan(layout: PlanLayout, job: TransferJob) -> CopyPlan:
    """The coalesced copies of a job that ``validate_job`` accepted.

    Raises:
        ValueError: a block id or slot out of range (the copiers write through raw addresses), a hole in a store,
            or ids and slots that are not int64 values.
    """
    store = job.transfer_type == STORE
    device, host = (job.src, job.dst) if store else (job.dst, job.src)
    assert isinstance(device, DeviceBlocks) and isinstance(host, HostBlocks)
    try:
        columns, count, nbytes = _blockplan.plan(layout.packed, device.block_ids, host.slots, device.group_sizes,
                                                 host.group_sizes, host.skip_sub_blocks, store)
    except ValueError as e:
        raise ValueError(f"job {job.job_id}: {e}") from None
    view, view_offset, pool_offset, size = np.frombuffer(columns, dtype=np.int64, count=4 * (len(columns) // 32)
                                                         ).reshape(4, -1)[:, :count]
    return CopyPlan(view, view_offset, pool_offset, size, nbytes)
