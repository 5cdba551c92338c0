"""The node tier's worker side check: ``NodeCheck`` fails every job that reads a node pool slot whose block
is not the one the scheduler pinned.

Pins keep a slot from being rewritten while this engine reads it, and the scheduler sends each slot's epoch with
the job (``HostBlocks.epochs``). A job reading slots (a load to the device, a write to a lower tier) runs only if
every slot was still there when pinned, and is reported failed unless every slot is ready at its epoch once the
copy finished (one pass over the index, the only check that counts: a pin taken before it was read): a block
that another engine evicted after this engine's lookup (epoch 0), or a slot rewritten under a reader because its
engine was wrongly judged dead, is a recompute, never wrong bytes. A job writing slots (a store, a promotion into
slots this engine reserved) runs only if each slot is in flight at its epoch in this worker's index: a scheduler
holding another generation of the pool's files than its workers (the set was made anew between their start-ups)
never has them write into slots of a pool it does not index. A job whose slots lie in a pool file truncated under
it (``_mapguard`` caught the fault) fails, and so does every later one. Whatever the index or the inner handler
raises becomes a failed job.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

from kvoffload import _nodeindex
from kvoffload.blocks import HostBlocks, JobId, TransferJob
from kvoffload.tiers.node.segment import MISSING_EPOCH
from kvoffload.transfer.base import HandlerWrapper, TransferHandler, TransferResult

logger = logging.getLogger(__name__)


class NodeCheck(HandlerWrapper):
    """``inner`` (a handler reading and writing node pool slots), with every slot read or written checked in
    ``index``; ``pool_lost`` says whether the pool's mapping was lost to a truncated file."""

    def __init__(self, inner: TransferHandler, index: mmap.mmap, pool_lost: Callable[[], bool] | None = None) -> None:
        super().__init__(inner)
        self._index = index
        self._pool_lost = pool_lost
        self._reads: dict[JobId, HostBlocks | None] = {}  # the slots each job reads, None for one that writes
        self.refused = 0
        """Jobs failed by this check (before or after their copies), for tests and logs."""

    def submit(self, job: TransferJob) -> bool:
        src, dst = job.src, job.dst
        reads = src if isinstance(src, HostBlocks) and src.epochs else None
        writes = dst if isinstance(dst, HostBlocks) and dst.epochs else None
        # gone before it was pinned (the check after is the one that counts), or not this pool's slots to write
        if (reads is not None and MISSING_EPOCH in reads.epochs) or self._lost() or \
                (writes is not None and not self._verify(writes, _nodeindex.IN_FLIGHT)):
            return self._refuse(job)
        try:
            accepted = self._inner.submit(job)
        except Exception:
            logger.exception("node tier: a job on the node pool could not be submitted; it fails")
            return self._refuse(job)
        if accepted:
            self._reads[job.job_id] = reads
        return accepted

    def _checked(self, result: TransferResult) -> TransferResult:
        reads = self._reads.pop(result.job_id, None)
        broken = self._lost() or (reads is not None and not self._verify(reads, _nodeindex.READY))
        if not (result.success and broken):
            return result
        self.refused += 1
        return TransferResult(result.job_id, False, 0, result.seconds, result.transfer_type)

    def _verify(self, blocks: HostBlocks, state: int) -> bool:
        try:
            return bool(_nodeindex.verify(self._index, blocks.slots, blocks.epochs, state))
        except _nodeindex.Damaged:
            return False

    def _lost(self) -> bool:
        return self._pool_lost is not None and self._pool_lost()

    def _refuse(self, job: TransferJob) -> bool:
        self.refused += 1
        return self._answer(job, False)
