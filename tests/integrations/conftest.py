"""Shared by the adapter tests: a real vLLM configuration with kvoffload configured, built without an engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def vllm_configs(tmp_path: Path) -> tuple[Any, Any]:
    """A real VllmConfig with the connector configured (one Llama layer, 32-token blocks), and vLLM's KV cache
    config for it (``compat.get_kv_cache_configs``: vLLM's planner, wherever the installed vLLM keeps it)."""
    pytest.importorskip("vllm")
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvoffload.integrations.vllm import compat
    from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

    shape = TinyShape(num_layers=1)
    model = write_tiny_model(tmp_path / "model", ModelFamily.LLAMA, shape)
    transfer = KVTransferConfig(kv_connector="KVOffloadConnector",
                                kv_connector_module_path="kvoffload.integrations.vllm.connector",
                                kv_role="kv_both", kv_connector_extra_config={"host_bytes": 1 << 20})
    # Built directly rather than by EngineArgs, which asks the platform for its device: vLLM 0.33 and 0.34 find
    # none here (no CPU build), and nothing in these tests runs on one.
    model_config = ModelConfig(model=str(model), dtype="float32", max_model_len=256, skip_tokenizer_init=True)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                        cache_config=CacheConfig(block_size=32), kv_transfer_config=transfer)
    config.cache_config.kv_cache_layout = "LBNHC"  # no worker runs to resolve it; the CPU backend's own
    spec = FullAttentionSpec(block_size=32, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim,
                             dtype=torch.float32)
    kv_cache = compat.get_kv_cache_configs(config, [{"model.layers.0.self_attn.attn": spec}], [16 << 20])[0]
    return config, kv_cache
