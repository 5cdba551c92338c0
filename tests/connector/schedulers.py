"""What the scheduler half's tests build with: a small attention layout's scheduler, a request, a prefill that
stores a prompt, and the workers' report of a step's jobs. No tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvoffload.config import OffloadConfig, TenantBy
from kvoffload.connector.metadata import ConnectorMetadata, WorkerReport
from kvoffload.connector.requests import ScheduledRequest, StepSchedule
from kvoffload.connector.scheduler import ConnectorScheduler
from kvoffload.keys import Namespace
from kvoffload.layout import AttentionSpec, KVCacheLayout, KVGroup

BLOCK = 16
SPEC = AttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype="float16")  # 1 KiB pages


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[str, ...] = ()
    blocks: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None

    def tenant(self, by: TenantBy) -> str | None:
        return None


def make_scheduler(factor: int = 1, groups: int = 1, world_size: int = 1, host_blocks: int = 64,
                   **extra: Any) -> ConnectorScheduler:
    """A scheduler over a host tier of ``host_blocks`` offload blocks; ``extra``: more configuration keys."""
    layout = KVCacheLayout(num_blocks=128, groups=tuple(KVGroup.uniform([f"g{g}.l0"], SPEC) for g in range(groups)))
    config = OffloadConfig.from_dict({"offload_block_tokens": factor * BLOCK,
                                      "host_bytes": host_blocks * factor * SPEC.page_bytes, **extra})
    return ConnectorScheduler(config, layout, BLOCK, Namespace("m", "fp16", layout.describe(),
                                                               world_size=world_size))


def run_prefill(sched: ConnectorScheduler, req: Req, first_block: int = 0, num_groups: int = 1
                ) -> ConnectorMetadata:
    """Admit ``req`` with no hit and compute its whole prompt in one step; returns the step's metadata."""
    n_blocks = -(-len(req.all_token_ids) // BLOCK)
    req.blocks = list(range(first_block, first_block + n_blocks))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = [req.blocks] * num_groups
    sched.update_state_after_alloc(req, ids, 0)
    step = StepSchedule.of((ScheduledRequest(req.request_id, tuple(map(tuple, ids)), len(req.all_token_ids)),))
    return sched.build_connector_meta(step)


def complete(sched: ConnectorScheduler, meta: ConnectorMetadata, world_size: int = 1,
             failed: frozenset[int] | set[int] = frozenset()) -> None:
    """Every worker reports the step's store and load jobs: done, or failed for the ids in ``failed``."""
    jobs = [j.job_id for j in meta.store_jobs] + [lj.job.job_id for lj in meta.load_jobs]
    for _ in range(world_size):
        sched.update_connector_output(WorkerReport.of([j for j in jobs if j not in failed],
                                                        [j for j in jobs if j in failed]))
