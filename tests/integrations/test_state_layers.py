"""State layers (ShortConv, Mamba2, gated delta net) as vLLM 0.32 builds them: kvoffload copies exactly their bytes.

The KV cache here is vLLM's own: specs from the shape and dtype calculators the model layers call, groups and
tensors from ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` (the engine core), memory from
``allocate_kv_cache`` (the model runner), and each layer's per-state tensors cut by ``MambaBase.bind_kv_cache``
(the model layer). Only the hybrid page padding is ours, the rule of ``Platform._align_hybrid_block_size``.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, DeviceConfig, SpeculativeConfig, VllmConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

try:  # vLLM 0.33 moved the planner
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.31 and 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.worker.utils import allocate_kv_cache

from kvoffload.canonical import CanonicalKV, canonicalize
from kvoffload.integrations.vllm import adapters
from kvoffload.layout import StateSpec
from kvoffload.testing.layouts import GDN_DTYPES, GDN_SHAPES

NUM_BLOCKS = 6
KERNEL_ALIGNMENT = 32  # vLLM's CPU attention takes block sizes that are multiples of 32


def shortconv_spec() -> MambaSpec:
    """LFM2's ShortConv layer (``ShortConv.get_state_shape`` / ``get_state_dtype``), float32 as on CPU."""
    shapes = MambaStateShapeCalculator.short_conv_state_shape(tp_world_size=1, intermediate_size=64, conv_kernel=3)
    dtypes = MambaStateDtypeCalculator.short_conv_state_dtype(torch.float32, "auto")
    return MambaSpec(block_size=1, shapes=shapes, dtypes=dtypes, mamba_type=MambaAttentionBackendEnum.SHORT_CONV)


def mamba2_spec() -> MambaSpec:
    """A Mamba2 mixer (``MambaMixer2``): bf16 conv state, float32 SSM state, an internal prefill checkpoint."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=128, n_groups=1, num_heads=4, head_dim=32, state_size=16,
        conv_kernel=4)
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", "float32")
    return MambaSpec(block_size=1, shapes=shapes, dtypes=dtypes, num_prefill_checkpoint_blocks=1,
                     prefill_checkpoint_alignment=1)


def gdn_spec() -> MambaSpec:
    """Qwen3-Next's gated delta net: bf16 conv state, float32 recurrent state (vLLM CPU resets it to float32)."""
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_world_size=1, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel_size=4)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32")
    return MambaSpec(block_size=1, shapes=shapes, dtypes=dtypes, mamba_type=MambaAttentionBackendEnum.GDN_ATTN)


FAMILIES = {"shortconv": shortconv_spec, "mamba2": mamba2_spec, "gdn": gdn_spec}


def hybrid_specs(state: MambaSpec, cache_mode: str = "align") -> dict[str, KVCacheSpec]:
    """State and attention layers alternating, pages padded to one size as vLLM pads them for hybrid models:
    the smallest block size (a multiple of the kernel's) whose attention page holds the state page, and the
    state page padded to that attention page."""
    dtype = state.dtypes[0]
    per_token = FullAttentionSpec(block_size=1, num_kv_heads=2, head_size=16, dtype=dtype).page_size_bytes
    block_size = KERNEL_ALIGNMENT * -(-state.page_size_bytes // (KERNEL_ALIGNMENT * per_token))
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=dtype)
    padded = replace(state, block_size=block_size, page_size_padded=attn.page_size_bytes,
                     mamba_cache_mode=cache_mode)
    return {"layers.0.mixer": padded, "layers.1.attn": attn, "layers.2.mixer": padded, "layers.3.attn": attn}


def engine_config(**cache: object) -> VllmConfig:
    config = VllmConfig(cache_config=CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, **cache),  # type: ignore[arg-type]
                        device_config=DeviceConfig("cpu"))
    config.cache_config.kv_cache_layout = "LBHNC"  # what vLLM resolves on CPU (and for FlashAttention on GPU)
    # A state layer beside attention needs vLLM's hybrid manager, which VllmConfig turns off where it finds no
    # platform (vLLM 0.33 and 0.34 here: no CPU build); planning the KV cache needs no device.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def vllm_kv_cache(config: VllmConfig, specs: dict[str, KVCacheSpec]) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """What the engine core plans and the model runner allocates and hands to ``register_kv_caches``."""
    groups = get_kv_cache_groups(config, specs)
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, available_memory=1 << 30)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    return kv_cache_config, allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


def model_layer_states(spec: MambaSpec, pages: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The per-state tensors the model layer computes with, cut by vLLM's own ``MambaBase.bind_kv_cache``."""
    layer = SimpleNamespace(get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes,
                            state_alignment=getattr(spec, "state_alignment", 1))  # vLLM 0.34 on
    MambaBase.bind_kv_cache(layer, pages)  # type: ignore[arg-type]
    states: tuple[torch.Tensor, ...] = layer.kv_cache
    return states


def pattern(layer: int, state: int, block: int) -> int:
    """A distinct non-zero byte for every (layer, state, block)."""
    return 1 + (layer * 31 + state * 7 + block) % 120


def canonical_block(kv: CanonicalKV, group: int, block: int) -> torch.Tensor:
    return torch.cat([kv.views[r.view][block, :r.nbytes] for r in kv.group_refs[group]])


def registered(family: str) -> tuple[KVCacheConfig, dict[str, torch.Tensor], CanonicalKV]:
    kv_cache_config, kv_caches = vllm_kv_cache(engine_config(), hybrid_specs(FAMILIES[family]()))
    layout = adapters.kv_cache_layout(kv_cache_config, "LBHNC")
    return kv_cache_config, kv_caches, canonicalize(layout, kv_caches)


def state_group(kv_cache_config: KVCacheConfig) -> tuple[int, MambaSpec, list[str]]:
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            return g, group.kv_cache_spec, list(group.layer_names)
    raise AssertionError("no state group")


# ---- the layout vLLM registers ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_registers_each_state_layer_as_one_int8_view_of_padded_pages(family: str) -> None:
    kv_cache_config, kv_caches, _ = registered(family)
    _, spec, names = state_group(kv_cache_config)
    for name in names:
        pages = kv_caches[name]
        assert pages.dtype == torch.int8
        assert tuple(pages.shape) == (NUM_BLOCKS, 1, 1, spec.real_page_size_bytes)
        assert pages.stride(0) == spec.page_size_bytes > spec.real_page_size_bytes  # padded to the attention page


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapter_describes_the_states_vllm_packs_into_a_page(family: str) -> None:
    kv_cache_config, _, _ = registered(family)
    g, spec, names = state_group(kv_cache_config)
    ours = adapters.kv_cache_layout(kv_cache_config, "LBHNC").groups[g].specs[names[0]]
    assert isinstance(ours, StateSpec)
    assert ours.shapes == spec.shapes and ours.dtypes == tuple(spec.dtypes)
    assert ours.page_bytes == spec.real_page_size_bytes and ours.padded_page_bytes == spec.page_size_bytes


def test_states_vllm_pads_to_an_alignment_are_refused() -> None:
    """vLLM 0.34 may align each state within a page (``MambaSpec.state_alignment``, FlashInfer's ReplaySSM on GPU);
    kvoffload describes states packed from byte 0, so a page with gaps between its states is refused, not
    copied at the wrong offsets."""
    spec = mamba2_spec()
    if not hasattr(spec, "state_alignment"):
        pytest.skip("this vLLM packs states without alignment (vLLM 0.34 added state_alignment)")
    conv_bytes = spec.shapes[0][0] * spec.shapes[0][1] * spec.dtypes[0].itemsize
    aligned = replace(spec, state_alignment=2 * conv_bytes)  # pads the conv state: a gap before the SSM state
    assert aligned.real_page_size_bytes > spec.real_page_size_bytes
    with pytest.raises(adapters.UnsupportedKVCacheError, match=r"model\.layers\.0\.mixer"):
        adapters.layer_spec("model.layers.0.mixer", aligned)
    assert isinstance(adapters.layer_spec("model.layers.0.mixer", replace(spec, state_alignment=1)), StateSpec)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_refs_cover_exactly_each_state_of_each_block_as_the_model_layer_writes_it(family: str) -> None:
    kv_cache_config, kv_caches, kv = registered(family)
    g, spec, names = state_group(kv_cache_config)
    ours = StateSpec(spec.shapes, spec.dtypes)
    for layer, name in enumerate(names):
        for i, state in enumerate(model_layer_states(spec, kv_caches[name])):
            for b in range(NUM_BLOCKS):
                state[b].view(torch.int8).fill_(pattern(layer, i, b))
    assert kv.group_block_bytes(g) == len(names) * spec.real_page_size_bytes  # no padding, nothing left out
    for b in range(NUM_BLOCKS):
        block = canonical_block(kv, g, b)
        offset = 0
        for layer in range(len(names)):
            for i in range(len(spec.shapes)):
                start, end = ours.state_range(i)
                assert bool((block[offset + start:offset + end] == pattern(layer, i, b)).all())
            offset += ours.page_bytes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_load_through_the_canonical_views_is_what_the_model_layer_reads(family: str) -> None:
    kv_cache_config, kv_caches, kv = registered(family)
    g, spec, names = state_group(kv_cache_config)
    ours = StateSpec(spec.shapes, spec.dtypes)
    for ref in kv.group_refs[g]:
        kv.views[ref.view][4, :ref.nbytes] = torch.arange(ref.nbytes, dtype=torch.int64).remainder(97).to(torch.int8)
    for name in names:
        for i, state in enumerate(model_layer_states(spec, kv_caches[name])):
            start, end = ours.state_range(i)
            expected = torch.arange(start, end, dtype=torch.int64).remainder(97).to(torch.int8)
            assert torch.equal(state[4].reshape(-1).view(torch.int8), expected)
            assert not state[3].view(torch.int8).any()  # the neighbour block is untouched


def test_the_simulated_engines_gdn_layout_has_the_states_vllm_computes() -> None:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_world_size=1, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4, conv_kernel_size=4)
    assert shapes == GDN_SHAPES
    assert MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32") == GDN_DTYPES


# ---- which state layers kvoffload accepts -------------------------------------------------------------------


def check(config: VllmConfig, specs: dict[str, KVCacheSpec]) -> None:
    kv_cache_config, _ = vllm_kv_cache(config, specs)
    adapters.check_state_layers(config, kv_cache_config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_align_mode_with_prefix_caching_is_accepted(family: str) -> None:
    check(engine_config(enable_prefix_caching=True), hybrid_specs(FAMILIES[family]()))


def test_mode_none_is_refused_naming_the_layer_and_prefix_caching() -> None:
    with pytest.raises(adapters.UnsupportedKVCacheError, match=r"'layers.0.mixer'.*'none'.*enable_prefix_caching"):
        check(engine_config(enable_prefix_caching=False), hybrid_specs(shortconv_spec(), cache_mode="none"))


def test_speculative_state_blocks_are_refused_naming_the_layer() -> None:
    specs = hybrid_specs(replace(gdn_spec(), num_speculative_blocks=2))
    with pytest.raises(adapters.UnsupportedKVCacheError, match=r"'layers.0.mixer'.*speculative"):
        check(engine_config(), specs)


def test_speculative_decoding_without_state_blocks_is_refused() -> None:
    config = engine_config()
    config.speculative_config = SpeculativeConfig.__new__(SpeculativeConfig)  # any draft method: set, not run
    with pytest.raises(adapters.UnsupportedKVCacheError, match="speculative_config=None"):
        check(config, hybrid_specs(shortconv_spec()))


def test_prefix_hashes_inside_a_state_block_are_refused() -> None:
    specs = hybrid_specs(mamba2_spec())
    block_size = specs["layers.0.mixer"].block_size
    with pytest.raises(adapters.UnsupportedKVCacheError, match=fr"'layers.0.mixer'.*prefix_match_unit.*{block_size}"):
        check(engine_config(prefix_match_unit=KERNEL_ALIGNMENT), specs)


def test_attention_only_models_are_not_checked() -> None:
    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16)
    check(engine_config(enable_prefix_caching=False), {"layers.0.attn": attn})


def test_state_pages_in_another_shape_are_refused_by_the_adapter() -> None:
    spec = replace(shortconv_spec(), num_heads=2)
    with pytest.raises(adapters.UnsupportedKVCacheError, match="'m'"):
        adapters.layer_spec("m", spec)


# ---- which blocks of a state model are stored ---------------------------------------------------------------


def test_models_with_state_layers_store_prompt_blocks_only() -> None:
    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16)
    assert adapters.stores_prompt_blocks_only(vllm_kv_cache(engine_config(), hybrid_specs(gdn_spec()))[0])
    assert not adapters.stores_prompt_blocks_only(vllm_kv_cache(engine_config(), {"layers.0.attn": attn})[0])


def decode_step(req_id: str, computed_before: int) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    cached.req_ids.append(req_id)
    cached.new_block_ids.append(None)
    cached.num_computed_tokens.append(computed_before)
    cached.num_output_tokens.append(computed_before - 300)
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = {req_id: 1}
    return out


def test_a_decode_step_is_one_column_per_request_of_the_tokens_computed_after_it() -> None:
    step = adapters.step_schedule(decode_step("r", computed_before=383))
    assert list(step.req_ids) == ["r"] and list(step.new_block_ids) == [None]
    assert step.computed_after() == [384]
