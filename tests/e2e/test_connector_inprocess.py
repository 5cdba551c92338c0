"""kvoffload inside an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): right outputs, host-tier hits.

The tests share one engine and run in file order; each leaves the engine idle.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
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
    prompts,
)

pytestmark = pytest.mark.e2e

FULL_PREFIX_BLOCKS_TOKENS = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def llm(model_dir: Path, baseline: Baseline) -> Iterator[vllm.LLM]:
    # Asks for the baseline first: its plain engine must be closed before this one starts.
    engine = make_llm(model_dir, {"host_bytes": 64 << 20})
    yield engine
    close(engine)


def test_shared_prefixes_give_plain_vllm_outputs_and_load_from_host(llm: vllm.LLM, baseline: Baseline) -> None:
    first = generate(llm, prompts(ROUNDS["first"]))
    second = generate(llm, prompts(ROUNDS["second"]))

    assert_same_outputs(first, baseline["first"])
    assert_same_outputs(second, baseline["second"])
    assert metric(llm, "vllm:kvoffload_transfer_bytes", direction="device_to_host") > 0
    assert metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_device") > 0
    assert metric(llm, "vllm:kvoffload_hit_tokens") > 0
    # The device cache alone (plain vLLM) lost the early prefixes; kvoffload brought them back.
    assert sum(r.cached_tokens for r in second) > sum(r.cached_tokens for r in baseline["second"])


def test_after_device_prefix_cache_reset_every_prefix_comes_from_host(llm: vllm.LLM, baseline: Baseline) -> None:
    hits_before = metric(llm, "vllm:kvoffload_hit_tokens")
    assert llm.reset_prefix_cache()

    again = generate(llm, prompts(ROUNDS["second"]))

    assert_same_outputs(again, baseline["second"])
    assert [r.cached_tokens for r in again] == [FULL_PREFIX_BLOCKS_TOKENS] * len(again)
    assert metric(llm, "vllm:kvoffload_hit_tokens") - hits_before == FULL_PREFIX_BLOCKS_TOKENS * len(again)


def test_a_block_aligned_prompt_loads_all_but_its_last_token_with_the_same_outputs(llm: vllm.LLM) -> None:
    # Prompts of whole blocks, new to every tier: the first run computes them (and stores them); after the device
    # cache is emptied the second loads every block, the one holding the last token too, and computes that token.
    rng = random.Random(99)
    aligned = [[rng.randrange(10, 1000) for _ in range(6 * BLOCK_SIZE)] for _ in range(2)]
    computed = generate(llm, aligned)
    assert llm.reset_prefix_cache()

    loaded = generate(llm, aligned)

    assert [r.cached_tokens for r in computed] == [0, 0]
    assert [r.cached_tokens for r in loaded] == [6 * BLOCK_SIZE - 1] * 2
    assert_same_outputs(loaded, computed)


def test_resetting_the_connector_too_forgets_the_host_tier_and_stays_right(llm: vllm.LLM,
                                                                           baseline: Baseline) -> None:
    assert llm.reset_prefix_cache(reset_connector=True)

    again = generate(llm, prompts(ROUNDS["first"]))

    assert_same_outputs(again, baseline["first"])
    assert again[0].cached_tokens == 0


def test_host_tier_usage_is_reported(llm: vllm.LLM) -> None:
    assert metric(llm, "vllm:kvoffload_host_used_bytes") > 0
