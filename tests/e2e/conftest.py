"""Shared set-up for the end-to-end tests: a tiny random Llama, engines, a prefix-sharing workload, metrics.

vLLM must be importable here (the Makefile set-up installs it): a missing vLLM fails these tests, never skips them.
Engines are costly (seconds each on two cores), so test modules share them through module-scoped fixtures.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import vllm

from kvoffload.integrations.vllm.model import write_tiny_llama

BLOCK_SIZE = 32
DEVICE_BLOCKS = 16  # 15 usable: two 200-token prompts fit, four do not
MAX_MODEL_LEN = 448
PREFIX_TOKENS = 200
NUM_PREFIXES = 4
MAX_TOKENS = 8
CONNECTOR = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@dataclass(frozen=True)
class Result:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached_tokens: int


def prefixes() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(NUM_PREFIXES)]


def prompts(tail: Sequence[int]) -> list[list[int]]:
    """One prompt per shared prefix; every call with another tail is a new request on the same prefixes."""
    return [p + list(tail) for p in prefixes()]


def generate(llm: vllm.LLM, prompt_ids: list[list[int]]) -> list[Result]:
    """Greedy, one request at a time (so earlier prompts get evicted from the device cache by later ones)."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    results = []
    for ids in prompt_ids:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        chosen = tuple(lp[t].logprob for lp, t in zip(completion.logprobs or [], completion.token_ids, strict=False))
        results.append(Result(tuple(completion.token_ids), chosen, out.num_cached_tokens or 0))
    return results


def assert_same_outputs(got: list[Result], want: list[Result]) -> None:
    assert [r.tokens for r in got] == [r.tokens for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)


def randomize_weights(model: torch.nn.Module) -> None:
    """Replace vLLM's near-zero dummy weights by seeded N(0, 0.1): the output then depends on the KV."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def metric(llm: vllm.LLM, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples (all engines) whose labels include ``labels``."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()):
            total += float(getattr(m, "value", 0.0))
    return total


def make_llm(model_dir: Path, extra_config: dict[str, Any] | None, *, multiprocess: bool = False) -> vllm.LLM:
    """An engine on the tiny model; kvoffload on when ``extra_config`` is not None."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function to the workers
    kwargs: dict[str, Any] = {}
    if extra_config is not None:
        kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": extra_config}
    return vllm.LLM(model=str(model_dir), load_format="dummy", seed=0, block_size=BLOCK_SIZE,
                    num_gpu_blocks_override=DEVICE_BLOCKS, max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                    disable_log_stats=False, **kwargs)


def close(llm: vllm.LLM) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@dataclass(frozen=True)
class Baseline:
    """Plain vLLM's outputs for the workload rounds, with vLLM's dummy weights and with randomized weights."""

    dummy: dict[str, list[Result]]
    random: dict[str, list[Result]]


ROUNDS = {"first": (7, 8), "second": (9, 10, 11)}


@pytest.fixture(scope="session")
def baseline(model_dir: Path) -> Iterator[Baseline]:
    llm = make_llm(model_dir, None)
    dummy = {name: generate(llm, prompts(tail)) for name, tail in ROUNDS.items()}
    llm.apply_model(randomize_weights)
    llm.reset_prefix_cache()
    rand = {name: generate(llm, prompts(tail)) for name, tail in ROUNDS.items()}
    close(llm)
    yield Baseline(dummy, rand)
