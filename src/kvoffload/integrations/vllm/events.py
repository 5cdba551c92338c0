"""kvoffload's tier events as vLLM KV events, in the shape vLLM's own offloading connector publishes (vLLM 0.34's
self-describing tier events), so that a KV-aware router indexes them like the device's own.

Place in the data flow: the scheduler half describes each block it stores or finds while the request is at hand
(``VllmDescriber``, called through ``connector.announce.Announcer``); ``SchedulerSide.take_events``
(scheduler_side.py) drains the announcements and ``kv_events`` turns them into ``BlockStored`` / ``BlockRemoved``.

Per offloaded block (one per offload key, as vLLM's offloading connector does): vLLM's hash of each engine block it
covers, converted as the device's events convert them (``maybe_convert_block_hash``: an unsigned 64-bit int by
default), the parent's hash, the block's token ids, ``block_size`` = the engine block size, the LoRA id and name,
the extra keys each hash covers (the device's events' format), the KV-cache group with its spec's kind and window,
and the medium (``MEDIA``). A removal names the same hashes as the store it undoes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm import envs
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys
from vllm.v1.kv_cache_interface import KVCacheConfig, get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvoffload.blocks import Medium
from kvoffload.connector.announce import Announcement
from kvoffload.connector.requests import EngineRequest
from kvoffload.index.base import BlockDescription, EngineHash, EventKind
from kvoffload.integrations.vllm.adapters import VllmRequest

LOCAL = "LOCAL"
"""vLLM's ``Locality`` of a tier on the publishing engine's machine (``vllm.v1.kv_offload.base``)."""
MEDIUM_REMOTE = "REMOTE"
"""A store shared by every engine configured with it. vLLM names no such medium; Dynamo's indexer indexes it as
its "external" tier, apart from the disk (a medium it does not know it drops, event by event)."""

MEDIA: dict[Medium, tuple[str, str | None]] = {
    Medium.HOST: (MEDIUM_CPU, None),
    Medium.DISK: (MEDIUM_STORAGE, LOCAL),
    Medium.REMOTE: (MEDIUM_REMOTE, None),
    Medium.OBJECT: (MEDIUM_REMOTE, None),
}
"""Each tier's ``medium`` and ``locality`` in vLLM's events. The host tier and the node pool are host memory
(``CPU``, as vLLM's own offloading tier; no locality, as it sends none); the disk is this machine's storage; a
remote or object store is storage elsewhere, shared by every engine configured with it: ``REMOTE``, so that a
router keeps it apart from the disk (one removal drops a router's entry for a hash on a medium, whichever tier
sent it), without locality: ``REMOTE`` (vLLM: stored away from the publishing engine) makes Dynamo's indexer
leave the store out of this engine's blocks, though the engine loads it. A tier from another package is ``STORAGE``
without locality. ``ownership`` is never set: vLLM fills it for its secondary tiers' stores, and Dynamo's indexer
drops every store that has one."""


def medium_of(medium: Medium) -> tuple[str, str | None]:
    """``(medium, locality)`` of a tier's events."""
    return MEDIA.get(medium, (MEDIUM_STORAGE, None))


_U64 = (1 << 64) - 1


class VllmDescriber:
    """Describes offload blocks of vLLM requests (``connector.announce.Describe``): offload block ``b`` covers
    engine blocks ``[b * factor, (b + 1) * factor)``, whose hashes vLLM keeps on the request
    (``Request.block_hashes``, one per engine block)."""

    def __init__(self, factor: int, block_size: int, state_groups: frozenset[int]) -> None:
        self.factor = factor
        self.block_size = block_size
        self.state_groups = state_groups
        # vLLM's maybe_convert_block_hash reads its environment variable at every call (1.3 us, twice a block):
        # read once, then convert as it does (tests/integrations/test_events.py compares with the device's).
        self._ints = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

    def __call__(self, request: EngineRequest, block: int, group: int) -> BlockDescription | None:
        vllm_request = request.request if isinstance(request, VllmRequest) else None
        if vllm_request is None:
            return None
        hashes = vllm_request.block_hashes
        first, end = block * self.factor, (block + 1) * self.factor
        if end > len(hashes):
            return None  # vLLM hashes full blocks only, and has not hashed this one (yet)
        size = self.block_size
        if self._ints:
            ours: list[EngineHash] = [int.from_bytes(h, "big") & _U64 for h in hashes[first:end]]
            parent: EngineHash | None = int.from_bytes(hashes[first - 1], "big") & _U64 if first else None
        else:
            ours = [maybe_convert_block_hash(h) for h in hashes[first:end]]
            parent = maybe_convert_block_hash(hashes[first - 1]) if first else None
        lora = vllm_request.lora_request
        lora_id, lora_name = (lora.adapter_id, lora.name) if lora is not None else (None, None)
        if group in self.state_groups:
            # A state block is the state after its last token (vLLM's "state checkpoint"): its last hash alone,
            # chained to the one before, and no tokens.
            return BlockDescription((ours[-1],), ours[-2] if len(ours) > 1 else parent, (), size, group, lora_id,
                                    lora_name, None)
        tokens = tuple(vllm_request.all_token_ids[first * size:end * size])
        return BlockDescription(tuple(ours), parent, tokens, size, group, lora_id, lora_name,
                                _extra_keys(vllm_request, first, end, size))


def _extra_keys(request: Any, first: int, end: int, size: int) -> tuple[tuple[Any, ...] | None, ...] | None:
    """What besides tokens went into each engine block's hash, as the device's events publish it (None when
    nothing did, as vLLM's offloading connector sends)."""
    if request.lora_request is None and not request.cache_salt and not request.mm_features:
        return None
    keys = []
    for b in range(first, end):
        extra, _ = generate_block_hash_extra_keys(request, b * size, (b + 1) * size, 0)
        keys.append(extra)
    published = to_event_extra_keys(keys)
    if published is None or all(k is None for k in published):
        return None
    return tuple(published)


class GroupKinds:
    """Each KV-cache group's spec kind and sliding window, as vLLM's events carry them."""

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.kinds: list[tuple[str | None, int | None]] = [
            (get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups]

    def of(self, group: int) -> tuple[str | None, int | None]:
        return self.kinds[group] if group < len(self.kinds) else (None, None)


def kv_events(announcements: Iterable[Announcement], groups: GroupKinds | None = None) -> list[KVCacheEvent]:
    """The announcements as vLLM KV events, one per offloaded block."""
    out: list[KVCacheEvent] = []
    for a in announcements:
        d = a.description
        medium, locality = medium_of(a.medium)
        if a.kind is EventKind.STORED:
            kind, window = groups.of(d.group) if groups is not None else (None, None)
            out.append(BlockStored(
                block_hashes=list(d.block_hashes), parent_block_hash=d.parent_hash, token_ids=list(d.token_ids),
                block_size=d.block_size, lora_id=d.lora_id, medium=medium, lora_name=d.lora_name,
                extra_keys=_as_lists(d.extra_keys), group_idx=d.group, kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window, locality=locality))
        elif (last := out[-1] if out else None) is not None and type(last) is BlockRemoved and (
                last.medium, last.group_idx, last.locality) == (medium, d.group, locality):
            last.block_hashes.extend(d.block_hashes)  # one removal per group and tier, as vLLM batches them
        else:
            out.append(BlockRemoved(block_hashes=list(d.block_hashes), medium=medium, group_idx=d.group,
                                    locality=locality))
    return out


def _as_lists(extra_keys: Sequence[tuple[Any, ...] | None] | None) -> list[tuple[Any, ...] | None] | None:
    return None if extra_keys is None else list(extra_keys)
