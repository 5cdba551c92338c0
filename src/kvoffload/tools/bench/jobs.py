"""What the tier benches (``disk``, ``remote``, ``object``) share: a round's store and load jobs, and one job timed
from submit to its result."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def round_trip(rnd: int, blocks: int, medium: Any) -> tuple[Any, Any]:
    """Round ``rnd``'s store job (host slots 0.. to fresh keys of the tier of ``medium``) and the load job back."""
    from kvoffload.blocks import HostBlocks, JobId, TierBlocks, TransferJob
    from kvoffload.keys import offload_key

    keys = tuple(offload_key(rnd.to_bytes(4, "little") + i.to_bytes(8, "little"), 0)  # type: ignore[arg-type]
                 for i in range(blocks))
    host, tier = HostBlocks(tuple(range(blocks)), (blocks,)), TierBlocks(medium, keys, (blocks,))
    return TransferJob(JobId(2 * rnd), host, tier), TransferJob(JobId(2 * rnd + 1), tier, host)


def timed_job(handler: Any, job: Any) -> float:
    """Seconds from submitting ``job`` to its result.

    Raises:
        RuntimeError: the job failed (the handler's log says why).
    """
    start = time.perf_counter()
    handler.submit(job)
    handler.wait([job.job_id])
    elapsed = time.perf_counter() - start
    results: Sequence[Any] = handler.get_finished()
    if len(results) != 1 or not results[0].success:
        raise RuntimeError(f"bench: job {job.job_id} ({job.transfer_type[0].value} to "
                           f"{job.transfer_type[1].value}) failed (see the log)")
    return elapsed
