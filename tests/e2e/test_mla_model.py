"""A DeepSeek-V2-style model (multi-head latent attention, MLA) on each MLA backend vLLM's CPU platform runs here.

Each test runs once per backend of ``tests.e2e.mla.mla_backends()``: the one vLLM picks on this machine (AMX_MLA
where the CPU has AMX tiles, blocks a multiple of 32; CPU_MLA elsewhere, 16-token blocks only) and, on an AMX
machine, CPU_MLA requested explicitly as well, each with the block size that backend declares. Both take a
576-wide latent (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64). The device cache holds two of the four prompts,
so every hit in the second round comes from kvoffload, whether or not vLLM's own prefix caching is on.

The baseline is plain vLLM reusing its own cached KV (``tests.e2e.mla.cached_baseline``: vLLM's
``CpuPlatform.check_and_update_config`` patched to leave prefix caching on, in this process: the engines run
in-process), with its control built the same way. Outputs with kvoffload's loads equal that baseline, every hit
block is loaded, and a load copies exactly one latent page per layer (no K/V pair).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm
from tests.e2e.conftest import ROUNDS, Baseline, assert_same_outputs, close, generate, make_llm, metric, prompts
from tests.e2e.mla import SHAPE, MlaBackend, backends_in_use, cached_baseline, hit_tokens, latent_page

from kvoffload.tools.vllm.model import ModelFamily, write_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-deepseek-v2"), ModelFamily.DEEPSEEK_V2, SHAPE)


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
