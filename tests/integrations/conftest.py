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
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvoffload.integrations.vllm import compat
    from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

    shape = TinyShape(num_layers=1)
    model = write_tiny_model(tmp_path / "model", ModelFamily.LLAMA, shape)
    transfer = KVTransferConfig(kv_connector="KVOffloadConnector",
                                kv_connector_module_path="kvoffload.integrations.vllm.connector",
                                kv_role="kv_both", kv_connector_extra_config={"host_bytes": 1 << 20})
    config = EngineArgs(model=str(model), block_size=32, max_model_len=256, dtype="float32",
                        kv_transfer_config=transfer).create_engine_config()
    config.cache_config.kv_cache_layout = "LBNHC"  # no worker runs to resolve it; the CPU backend's own
    spec = FullAttentionSpec(block_size=32, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim,
                             dtype=torch.float32)
    kv_cache = compat.get_kv_cache_configs(config, [{"model.layers.0.self_attn.attn": spec}], [16 << 20])[0]
    return config, kv_cache
