"""The node tier's worker side check: ``NodeCheck`` fails every job that reads a node pool slot whose block
is not the one the scheduler pinned.

Pins keep a slot from being rewritten while this engine reads it, and the scheduler sends each slot's epoch with
the job (``HostBlocks.epochs``). A job reading slots (a load to the device, a write to a lower tier) runs only if
every slot was still there when pinned, and is reported failed unless every slot is ready at its epoch once the
copy finished (one pass over the index, the only check that counts: a pin taken before it was read): a block
that another engine evicted after this engine's lookup (epoch 0), or a slot rewritten under a reader because its
engine was wrongly judged dead, is a recompute, never wrong bytes. Jobs that write slots (stores, promotions into
slots this engine reserved) pass unchecked.
"""

from __future__ import annotations

import mmap
from collections.abc import Collection

from kvoffload import _nodeindex
from kvoffload.specs import HostBlocks, JobId, Medium, TransferJob
from kvoffload.tiers.node.segment import MISSING_EPOCH
from kvoffload.transfer.base import TransferHandler, TransferResult


class NodeCheck(TransferHandler):
    """``inner`` (a handler reading and writing node pool slots), with every slot read checked in ``index``."""

    def __init__(self, inner: TransferHandler, index: mmap.mmap) -> None:
        self._inner = inner
        self._index = index
        self._reads: dict[JobId, HostBlocks] = {}
        self._refused: list[TransferResult] = []
        self.refused = 0
        """Jobs failed by this check (before or after their copies), for tests and logs."""

    def submit(self, job: TransferJob) -> bool:
        src = job.src
        if not isinstance(src, HostBlocks) or not src.epochs:
            return self._inner.submit(job)
        if MISSING_EPOCH in src.epochs:  # gone before it was pinned: no copy (the check after is the one that counts)
            self._refuse(job.job_id, job.transfer_type)
            return True
        accepted = self._inner.submit(job)
        if accepted:
            self._reads[job.job_id] = src
        return accepted

    def get_finished(self) -> list[TransferResult]:
        results, self._refused = self._refused, []
        for result in self._inner.get_finished():
            src = self._reads.pop(result.job_id, None)
            if src is not None and result.success and not self._intact(src):
                self.refused += 1
                result = TransferResult(result.job_id, False, 0, result.seconds, result.transfer_type)
            results.append(result)
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def _intact(self, src: HostBlocks) -> bool:
        return bool(_nodeindex.verify(self._index, src.slots, src.epochs))

    def _refuse(self, job_id: JobId, transfer_type: tuple[Medium, Medium]) -> None:
        self.refused += 1
        self._refused.append(TransferResult(job_id, False, 0, 0.0, transfer_type))
