"""Fault injection for end-to-end tests: handler wrappers that fail, or silently corrupt, the first N load jobs.

``FailFirstLoads`` (configuration key ``inject_load_failures``) lets tests prove, against a real engine in another
process, that a failed load is recomputed and the outputs stay the same; the failed jobs copy nothing.
``CorruptFirstLoads`` (``inject_load_corruption``) makes a load deliver wrong KV while reporting success, so the
tests can prove that their output comparisons catch a wrong load: a check that passes whatever kvoffload loads
would prove nothing.
"""

from __future__ import annotations

from kvoffload.blocks import NO_BLOCK, DeviceBlocks, HostBlocks, Medium, TransferJob
from kvoffload.transfer.base import HandlerWrapper, TransferHandler
from kvoffload.transfer.host_pool import HostPool


class FailFirstLoads(HandlerWrapper):
    """Fails the first ``count`` load jobs without copying; every other job goes to ``inner``."""

    def __init__(self, inner: TransferHandler, count: int) -> None:
        super().__init__(inner)
        self._left = count

    def submit(self, job: TransferJob) -> bool:
        if self._left > 0 and job.dst.medium == Medium.DEVICE:
            self._left -= 1
            return self._answer(job, False)
        return self._inner.submit(job)


class CorruptFirstLoads(HandlerWrapper):
    """Zeroes the host copy of the first offload block that each of the first ``count`` load jobs copies, then
    loads.

    The job still succeeds, so the engine computes with wrong KV for that block (and for every later load of
    the same block, whose host copy stays zeroed): what a buggy copy or a lying tier would do. The block is the
    first one the load really copies: a sliding-window group's leading holes (``NO_BLOCK``) copy nothing, so
    zeroing their slot would change nothing the engine reads and the control would prove nothing.
    """

    def __init__(self, inner: TransferHandler, pool: HostPool, factor: int, count: int) -> None:
        super().__init__(inner)
        self._pool = pool
        self._factor = factor
        self._left = count

    def submit(self, job: TransferJob) -> bool:
        if self._left > 0 and isinstance(job.dst, DeviceBlocks) and isinstance(job.src, HostBlocks):
            slot = first_copied_slot(job.dst, job.src, self._factor)
            if slot is not None:
                self._left -= 1
                self._pool.slot(slot).zero_()
        return self._inner.submit(job)


def first_copied_slot(device: DeviceBlocks, host: HostBlocks, factor: int) -> int | None:
    """The host slot of the first device entry of a load that is not a hole (``blocks``: entry ``k`` of a group
    pairs with that group's host entry ``(k + skip_sub_blocks) // factor``), or None when every entry is one."""
    d0 = h0 = 0
    for dn, hn in zip(device.group_sizes, host.group_sizes, strict=True):
        for k in range(dn):
            if device.block_ids[d0 + k] != NO_BLOCK:
                return host.slots[h0 + (k + host.skip_sub_blocks) // factor]
        d0, h0 = d0 + dn, h0 + hn
    return None
