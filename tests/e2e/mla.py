"""The MLA attention backends vLLM's CPU platform runs on this machine, and the block size each takes.

vLLM picks AMX_MLA where ``torch.cpu._is_amx_tile_supported()`` (blocks a multiple of 32) and CPU_MLA elsewhere
(16-token blocks only); CPU_MLA can be requested explicitly on either. The MLA e2e tests run on the backend vLLM
picks and, where that is AMX_MLA, on CPU_MLA requested explicitly too, so both MLA paths are covered wherever AMX
exists. Nothing here hard-codes what one CPU accepts: the choice and the block sizes are vLLM's own answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

DEVICE_TOKENS = 512
"""The device cache of an MLA test engine, in tokens: two 200-token prompts fit, four do not."""


@dataclass(frozen=True)
class MlaBackend:
    """One MLA attention backend, as a test engine runs it."""

    name: str
    block_size: int
    explicit: bool
    """Requested through ``attention_config`` (otherwise it is the one vLLM picks here unasked)."""

    @property
    def device_blocks(self) -> int:
        return DEVICE_TOKENS // self.block_size

    def engine_args(self) -> dict[str, Any]:
        """``vllm.LLM`` arguments that run this backend with its block size and the tests' device cache."""
        args: dict[str, Any] = {"block_size": self.block_size, "num_gpu_blocks_override": self.device_blocks}
        if self.explicit:
            args["attention_config"] = {"backend": self.name}
        return args


def default_mla_backend_name() -> str:
    """The MLA backend vLLM's platform picks on this machine when none is requested."""
    selector = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=None,
                                       use_mla=True)
    path = current_platform.get_attn_backend_cls(None, selector)  # type: ignore[arg-type]
    for backend in AttentionBackendEnum:
        try:
            if backend.get_path() == path:
                return backend.name
        except ValueError:  # a backend that only a plugin registers: not the one picked
            continue
    raise LookupError(f"vLLM picked the MLA backend {path}, which is not in its AttentionBackendEnum")


def block_size_for(name: str) -> int:
    """The smallest block size the backend's kernel takes, as it declares it (an int or ``MultipleOf(n)``)."""
    sizes = AttentionBackendEnum[name].get_class().get_supported_kernel_block_sizes()
    return min(size if isinstance(size, int) else size.base for size in sizes)


def mla_backends() -> list[MlaBackend]:
    """vLLM's own choice first; then CPU_MLA, requested explicitly, where that choice is another backend."""
    default = default_mla_backend_name()
    backends = [MlaBackend(default, block_size_for(default), explicit=False)]
    if default != AttentionBackendEnum.CPU_MLA.name:
        cpu = AttentionBackendEnum.CPU_MLA.name
        backends.append(MlaBackend(cpu, block_size_for(cpu), explicit=True))
    return backends


def backends_in_use(llm: Any) -> set[str]:
    """The attention backends of an in-process engine's layers, by name (the worker shares this process)."""
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context.values()
    return {layer.attn_backend.get_name() for layer in layers if hasattr(layer, "attn_backend")}


def backend_id(backend: MlaBackend) -> str:
    return f"{backend.name}{'-requested' if backend.explicit else ''}-b{backend.block_size}"


@pytest.fixture(scope="module", params=mla_backends(), ids=backend_id)
def backend(request: pytest.FixtureRequest) -> MlaBackend:
    """Each MLA backend of ``mla_backends()`` in turn (import it into a test module to run its tests on each)."""
    return request.param
