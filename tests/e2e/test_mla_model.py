"""A DeepSeek-V2-style model (multi-head latent attention, MLA) on each MLA backend vLLM's CPU platform runs here.

Each test runs once per backend of ``tests.e2e.mla.mla_backends()``: the one vLLM picks on this machine (AMX_MLA
where the CPU has AMX tiles, blocks a multiple of 32; CPU_MLA elsewhere, 16-token blocks only) and, on an AMX
machine, CPU_MLA requested explicitly as well, each with the block size that backend declares. Both take a
576-wide latent (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64). The device cache holds two of the four prompts,
so every hit in the second round comes from kvoffload, whether or not vLLM's own prefix caching is on.

On CPU_MLA a prefill over cached context does not give a full prefill's outputs, whoever cached the KV: plain
vLLM with its own prefix caching forced back on differs from its own from-scratch run by 0.46 in the logprobs
(float32), exactly as much as kvoffload's loads do (vLLM turns prefix caching off on CPU MLA for this; AMX_MLA keeps
it on). So on every backend the baseline is plain vLLM reusing its own cached KV
(``CpuPlatform.check_and_update_config`` patched to leave prefix caching on, in this process: the engines run
in-process), and its control compares like with like: prompts with one token changed, also served from vLLM's own
cache. Outputs with kvoffload's loads equal that baseline, every hit block is loaded, and a load copies exactly one
latent page per layer (no K/V pair).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm
from tests.e2e.conftest import (
    PREFIX_TOKENS,
    ROUNDS,
    Baseline,
    assert_kv_sensitive,
    assert_same_outputs,
    close,
    generate,
    make_llm,
    metric,
    prompts,
    with_changed_tokens,
)
from tests.e2e.mla import MlaBackend, backend, backends_in_use

from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

pytestmark = pytest.mark.e2e
__all__ = ["backend"]  # the fixture: each test runs once per MLA backend

SHAPE = TinyShape(num_layers=2)
LATENT = SHAPE.kv_lora_rank + SHAPE.qk_rope_head_dim


def hit_tokens(backend: MlaBackend) -> int:
    """The full blocks of each prompt's shared prefix: what a second-round request loads."""
    return PREFIX_TOKENS // backend.block_size * backend.block_size


def latent_page(backend: MlaBackend) -> int:
    """One layer's page of one block: a bf16 latent vector per token, nothing else."""
    return backend.block_size * LATENT * 2


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-deepseek-v2"), ModelFamily.DEEPSEEK_V2, SHAPE)


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


@pytest.fixture(scope="module")
def deepseek_baseline(deepseek_dir: Path, backend: MlaBackend) -> Baseline:
    roomy = {**backend.engine_args(), "num_gpu_blocks_override": 4 * backend.device_blocks}
    return cached_baseline(lambda: make_llm(deepseek_dir, None, **roomy), backend)


@pytest.fixture(scope="module")
def llm(deepseek_dir: Path, backend: MlaBackend, deepseek_baseline: Baseline) -> Iterator[vllm.LLM]:
    engine = make_llm(deepseek_dir, {"host_bytes": 64 << 20}, **backend.engine_args())
    yield engine
    close(engine)


def latent_layout() -> tuple[bool, list[int]]:
    """Whether this process's kvoffload worker (in-process engine) sees a replicated layout, and its page sizes."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker.core
    assert worker.kv is not None
    return worker.layout.replicated, [int(view.shape[1]) for view in worker.kv.views]


def test_mla_model_loads_give_plain_vllm_outputs(llm: vllm.LLM, backend: MlaBackend,
                                                 deepseek_baseline: Baseline) -> None:
    first = generate(llm, prompts(ROUNDS["first"]))
    loaded_before = metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_device")

    second = generate(llm, prompts(ROUNDS["second"]))

    assert_same_outputs(first, deepseek_baseline["first"])
    assert_same_outputs(second, deepseek_baseline["second"])
    assert [r.cached_tokens for r in second] == [hit_tokens(backend)] * len(second)
    replicated, pages = latent_layout()
    page = latent_page(backend)
    assert replicated and pages == [page] * SHAPE.num_layers
    loaded = metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_device") - loaded_before
    assert loaded == hit_tokens(backend) // backend.block_size * len(second) * page * SHAPE.num_layers


def test_the_engine_runs_the_backend_under_test(llm: vllm.LLM, backend: MlaBackend) -> None:
    assert backends_in_use(llm) == {backend.name}
