"""kvoffload under n-gram speculative decoding: plain vLLM's outputs, and blocks filled while speculating load right.

vLLM proposes n-gram drafts by looking the context's last tokens up earlier in the same context; a tiny model with
random weights never repeats itself, so each prompt carries a plant: ``[tail[-1], c1, c2, c3]`` placed before a
short gap and the tail, where ``c1 c2 c3`` is greedy decoding's own continuation of the prompt. Once the engine has
generated ``c1``, the pair ``(tail[-1], c1)`` matches the plant and the proposer drafts ``c2 c3 gap[0]``: the
engine accepts ``c2`` (the prompt is kept only if it does) and usually rejects the rest, so both paths run. Every
round checks that speculation happened (vLLM's ``vllm:spec_decode_*`` counters) and that kvoffload's engine
speculated exactly as plain vLLM's did.

The first round's prompts end four tokens before a block boundary, so the step that verifies the first draft is
the one that fills that block, rejected draft tokens included. After ``reset_prefix_cache()`` (vLLM's device cache
holds nothing), the second round's prompts start with a first prompt and its answer up to that boundary, and all
seven of their full blocks, the one filled while speculating too, must come from kvoffload's host tier
(``num_cached_tokens``, ``vllm:kvoffload_hit_tokens``, host-to-device bytes) and give plain vLLM's outputs.

The comparison can fail. Plain vLLM's second round carries conftest's control (one changed token in block 0 moves
its outputs). Shown once: with ``"inject_load_corruption": 1`` in the engine's extra config (one loaded block
zeroed), test_second_round_loads_every_block_from_host_and_gives_plain_outputs fails with "outputs differ from
plain vLLM's by inf"; with kvoffload counting draft tokens as computed (both guards removed: the subtraction in
``adapters.step_schedule`` and ``RequestState.full_blocks``'s cap at the tokens known), the block filled while
speculating is never stored and it fails on ``num_cached_tokens`` (192, not 224).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import vllm
from tests.e2e.conftest import (
    BLOCK_SIZE,
    MAX_TOKENS,
    Result,
    assert_kv_sensitive,
    assert_same_outputs,
    close,
    generate,
    make_llm,
    metric,
    with_changed_tokens,
)
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.e2e

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
NUM_PROMPTS = 3
PLANT = 4  # tail[-1] and greedy decoding's first three tokens
GAP = 8  # random tokens between the plant and the tail: a plant right before the tail moves the output more
TAILS = {"first": (7, 8), "second": (9, 10)}
FIRST_HEAD = 206  # + plant + gap + tail = 220 prompt tokens: the first draft takes positions 221-223, the last
# of block 6, so the step that verifies it is the one that fills the block, rejected draft tokens included
LOADED_TOKENS = 7 * BLOCK_SIZE  # the second round's prompts start with the first's prompt and answer up to here
PLANT_TRIES = 64  # the plant keeps the continuation in about one try of a few; how often depends on the CPU
# kernels vLLM picks (12 tries were too few for one prompt on an AMD EPYC without AMX)


class SpecCounts(NamedTuple):
    drafts: int
    draft_tokens: int
    accepted: int


def spec_counts(llm: vllm.LLM) -> SpecCounts:
    return SpecCounts(*(int(metric(llm, f"vllm:spec_decode_num_{name}"))
                        for name in ("drafts", "draft_tokens", "accepted_tokens")))


def since(before: SpecCounts, after: SpecCounts) -> SpecCounts:
    return SpecCounts(*(a - b for a, b in zip(after, before, strict=True)))


def greedy(llm: vllm.LLM, ids: list[int]) -> list[int]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return list(llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0].token_ids)


def speculating_prompt(llm: vllm.LLM, head: list[int], tail: tuple[int, ...], seed: int) -> list[int]:
    """``head + plant + gap + tail`` whose greedy continuation starts with the plant's ``c1 c2``.

    The plant moves the continuation (every token does, in a random model), so fresh gaps are tried until the
    continuation keeps its first two tokens (``PLANT_TRIES`` at most).
    """
    rng = random.Random(seed)
    for _ in range(PLANT_TRIES):
        filler, gap = ([rng.randrange(10, 1000) for _ in range(n)] for n in (PLANT, GAP))
        want = greedy(llm, [*head, *filler, *gap, *tail])
        planted = [*head, tail[-1], *want[:PLANT - 1], *gap, *tail]
        if greedy(llm, planted)[:2] == want[:2]:
            return planted
    raise AssertionError(f"no plant in {PLANT_TRIES} tries keeps the continuation: n-gram drafts would be rejected")


@dataclass(frozen=True)
class Round:
    prompts: list[list[int]]
    outputs: list[Result]
    spec: SpecCounts


def run_round(llm: vllm.LLM, prompts: list[list[int]]) -> Round:
    before = spec_counts(llm)
    outputs = generate(llm, prompts)
    return Round(prompts, outputs, since(before, spec_counts(llm)))


@dataclass(frozen=True)
class PlainRun:
    """Plain vLLM's rounds, with the same speculative settings; the control held on the second."""

    first: Round
    second: Round


def plain_rounds(llm: vllm.LLM) -> PlainRun:
    rng = random.Random(4321)
    heads = [[rng.randrange(10, 1000) for _ in range(FIRST_HEAD)] for _ in range(NUM_PROMPTS)]
    first_prompts = [speculating_prompt(llm, h, TAILS["first"], seed=i) for i, h in enumerate(heads)]
    assert llm.reset_prefix_cache()
    first = run_round(llm, first_prompts)
    kept = [p + list(r.tokens) for p, r in zip(first_prompts, first.outputs, strict=True)]
    assert all(len(k) >= LOADED_TOKENS for k in kept)
    second_prompts = [speculating_prompt(llm, k[:LOADED_TOKENS], TAILS["second"], seed=100 + i)
                      for i, k in enumerate(kept)]
    assert llm.reset_prefix_cache()
    second = run_round(llm, second_prompts)
    assert_kv_sensitive(second.outputs, generate(llm, with_changed_tokens(second_prompts)))
    return PlainRun(first, second)


def let_vllm_build_engines_after_numba() -> None:
    """Works around a vLLM bug (0.31 and 0.32, CPU backend) that breaks every engine built in a process where
    numba is imported, as vLLM's n-gram proposer does when the first speculating engine starts.

    At engine start vLLM scans every module's globals for kernels to replace
    (``vllm/triton_utils/dispatcher.py``: ``vars(value).get("kernel")``); llvmlite's ``ffi.lib`` answers any
    attribute, ``__dict__`` too, with a function wrapper, and the scan fails with ``AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'``. Giving ``lib`` a ``__dict__`` to answer with lets the scan
    pass. It stays for the rest of the process: later test modules build engines too.
    """
    from llvmlite.binding import ffi

    ffi.lib._fntab["__dict__"] = {}


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> Iterator[PlainRun]:
    let_vllm_build_engines_after_numba()
    llm = make_llm(model_dir, None, speculative_config=SPECULATIVE)
    run = plain_rounds(llm)
    close(llm)  # before kvoffload's engine starts in this process
    yield run


@pytest.fixture(scope="module")
def llm(model_dir: Path, plain: PlainRun) -> Iterator[vllm.LLM]:
    engine = make_llm(model_dir, {"host_bytes": 64 << 20}, speculative_config=SPECULATIVE)
    yield engine
    close(engine)


def assert_speculated(spec: SpecCounts) -> None:
    assert spec.accepted > 0, f"no draft token accepted: {spec}"
    assert spec.draft_tokens > spec.accepted, f"no draft token rejected: {spec}"


def test_plain_vllm_accepts_and_rejects_drafts_in_both_rounds(plain: PlainRun) -> None:
    assert_speculated(plain.first.spec)
    assert_speculated(plain.second.spec)


def test_first_round_speculates_like_plain_vllm_and_stores_to_host(llm: vllm.LLM, plain: PlainRun) -> None:
    first = run_round(llm, plain.first.prompts)

    assert_same_outputs(first.outputs, plain.first.outputs)
    assert_speculated(first.spec)
    assert first.spec == plain.first.spec
    assert metric(llm, "vllm:kvoffload_transfer_bytes", direction="device_to_host") > 0


def test_second_round_loads_every_block_from_host_and_gives_plain_outputs(llm: vllm.LLM, plain: PlainRun) -> None:
    assert llm.reset_prefix_cache()  # vLLM's device cache cannot serve the second round
    hits_before = metric(llm, "vllm:kvoffload_hit_tokens")
    loaded_before = metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_device")

    second = run_round(llm, plain.second.prompts)

    assert_same_outputs(second.outputs, plain.second.outputs)
    assert_speculated(second.spec)
    assert second.spec == plain.second.spec
    # Block 6 of each prompt was filled while the first round decoded with drafts; it is loaded too.
    assert [r.cached_tokens for r in second.outputs] == [LOADED_TOKENS] * NUM_PROMPTS
    assert [r.cached_tokens for r in plain.second.outputs] == [0] * NUM_PROMPTS
    assert metric(llm, "vllm:kvoffload_hit_tokens") - hits_before == LOADED_TOKENS * NUM_PROMPTS
    assert metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_device") > loaded_before
