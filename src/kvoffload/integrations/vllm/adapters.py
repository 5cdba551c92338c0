"""Conversions from vLLM 0.32's objects to the connector halves' small engine-neutral values.

Place in the data flow: ``KVOffloadConnector`` (connector.py) receives vLLM objects on every hook and passes
what they say, through these functions, to ``ConnectorScheduler`` / ``ConnectorWorker``:

- ``KVCacheConfig``   -> ``KVCacheLayout``   (both halves, at start-up; sizes the host tier and names the
  namespace)
- ``Request``         -> ``EngineRequest``   (``VllmRequest``: token ids and the extra keys that change the
  KV)
- ``KVCacheBlocks``   -> block ids per KV-cache group
- ``SchedulerOutput`` -> ``StepSchedule``    (which requests ran this step, their new blocks, computed tokens)

Our tier events become vLLM's KV events in events.py.

Nothing here keeps state; every function is a pure translation.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1 import kv_cache_interface as vkv

from kvoffload.config import OffloadConfig, TenantBy
from kvoffload.connector.requests import StepSchedule
from kvoffload.integrations.vllm import compat
from kvoffload.keys import Namespace, extra_key
from kvoffload.layout import (
    AttentionSpec,
    KVBuffer,
    KVCacheLayout,
    KVGroup,
    LatentAttentionSpec,
    LayerSpec,
    StateSpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class UnsupportedKVCacheError(ValueError):
    """vLLM's KV cache uses a page format or placement that kvoffload cannot copy block by block."""


# ---- KVCacheConfig -> KVCacheLayout ------------------------------------------------------------------------


def layer_spec(name: str, spec: vkv.KVCacheSpec) -> LayerSpec:
    """Our description of one layer's page, from vLLM's spec for it."""
    if isinstance(spec, vkv.MambaSpec):
        state = StateSpec(spec.shapes, spec.dtypes, spec.page_size_padded)
        # vLLM views a state page as [num_blocks, num_heads, num_states, state bytes]
        # (kv_cache_interface.compute_layer_kv_cache_shape_bytes); every MambaBase layer has one of each, and
        # only then is a block's page the states packed from byte 0 (MambaBase.bind_kv_cache).
        if spec.num_heads == 1 and spec.num_states == 1 and state.page_bytes == spec.real_page_size_bytes:
            return state
    if isinstance(spec, vkv.MLAAttentionSpec):
        return latent_spec(name, spec)
    if isinstance(spec, vkv.AttentionSpec):
        ours = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                             spec.page_size_padded)
        # Packed or quantized pages (head_size_v != head_size, fp8 scales, compressed states) have other
        # sizes.
        if ours.page_bytes == spec.real_page_size_bytes:
            return ours
    raise UnsupportedKVCacheError(f"layer {name!r}: kvoffload cannot copy pages of {type(spec).__name__}")


def latent_spec(name: str, spec: vkv.MLAAttentionSpec) -> LatentAttentionSpec:
    """Our description of an MLA layer's page (DeepSeek-V2/V3 style): one latent vector of ``head_size``
    (``kv_lora_rank + qk_rope_head_dim``) per token, the same on every tensor-parallel rank.

    Refused: vLLM's subclasses (hidden-state caches), pages that vLLM does not replicate across TP ranks
    (``max_tp_shards`` other than 1) and packed pages (DeepSeek-V4's compressed states, ``fp8_ds_mla``'s scales).
    """
    if type(spec) is vkv.MLAAttentionSpec and spec.num_kv_heads == 1 and spec.max_tp_shards == 1:
        ours = LatentAttentionSpec(spec.block_size, spec.head_size, spec.dtype, spec.page_size_padded)
        if ours.page_bytes == spec.real_page_size_bytes:
            return ours
    raise UnsupportedKVCacheError(
        f"layer {name!r}: kvoffload copies MLA pages of one latent vector per token that every tensor-parallel "
        f"rank holds alike; this {type(spec).__name__} (num_kv_heads {spec.num_kv_heads}, max_tp_shards "
        f"{spec.max_tp_shards}, cache dtype {spec.cache_dtype_str!r}, {spec.real_page_size_bytes} bytes a "
        "block) is packed or sharded otherwise")


def _group(group: vkv.KVCacheGroupSpec) -> KVGroup:
    return KVGroup(tuple(group.layer_names), {name: layer_spec(name, spec) for name, spec in _layer_specs(group)})


def _layer_specs(group: vkv.KVCacheGroupSpec) -> Iterable[tuple[str, vkv.KVCacheSpec]]:
    spec = group.kv_cache_spec
    if isinstance(spec, vkv.UniformTypeKVCacheSpecs):
        return ((name, spec.kv_cache_specs[name]) for name in group.layer_names)
    return ((name, spec) for name in group.layer_names)


def check_state_layers(vllm_config: VllmConfig, kv_cache_config: vkv.KVCacheConfig) -> None:
    """Refuse state layers (Mamba2, ShortConv, gated delta net) whose offloaded blocks could not be restored.

    kvoffload stores engine block ``p`` of a state group under the key of tokens ``[0, (p + 1) * block_size)``
    and loads it back as the state after exactly those tokens, so block ``p`` must hold that state once it is
    full, and never change after. In vLLM 0.32 that holds only in ``mamba_cache_mode`` "align" (the default
    when prefix caching is on: ``MambaModelConfig.verify_and_update_config`` in
    model_executor/models/config.py), without speculative decoding and without sub-block prefix hits:

    - "align": a step's kernels write the state into block-table column ``(seq_len - 1) // block_size``
      (``mamba_get_block_table_tensor`` in v1/attention/backends/utils.py), the scheduler ends every chunk
      but a prompt's last on a block boundary ("slot p holds the state after exactly (p + 1) * block_size
      tokens": ``Scheduler._mamba_block_aligned_split``), and a request moving past a block starts a new one
      from a copy (``MambaManager.allocate_new_blocks``). Columns that no chunk ended in are vLLM's null
      block; kvoffload never stores a block run that contains it.
    - "none" (prefix caching off): one block per request (block size ``max_model_len``) holds the running
      state, rewritten every step: no block holds the state of a prefix.
    - speculative decoding (``MambaSpec.num_speculative_blocks``, EAGLE): ``_relocate_speculative_block``
      moves state blocks between columns, and an EAGLE checkpoint lands one block early
      (``get_mamba_prefill_checkpoint_position(drop_eagle_block=True)``).
    - a hash block smaller than the state block (``prefix_match_unit``; ``partial_hash_hits_enabled`` in
      v1/core/kv_cache_utils.py): vLLM checkpoints a block's state at a boundary inside it
      (``compute_mamba_prefill_checkpoints`` in model_executor/layers/mamba/checkpoint.py).

    Raises:
        UnsupportedKVCacheError: naming the first state layer that cannot be restored and what to change.
    """
    hash_block_size: int | None = None
    for group in kv_cache_config.kv_cache_groups:
        for name, spec in _layer_specs(group):
            if not isinstance(spec, vkv.MambaSpec):
                continue
            if spec.mamba_cache_mode != "align":
                raise UnsupportedKVCacheError(
                    f"layer {name!r}: mamba_cache_mode {spec.mamba_cache_mode!r} keeps no state per block (one "
                    "running state per request, rewritten every step), so kvoffload could not restore one; "
                    "enable prefix caching (enable_prefix_caching=True, vLLM then uses mamba_cache_mode 'align')")
            if spec.num_speculative_blocks or vllm_config.speculative_config is not None:
                raise UnsupportedKVCacheError(
                    f"layer {name!r}: with speculative decoding vLLM moves state blocks between block-table "
                    "columns, so a block may not hold the state after its own tokens; turn speculative "
                    "decoding off (speculative_config=None) to use kvoffload with this model")
            if hash_block_size is None:
                from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

                hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]
            if hash_block_size < spec.block_size:
                raise UnsupportedKVCacheError(
                    f"layer {name!r}: prefix-cache hashes every {hash_block_size} tokens inside "
                    f"{spec.block_size}-token state blocks let vLLM checkpoint a state inside a block; unset "
                    f"prefix_match_unit (or set it to {spec.block_size}) to use kvoffload with this model")


def stores_prompt_blocks_only(kv_cache_config: vkv.KVCacheConfig) -> bool:
    """True when only blocks that hold prompt tokens may be stored: models with state layers.

    A state block is right to load only if it holds what plain vLLM would compute for its tokens, which is a
    prefill chunk ending on the block's boundary. A state block that fills while the request decodes is
    written by the decode kernels instead, and on vLLM 0.32's CPU backend that state differs from the
    prefill's (LFM2: the ShortConv states after an attention layer differ by whole units, and outputs of a
    request loading it differ from plain vLLM's; tests/e2e/test_state_model.py). vLLM itself does not reuse
    such blocks by default: ``MambaManager.cache_blocks`` keeps, under ``prefix_cache_retention_interval``
    0, only the prompt's boundary states (``reachable_block_mask``). So for these models every group's
    blocks past the prompt are never stored; a later turn recomputes its previous output once, by prefill,
    and stores it then.
    """
    return any(isinstance(spec, vkv.MambaSpec) for group in kv_cache_config.kv_cache_groups
               for _, spec in _layer_specs(group))


def blocks_change_while_running(kv_cache_config: vkv.KVCacheConfig) -> bool:
    """True when vLLM may reuse or rewrite a running request's full block in the next step.

    Only full-attention blocks stay as written until the request ends. A sliding-window or chunked-local block
    is freed once it leaves the window. A state block ("align" mode, the only one ``check_state_layers``
    admits) is not rewritten once full, but vLLM frees it once the next block has taken over the running state
    (``MambaManager.remove_skipped_blocks``, one step after that copy at the earliest) and may give it to
    another request: stores must be done before that, which flushing them at the start of the next step
    (``handle_preemptions``, before vLLM's mamba pre-processing copies state) ensures.
    """
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, vkv.UniformTypeKVCacheSpecs) else [spec]
        if any(not isinstance(s, vkv.FullAttentionSpec) for s in specs):
            return True
    return False


def kv_cache_layout(kv_cache_config: vkv.KVCacheConfig, layout_name: str | None) -> KVCacheLayout:
    """Describe vLLM's KV cache without tensors.

    vLLM 0.32 places every layer in one backing allocation: layer ``l`` of a ``KVCacheTensor`` has block ``b``
    at ``offset + l * layer_stride + b * block_stride``, and cache groups overlay each other from byte 0.
    Layers whose pages start at the same address share memory (one ``KVBuffer``); a block-outermost placement
    (``layer_stride < block_stride``) is a cross-layer buffer.

    Raises:
        UnsupportedKVCacheError: a page format or placement kvoffload cannot copy (packed or sharded MLA pages,
            packed pages, pages that are not contiguous per block, several groups in one block-outermost
            allocation).
    """
    groups = tuple(_group(g) for g in kv_cache_config.kv_cache_groups if g.layer_names)
    tensors = kv_cache_config.kv_cache_tensors
    block_outer = [t for t in tensors if len(t.layers) > 1 and t.layer_stride < t.block_stride]
    backend = layout_name or ""
    if block_outer:
        if len(groups) != 1 or len(tensors) != 1:
            raise UnsupportedKVCacheError(
                f"block-outermost KV cache layout {backend!r} with {len(groups)} groups "
                f"and {len(tensors)} tensors"
            )
        return KVCacheLayout(kv_cache_config.num_blocks, groups, cross_layer=True, backend=backend)
    by_start: dict[int, list[str]] = defaultdict(list)
    strides: dict[int, int] = {}
    for t in tensors:
        for i, name in enumerate(t.layers):
            start = t.offset + i * t.layer_stride
            by_start[start].append(name)
            strides[start] = t.block_stride
    buffers = tuple(KVBuffer(kv_cache_config.num_blocks * strides[s], tuple(names))
                    for s, names in sorted(by_start.items()))
    return KVCacheLayout(kv_cache_config.num_blocks, groups, buffers, backend=backend)


def engine_block_size(kv_cache_config: vkv.KVCacheConfig, default: int) -> int:
    """The one block size of every KV-cache group (the scheduler's ``block_size``).

    Raises:
        UnsupportedKVCacheError: groups with different block sizes.
    """
    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups if g.layer_names}
    if len(sizes) > 1:
        raise UnsupportedKVCacheError(f"KV-cache groups with different block sizes {sorted(sizes)}")
    return sizes.pop() if sizes else default


def namespace(vllm_config: VllmConfig, layout: KVCacheLayout, config: OffloadConfig, rank: int) -> Namespace:
    """The key namespace: model and what decides its weights, dtypes, page layout, this process's rank.

    Replicated (one copy for all ranks, shared by every TP size) when every layer is latent attention and the
    ranks are tensor-parallel only: pipeline stages hold other layers, and context parallelism (prefill or
    decode) splits a sequence's tokens between ranks.
    """
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = f"{model_config.dtype}/{cache_dtype}"
    tensor_parallel_only = (parallel.world_size == parallel.tensor_parallel_size
                            and parallel.decode_context_parallel_size == 1)
    return Namespace(model=config.model_id or model_config.model, dtype=dtype, layout=layout.describe(), rank=rank,
                     world_size=parallel.world_size, weights=weights_identity(model_config, config.model_version),
                     replicated=layout.replicated and tensor_parallel_only)


# Hugging Face config fields that never change a KV page: where the files are, tool versions, output switches.
_NOT_KV_FIELDS = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "_attn_implementation_autoset",
    "_attn_implementation", "attn_implementation", "use_cache", "return_dict", "output_attentions",
    "output_hidden_states", "torchscript", "id2label", "label2id", "dtype", "torch_dtype",
})


def weights_identity(model_config: Any, model_version: str | None) -> str:
    """Everything of the model config that decides the weights, and so the KV of a prompt, as stable text.

    The Hugging Face config after vLLM applied ``hf_overrides`` (architecture, sizes, rope scaling, sliding
    windows, the checkpoint's quantization config, ...) less ``_NOT_KV_FIELDS``; vLLM's ``quantization``,
    ``revision`` and ``code_revision``; the user's ``model_version``, for checkpoints whose configs are the
    same. The dtypes are in the namespace already.
    """
    hf = {k: v for k, v in model_config.hf_config.to_dict().items() if k not in _NOT_KV_FIELDS}
    parts = {
        "hf_config": hf,
        "quantization": model_config.quantization,
        "revision": model_config.revision,
        "code_revision": model_config.code_revision,
        "model_version": model_version,
    }
    return json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))


# ---- requests and blocks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmRequest:
    """A vLLM ``Request`` as the scheduler half's ``EngineRequest``.

    ``extra_keys``: everything besides token ids that changes the KV of a prefix: the LoRA adapter (name and
    path), the cache salt and multimodal inputs (hash, offset and length in the prompt). They apply to the whole
    request (vLLM applies multimodal keys only to the blocks that hold the input; ours are stricter, which
    costs hits but never correctness).
    """

    request: Request

    @property
    def request_id(self) -> str:
        return str(self.request.request_id)

    @property
    def all_token_ids(self) -> Sequence[int]:
        tokens: Sequence[int] = self.request.all_token_ids
        return tokens

    @property
    def extra_keys(self) -> Sequence[str]:
        keys: list[str] = []
        lora = self.request.lora_request
        if lora is not None:
            # Name and path, as vLLM keys it; length-prefixed: the old "lora:{name}:{path}" was ambiguous.
            keys.append(extra_key("lora-v2", lora.lora_name, lora.lora_path))
        if self.request.cache_salt:
            keys.append(f"salt:{self.request.cache_salt}")
        # Each input with its place in the prompt: the same image at another position gives other KV.
        keys.extend(f"mm:{f.identifier}@{f.mm_position.offset}+{f.mm_position.length}"
                    for f in self.request.mm_features or ())
        return keys

    def tenant(self, by: TenantBy) -> str | None:
        if by is TenantBy.CACHE_SALT:
            return self.request.cache_salt or None
        if by is TenantBy.LORA and self.request.lora_request is not None:
            return str(self.request.lora_request.lora_name)
        return None

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        params = getattr(self.request, "kv_transfer_params", None)  # vLLM's OpenAI server fills it from the body
        return params if isinstance(params, Mapping) else None


def is_offloadable(request: Request) -> bool:
    """False for prompts given as embeddings: their token ids do not determine the KV."""
    return getattr(request, "prompt_embeds", None) is None


def block_ids_per_group(block_ids: Sequence[Sequence[int]] | None,
                        num_groups: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``tuple[list[int], ...]`` (or None: no new blocks) as tuples, one per group."""
    if block_ids is None:
        return ((),) * num_groups
    return tuple(tuple(ids) for ids in block_ids)


_NONE: frozenset[str] = frozenset()


def step_schedule(out: SchedulerOutput) -> StepSchedule:
    """This step's scheduled requests, by columns: blocks they gained and the tokens whose KV is computed after
    the step.

    The running requests' columns are vLLM's own lists (``CachedRequestData``), not copied per request; their
    new blocks are vLLM's per-group lists, or None. Speculative tokens are left out of the computed count: the
    engine may reject them. ``StepSchedule.resumed`` names every request whose blocks are its whole block table:
    each new request (vLLM 0.34 re-sends a resumed request in full among them, with its new table) and the
    running requests of ``resumed_req_ids`` (up to 0.33); preempted ones are ``preempted_req_ids``. Never vLLM's
    ``yield_req_data``: its flag meant "resumed" up to 0.32 and means "whole block table" (new requests too) from
    0.33 on (``AVOIDED`` in tools/vllm/api_surface.py).
    """
    new, cached = out.scheduled_new_reqs, out.scheduled_cached_reqs
    req_ids: list[str] = cached.req_ids
    new_block_ids: list[Any] = cached.new_block_ids
    before: list[int] = cached.num_computed_tokens
    resumed = compat.resumed_req_ids(cached)
    whole_table = frozenset(resumed) if resumed else _NONE
    if new:
        new_ids = [r.req_id for r in new]
        whole_table = whole_table.union(new_ids)
        req_ids = new_ids + req_ids
        new_block_ids = [r.block_ids for r in new] + new_block_ids
        before = [r.num_computed_tokens for r in new] + before
    preempted = frozenset(out.preempted_req_ids) if out.preempted_req_ids else _NONE
    if out.total_num_scheduled_tokens == len(req_ids) and not out.scheduled_spec_decode_tokens:
        # Every request got one token (each gets at least one): a decode step. vLLM's list goes as it is.
        return StepSchedule(req_ids, new_block_ids, before, 1, whole_table, preempted)
    scheduled = out.num_scheduled_tokens
    computed = [n + scheduled[r] for n, r in zip(before, req_ids, strict=True)]
    if out.scheduled_spec_decode_tokens:
        row = {r: i for i, r in enumerate(req_ids)}
        for req_id, spec in out.scheduled_spec_decode_tokens.items():
            computed[row[req_id]] -= len(spec)
    return StepSchedule(req_ids, new_block_ids, computed, 0, whole_table, preempted)
