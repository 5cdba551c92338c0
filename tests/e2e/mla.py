"""The MLA attention backends vLLM's CPU platform runs on this machine, the block size each takes, and what the MLA
e2e tests share: the tiny DeepSeek-V2 shape and plain vLLM's baseline served from its own prefix cache.

vLLM picks AMX_MLA where ``torch.cpu._is_amx_tile_supported()`` (blocks a multiple of 32) and CPU_MLA elsewhere
(16-token blocks only); CPU_MLA can be requested explicitly on either. The MLA e2e tests run on the backend vLLM
picks and, where that is AMX_MLA, on CPU_MLA requested explicitly too, so both MLA paths are covered wherever AMX
exists. Nothing here hard-codes what one CPU accepts: the choice and the block sizes are vLLM's own answers. A test
that takes the ``backend`` argument runs once per backend (tests/e2e/conftest.py parametrizes it).

On CPU_MLA a prefill over cached context does not give a full prefill's outputs, whoever cached the KV: plain
vLLM with its own prefix caching forced back on differs from its own from-scratch run by 0.46 in the logprobs
(float32), exactly as much as kvoffload's loads do (vLLM turns prefix caching off on CPU MLA for this; AMX_MLA keeps
it on). So on every backend the baseline is plain vLLM reusing its own cached KV (``cached_baseline``), and its
control compares like with like: prompts with one token changed, also served from vLLM's own cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import vllm
from tests.e2e.conftest import (
    PREFIX_TOKENS,
    ROUNDS,
    Baseline,
    assert_kv_sensitive,
    close,
    generate,
    prompts,
    with_changed_tokens,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

from kvoffload.tools.vllm.model import TinyShape

DEVICE_TOKENS = 512
"""The device cache of an MLA test engine, in tokens: two 200-token prompts fit, four do not."""
SHAPE = TinyShape(num_layers=2)
LATENT = SHAPE.kv_lora_rank + SHAPE.qk_rope_head_dim


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


def hit_tokens(backend: MlaBackend) -> int:
    """The full blocks of each prompt's shared prefix: what a second-round request loads."""
    return PREFIX_TOKENS // backend.block_size * backend.block_size


def latent_page(backend: MlaBackend) -> int:
    """One layer's page of one block: a bf16 latent vector per token, nothing else."""
    return backend.block_size * LATENT * 2


def with_vllm_prefix_caching() -> pytest.MonkeyPatch:
    """vLLM's CPU platform with prefix caching left on for MLA models (it turns it off after the user's choice)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_prefix_caching(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    patch = pytest.MonkeyPatch()
    patch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_prefix_caching))
    return patch


def cached_rounds(llm: vllm.LLM, first: list[list[int]], second: list[list[int]]) -> dict[str, list[Any]]:
    return {"first": generate(llm, first), "second": generate(llm, second)}


def cached_baseline(make_engine: Callable[[], vllm.LLM], backend: MlaBackend) -> Baseline:
    """Plain vLLM (``make_engine()``, with room for every prefix) serving the second round from its own prefix
    cache, and its control built the same way: the prompts with one token changed, also served from its cache."""
    patch = with_vllm_prefix_caching()
    try:
        llm = make_engine()
        plain = cached_rounds(llm, prompts(ROUNDS["first"]), prompts(ROUNDS["second"]))
        changed = cached_rounds(llm, with_changed_tokens(prompts(ROUNDS["first"])),
                                with_changed_tokens(prompts(ROUNDS["second"])))
        close(llm)
    finally:
        patch.undo()
    assert [r.cached_tokens for r in plain["second"] + changed["second"]] == [hit_tokens(backend)] * 8
    assert_kv_sensitive(plain["second"], changed["second"])
    return Baseline(plain)
