"""kvoffload's tier events as vLLM KV events (``BlockStored`` / ``BlockRemoved``), for vLLM's KV-event publisher.

Place in the data flow: ``SchedulerSide.take_events`` (scheduler_side.py) drains the index's ``OffloadEvent`` values
and passes them here; nothing here keeps state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent

from kvoffload.blocks import Medium
from kvoffload.index.base import EventKind, OffloadEvent

MEDIUM_REMOTE = "REMOTE"
"""The remote tier's events: vLLM 0.32 names GPU, CPU and STORAGE only, and a router must tell a store shared by
many engines (any of them can load it) from this engine's own disk."""

_MEDIUM = {Medium.HOST: MEDIUM_CPU, Medium.DISK: MEDIUM_STORAGE, Medium.REMOTE: MEDIUM_REMOTE, Medium.DEVICE: "GPU"}


def kv_events(events: Iterable[OffloadEvent], block_tokens: int) -> list[KVCacheEvent]:
    """Our tier events as vLLM KV events.

    vLLM's events carry block hashes; ours are the 16-byte offload keys (content hash chained from the
    namespace root, group index folded in), stable across processes and machines. ``token_ids`` and
    ``parent_block_hash`` are left empty: tiers index keys, not tokens.
    """
    out: list[KVCacheEvent] = []
    for event in events:
        hashes: list[Any] = [bytes(k) for k in event.keys]
        medium = _MEDIUM.get(event.medium) or event.medium.value.upper()  # another package's tier: its own name
        if event.kind is EventKind.STORED:
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                   block_size=block_tokens, lora_id=None, medium=medium, lora_name=None))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium))
    return out
