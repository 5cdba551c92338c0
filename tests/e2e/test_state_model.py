"""LFM2 (ShortConv state layers beside full attention) in an in-process vLLM with kvoffload: state blocks that
kvoffload loads give plain vLLM's outputs.

One workload runs on plain vLLM, then on vLLM with kvoffload (one engine at a time, same settings): a first round
of prompts on two shared prefixes; a long continuation of one of them, so that a state block fills during decode;
the device prefix cache reset; a second round on the same prefixes, which kvoffload serves from its host tier,
state blocks included; the device cache reset again; a follow-up on the continuation. Its decode-filled state
block differs from the one prefill computes for the same tokens on this backend (vLLM's own prefix cache, when
told to keep it, gives other outputs than recomputing), so kvoffload must serve only the follow-up's prompt blocks
(adapters.stores_prompt_blocks_only).

The settings are those kvoffload needs for state layers (adapters.check_state_layers): prefix caching on, so
vLLM keeps one state per block (``mamba_cache_mode`` "align"), no speculative decoding. vLLM picks the block
size (128 tokens for this model). vLLM keeps a state only where a chunk of prefill ends, so a prefix is served
when kvoffload holds every attention block of it and the state block where it ends: chunks of two blocks here
(``max_num_batched_tokens``), so each 302-token prompt leaves a state after block 1 only, and the 256 tokens of
blocks 0-1 are what kvoffload serves (with state block 0 never stored).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import vllm
from tests.e2e.conftest import (
    Result,
    assert_kv_sensitive,
    assert_same_outputs,
    close,
    generate,
    make_llm,
    metric,
    with_changed_tokens,
)

from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 128  # what vLLM picks for this model on CPU: its default, large enough for the state page
PREFIX_TOKENS = 300  # two full blocks, then a partial one
NUM_PREFIXES = 2
LOADED_TOKENS = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE
CONTINUATION_TOKENS = 100  # from 302 prompt tokens past 384: block 2 fills during decode
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "block_size": None,  # vLLM's choice
    "max_model_len": 1024,
    "max_num_batched_tokens": 2 * BLOCK_SIZE,
    "max_num_seqs": 4,
    "num_gpu_blocks_override": 64,
    "enable_prefix_caching": True,
}


def prefixes() -> list[list[int]]:
    rng = random.Random(99)
    return [[rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(NUM_PREFIXES)]


def prompts(tail: Sequence[int]) -> list[list[int]]:
    return [p + list(tail) for p in prefixes()]


@dataclass(frozen=True)
class Run:
    block_size: int
    mamba_cache_mode: str
    first: list[Result]
    continuation: tuple[int, ...]
    second: list[Result]
    follow_up: list[Result]
    changed: list[Result] | None
    hit_tokens: float


def run_workload(llm: vllm.LLM, control: bool) -> Run:
    cache = llm.llm_engine.vllm_config.cache_config
    first = generate(llm, prompts((7, 8)))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=CONTINUATION_TOKENS)
    long_prompt = prompts((7, 8))[0]
    continuation = tuple(llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)[0]
                         .outputs[0].token_ids)
    assert llm.reset_prefix_cache()  # the device cache forgets every prefix; kvoffload's host tier does not
    second = generate(llm, prompts((9, 10, 11)))
    assert llm.reset_prefix_cache()
    follow_up = generate(llm, [long_prompt + list(continuation) + [12]])
    changed = generate(llm, with_changed_tokens(prompts((9, 10, 11)))) if control else None
    return Run(cache.block_size, str(cache.mamba_cache_mode), first, continuation, second, follow_up, changed,
               metric(llm, "vllm:kvoffload_hit_tokens"))


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-lfm2"), ModelFamily.LFM2,
                            TinyShape(num_layers=4, max_position=1024))


@pytest.fixture(scope="module")
def plain(lfm2_dir: Path) -> Run:
    llm = make_llm(lfm2_dir, None, **ENGINE)
    try:
        return run_workload(llm, control=True)
    finally:
        close(llm)


@pytest.fixture(scope="module")
def offloaded(lfm2_dir: Path, plain: Run) -> Run:
    # Asks for the plain run first: its engine must be closed before this one starts.
    llm = make_llm(lfm2_dir, {"host_bytes": 64 << 20}, **ENGINE)
    try:
        return run_workload(llm, control=False)
    finally:
        close(llm)


def test_vllm_runs_the_state_layers_in_align_mode_with_the_block_size_assumed(plain: Run, offloaded: Run) -> None:
    assert (plain.block_size, plain.mamba_cache_mode) == (BLOCK_SIZE, "align")
    assert (offloaded.block_size, offloaded.mamba_cache_mode) == (BLOCK_SIZE, "align")


def test_control_one_changed_token_in_a_loaded_block_moves_plain_outputs(plain: Run) -> None:
    assert plain.changed is not None
    assert_kv_sensitive(plain.second, plain.changed)


def test_before_any_load_outputs_are_plain_vllms(plain: Run, offloaded: Run) -> None:
    assert_same_outputs(offloaded.first, plain.first)
    assert offloaded.continuation == plain.continuation


def test_prefixes_loaded_from_kvoffload_give_plain_vllm_outputs(plain: Run, offloaded: Run) -> None:
    assert [r.cached_tokens for r in plain.second] == [0] * NUM_PREFIXES  # plain vLLM recomputed them
    assert [r.cached_tokens for r in offloaded.second] == [LOADED_TOKENS] * NUM_PREFIXES
    assert_same_outputs(offloaded.second, plain.second)


def test_a_block_filled_during_decode_is_not_served_and_outputs_stay_plain(plain: Run, offloaded: Run) -> None:
    # The continuation's prompt blocks come back from kvoffload; the block its decode filled (tokens 256-383)
    # was never stored, so vLLM recomputes it by prefill, as plain vLLM does.
    assert PREFIX_TOKENS + 2 + CONTINUATION_TOKENS > 3 * BLOCK_SIZE
    assert [r.cached_tokens for r in plain.follow_up] == [0]
    assert [r.cached_tokens for r in offloaded.follow_up] == [LOADED_TOKENS]
    assert_same_outputs(offloaded.follow_up, plain.follow_up)


def test_hit_tokens_metric_counts_every_loaded_token(plain: Run, offloaded: Run) -> None:
    loaded = sum(r.cached_tokens for r in offloaded.second + offloaded.follow_up)
    assert offloaded.hit_tokens == loaded > 0
    assert plain.hit_tokens == 0
