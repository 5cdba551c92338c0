"""A hybrid model: Gemma3 with three sliding-window layers and one full-attention layer (four KV-cache groups).

At two offload block sizes, with every prefix loaded after ``reset_prefix_cache``: outputs equal plain vLLM's (whose
baseline carries the sensitivity control), and loads never write vLLM's null block (block 0, which stands in the
window groups' block tables for blocks outside the window) and copy fewer bytes than a copy into every table
position would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vllm
from tests.e2e.conftest import (
    BLOCK_SIZE,
    PREFIX_TOKENS,
    ROUNDS,
    Baseline,
    assert_same_outputs,
    close,
    generate,
    make_llm,
    metric,
    plain_baseline,
    prompts,
)

from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

pytestmark = pytest.mark.e2e

SHAPE = TinyShape(num_layers=4, sliding_window=64)  # layers 0-2 slide over 64 tokens, layer 3 sees everything
DEVICE_BLOCKS = 64
HIT_TOKENS = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE  # the full blocks before each prompt's last token
GROUP_BLOCK_BYTES = 2 * BLOCK_SIZE * SHAPE.num_kv_heads * SHAPE.head_dim * 4  # K and V, float32, one layer
NUM_GROUPS = 4


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), ModelFamily.GEMMA3, SHAPE)


@pytest.fixture(scope="module")
def gemma_baseline(gemma_dir: Path) -> Baseline:
    llm = make_llm(gemma_dir, None, num_gpu_blocks_override=DEVICE_BLOCKS)
    result = plain_baseline(llm, {name: prompts(tail) for name, tail in ROUNDS.items()})
    close(llm)
    return result


@pytest.fixture(scope="module", params=[BLOCK_SIZE, 2 * BLOCK_SIZE], ids=lambda n: f"offload{n}")
def llm(request: pytest.FixtureRequest, gemma_dir: Path, gemma_baseline: Baseline) -> Iterator[vllm.LLM]:
    engine = make_llm(gemma_dir, {"host_bytes": 64 << 20, "offload_block_tokens": request.param},
                      num_gpu_blocks_override=DEVICE_BLOCKS)
    yield engine
    close(engine)


def null_block_bytes() -> list[torch.Tensor]:
    """Block 0 of every canonical KV view of this process's kvoffload worker (in-process engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    kv = get_kv_transfer_group().worker.core.kv
    return [view[0].clone() for view in kv.views]


def test_sliding_window_model_loads_give_plain_vllm_outputs_and_leave_the_null_block_alone(
        llm: vllm.LLM, gemma_baseline: Baseline) -> None:
    null_before = null_block_bytes()
    first = generate(llm, prompts(ROUNDS["first"]))
    assert llm.reset_prefix_cache()
    loaded_before = metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_device")

    second = generate(llm, prompts(ROUNDS["second"]))

    assert_same_outputs(first, gemma_baseline["first"])
    assert_same_outputs(second, gemma_baseline["second"])
    assert [r.cached_tokens for r in second] == [HIT_TOKENS] * len(second)
    assert all(torch.equal(a, b) for a, b in zip(null_before, null_block_bytes(), strict=True))
    loaded = metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_device") - loaded_before
    hit_blocks = HIT_TOKENS // BLOCK_SIZE * len(second)
    # Every hit block of the full-attention group, and only the window groups' blocks still in their window.
    assert hit_blocks * GROUP_BLOCK_BYTES <= loaded < hit_blocks * GROUP_BLOCK_BYTES * NUM_GROUPS
