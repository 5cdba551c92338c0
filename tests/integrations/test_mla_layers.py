"""MLA (DeepSeek-style latent attention) layers as vLLM 0.32 builds them: kvoffload copies exactly each layer's
latent page, and names them in a namespace that every tensor-parallel rank shares.

The KV cache here is vLLM's own: ``MLAAttentionSpec`` as ``MLAAttention.get_kv_cache_spec`` builds it (one KV
head, ``max_tp_shards=1``, head size ``kv_lora_rank + qk_rope_head_dim``), groups and tensors from
``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` (the engine core), memory from ``allocate_kv_cache``
(the model runner).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, VllmConfig

try:  # vLLM 0.33 moved the planner
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.31 and 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvoffload.canonical import canonicalize
from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm import adapters
from kvoffload.layout import LatentAttentionSpec

NUM_BLOCKS = 6
BLOCK_SIZE = 16  # CPU_MLA's block size (AMX_MLA takes multiples of 32); no kernel runs here, any size builds
LATENT = 512 + 64  # DeepSeek-V2: kv_lora_rank + qk_rope_head_dim, the only head size of the CPU MLA kernel
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def mla_spec(**overrides: Any) -> MLAAttentionSpec:
    """What ``MLAAttention.get_kv_cache_spec`` returns for a bf16 DeepSeek-V2 layer."""
    fields: dict[str, Any] = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "max_tp_shards": 1, "head_size": LATENT,
                              "dtype": torch.bfloat16, "cache_dtype_str": "auto", **overrides}
    return MLAAttentionSpec(**fields)


def vllm_kv_cache(specs: dict[str, KVCacheSpec]) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    config = VllmConfig(cache_config=CacheConfig(num_gpu_blocks_override=NUM_BLOCKS), device_config=DeviceConfig("cpu"))
    config.cache_config.kv_cache_layout = "LBNHC"  # what vLLM resolves for the CPU MLA backend
    config.scheduler_config.disable_hybrid_kv_cache_manager = False  # off where vLLM finds no platform (0.33, 0.34)
    groups = get_kv_cache_groups(config, specs)
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, available_memory=1 << 30)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    return kv_cache_config, allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


def deepseek() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    return vllm_kv_cache(dict.fromkeys(LAYERS, mla_spec()))


def test_vllm_registers_each_mla_layer_as_one_latent_tensor() -> None:
    _, kv_caches = deepseek()
    for name in LAYERS:
        assert tuple(kv_caches[name].shape) == (NUM_BLOCKS, 1, BLOCK_SIZE, LATENT)
        assert kv_caches[name].dtype == torch.bfloat16


def test_adapter_describes_mla_layers_as_latent_pages_and_the_layout_as_replicated() -> None:
    kv_cache_config, _ = deepseek()
    layout = adapters.kv_cache_layout(kv_cache_config, "LBNHC")
    assert layout.groups[0].specs[LAYERS[0]] == LatentAttentionSpec(BLOCK_SIZE, LATENT, torch.bfloat16)
    assert layout.group_block_bytes(0) == len(LAYERS) * mla_spec().real_page_size_bytes
    assert layout.replicated
    assert "latent(16,576,bfloat16)*3" in layout.describe()


def test_each_canonical_block_is_the_latent_vectors_the_model_layer_wrote() -> None:
    kv_cache_config, kv_caches = deepseek()
    kv = canonicalize(adapters.kv_cache_layout(kv_cache_config, "LBNHC"), kv_caches)
    for layer, name in enumerate(LAYERS):
        for b in range(NUM_BLOCKS):
            kv_caches[name][b] = float(1 + layer * NUM_BLOCKS + b)  # every token's latent in block b
    for b in range(NUM_BLOCKS):
        block = torch.cat([kv.views[r.view][b, :r.nbytes] for r in kv.group_refs[0]])
        expected = torch.cat([kv_caches[name][b].reshape(-1).view(torch.int8) for name in LAYERS])
        assert torch.equal(block, expected)
    kv.views[kv.group_refs[0][1].view][4] = 0  # a load through the view is what the model layer reads
    assert not kv_caches[LAYERS[1]][4].any() and kv_caches[LAYERS[1]][3].all()


@pytest.mark.parametrize(("spec", "why"), [
    (mla_spec(cache_dtype_str="fp8_ds_mla", dtype=torch.uint8, state_content_bytes=656), "fp8_ds_mla"),
    (mla_spec(max_tp_shards=None), "max_tp_shards None"),
    (mla_spec(tokens_per_state=4, model_version="deepseek_v4"), "bytes a block"),
    (HiddenStateCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=1, max_tp_shards=1, head_size=LATENT,
                          dtype=torch.bfloat16), "HiddenStateCacheSpec"),
])
def test_mla_pages_packed_or_sharded_otherwise_are_refused_by_name(spec: MLAAttentionSpec, why: str) -> None:
    with pytest.raises(adapters.UnsupportedKVCacheError, match=fr"'{LAYERS[0]}'.*{why}"):
        adapters.layer_spec(LAYERS[0], spec)


def test_a_model_mixing_mla_and_other_attention_stays_per_rank() -> None:
    attn = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=LATENT // 2, dtype=torch.bfloat16)
    layout = adapters.kv_cache_layout(vllm_kv_cache({LAYERS[0]: mla_spec(), LAYERS[1]: attn})[0], "LBNHC")
    assert not layout.replicated


def vllm_config(**parallel: int) -> Any:
    hf = SimpleNamespace(to_dict=lambda: {"model_type": "deepseek_v2"})
    model = SimpleNamespace(model="tiny-deepseek", dtype=torch.bfloat16, hf_config=hf, quantization=None,
                            revision=None, code_revision=None)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"),
                           parallel_config=ParallelConfig(**parallel))


@pytest.mark.parametrize(("parallel", "replicated"), [
    ({}, True),
    ({"tensor_parallel_size": 2}, True),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, False),  # stages hold other layers
    ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2}, False),  # ranks hold other tokens
])
def test_mla_namespace_is_shared_by_tensor_parallel_ranks_only(parallel: dict[str, int], replicated: bool) -> None:
    layout = adapters.kv_cache_layout(deepseek()[0], "LBNHC")
    config = vllm_config(**parallel)
    world = config.parallel_config.world_size
    spaces = [adapters.namespace(config, layout, OffloadConfig(), rank) for rank in range(world)]
    assert all(ns.replicated is replicated for ns in spaces)
    assert (len({ns.fingerprint() for ns in spaces}) == 1) is replicated
    single = adapters.namespace(vllm_config(), layout, OffloadConfig(), 0)
    assert (spaces[-1].fingerprint() == single.fingerprint()) is replicated  # TP=1 and TP=2 share the copy


def test_a_non_mla_namespace_is_per_rank_as_before() -> None:
    attn = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    layout = adapters.kv_cache_layout(vllm_kv_cache(dict.fromkeys(LAYERS, attn))[0], "LBNHC")
    config = vllm_config(tensor_parallel_size=2)
    spaces = [adapters.namespace(config, layout, OffloadConfig(), rank) for rank in range(2)]
    assert not any(ns.replicated for ns in spaces)
    assert spaces[0].fingerprint() != spaces[1].fingerprint()
    assert replace(spaces[1], rank=0) == spaces[0]
