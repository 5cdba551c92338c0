"""Shared set-up for the end-to-end tests: tiny real-weight models, engines, a prefix-sharing workload, metrics.

Every comparison here can fail. The models are real checkpoints (seeded random weights in safetensors, loaded by
vLLM's normal loader), and every plain-vLLM baseline carries its control (kvoffload.testing.outputs): the same
prompts with one token changed inside the first block (a block kvoffload loads) must move plain vLLM's outputs by
at least ``CONTROL_FACTOR`` times the tolerance of ``assert_same_outputs``; a baseline whose control fails makes
every test using it fail. test_wrong_load_is_caught.py shows the comparison failing on a corrupted load.

vLLM must be importable here (the Makefile set-up installs it): a missing vLLM fails these tests, never skips them.
Engines are costly (seconds each on two cores), so test modules share them through module-scoped fixtures. An
in-process engine's kvoffload worker is a process-wide singleton (``get_kv_transfer_group()``), so two in-process
engines never live at once: each module closes its engines before the next module starts its own.

Here too: the MLA ``backend`` parametrization (a test that takes ``backend`` runs once per MLA backend of
``tests.e2e.mla.mla_backends()``) and the tensor-parallel helpers (``TP``, ``thread_binding``, ``make_tp_llm`` and
the ``tp_threads`` fixture that binds each rank to its half of the CPUs).
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import vllm

from kvoffload.testing.outputs import TOLERANCE, TOP_LOGPROBS, control, divergence, with_changed_token
from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

BLOCK_SIZE = 32
DEVICE_BLOCKS = 16  # 15 usable: two 200-token prompts fit, four do not
MAX_MODEL_LEN = 448
PREFIX_TOKENS = 200
NUM_PREFIXES = 4
MAX_TOKENS = 8
CHANGED_POSITION = 5  # inside the first block, which every hit loads
CONNECTOR = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@dataclass(frozen=True)
class Result:
    tokens: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]
    """Per generated position, the top ``TOP_LOGPROBS`` token ids and their logprobs."""
    cached_tokens: int


def prefixes() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(NUM_PREFIXES)]


def prompts(tail: Sequence[int]) -> list[list[int]]:
    """One prompt per shared prefix; every call with another tail is a new request on the same prefixes."""
    return [p + list(tail) for p in prefixes()]


def resume(engine: subprocess.Popen[str], line: str, first: Callable[[], None] = lambda: None) -> None:
    """Wait for a tier engine (tests/e2e/tier_engine.py) to print ``line``, run ``first``, then let it go on."""
    assert engine.stdin is not None and engine.stdout is not None
    assert engine.stdout.readline() == line, f"the engine exited before {line.strip()!r} (see its log)"
    first()
    engine.stdin.write("go\n")
    engine.stdin.flush()


def generate(llm: vllm.LLM, prompt_ids: list[list[int]]) -> list[Result]:
    """Greedy, one request at a time (so earlier prompts get evicted from the device cache by later ones)."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)
    results = []
    for ids in prompt_ids:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        top = tuple({t: lp.logprob for t, lp in position.items()} for position in completion.logprobs or [])
        results.append(Result(tuple(completion.token_ids), top, out.num_cached_tokens or 0))
    return results


def assert_same_outputs(got: Sequence[Result], want: Sequence[Result]) -> None:
    apart = divergence(got, want)
    assert apart <= TOLERANCE, f"outputs differ from plain vLLM's by {apart} (tolerance {TOLERANCE})"


def with_changed_tokens(prompt_ids: list[list[int]]) -> list[list[int]]:
    """The same prompts with the token at ``CHANGED_POSITION`` replaced."""
    return [with_changed_token(p, CHANGED_POSITION, vocab_size=1000, low=10) for p in prompt_ids]


def assert_kv_sensitive(plain: Sequence[Result], changed: Sequence[Result]) -> None:
    """The control: for every prompt, one changed token inside a loaded block moves plain vLLM's outputs by at
    least ``CONTROL_FACTOR`` x the tolerance, so ``assert_same_outputs`` would catch a wrong loaded block."""
    outcome = control(plain, changed)
    assert outcome.holds, (
        f"control failed: a changed token moved plain vLLM's outputs by only {outcome.shift}; the model's outputs "
        "do not depend on the KV, so no comparison with it can catch a wrong load")


def metric(llm: vllm.LLM, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples (all engines) whose labels include ``labels``."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()):
            total += float(getattr(m, "value", 0.0))
    return total


def make_llm(model_dir: Path, extra_config: dict[str, Any] | None, *, multiprocess: bool = False,
             **engine: Any) -> vllm.LLM:
    """An engine on a tiny model; kvoffload on when ``extra_config`` is not None. ``engine`` overrides LLM args."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    kwargs: dict[str, Any] = {"seed": 0, "block_size": BLOCK_SIZE, "num_gpu_blocks_override": DEVICE_BLOCKS,
                              "max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "disable_log_stats": False,
                              **engine}
    if extra_config is not None:
        kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": extra_config}
    return vllm.LLM(model=str(model_dir), **kwargs)


def close(llm: vllm.LLM) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


TP = 2
"""The tensor-parallel size of the TP tests: one rank per half of the CPUs."""


def thread_binding() -> str:
    """Half of the allowed CPUs for each rank, as ``VLLM_CPU_OMP_THREADS_BIND`` wants it (``"0|1"`` on two)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < TP:
        raise RuntimeError(f"tensor_parallel_size={TP} on the CPU backend needs {TP} CPUs; {len(cpus)} allowed")
    half = len(cpus) // TP
    return "|".join(",".join(map(str, cpus[r * half:(r + 1) * half])) for r in range(TP))


def make_tp_llm(model_dir: Path, extra_config: dict[str, Any] | None, **engine: Any) -> vllm.LLM:
    """A multiprocess engine at ``TP`` ranks (take ``tp_threads`` first, so each rank computes on its own CPUs)."""
    return make_llm(model_dir, extra_config, multiprocess=True, tensor_parallel_size=TP,
                    distributed_executor_backend="mp", **engine)


@pytest.fixture(scope="module")
def tp_threads() -> Iterator[pytest.MonkeyPatch]:
    """``VLLM_CPU_OMP_THREADS_BIND`` set to ``thread_binding()`` for the module; more variables may be set on it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", thread_binding())
        yield mp


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``backend`` runs once per MLA backend, one engine per module and backend. Imported here, at
    collection, because tests.e2e.mla builds on this module."""
    if "backend" in metafunc.fixturenames:
        from tests.e2e.mla import backend_id, mla_backends

        metafunc.parametrize("backend", mla_backends(), ids=backend_id, scope="module")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), ModelFamily.LLAMA, TinyShape())


ROUNDS = {"first": (7, 8), "second": (9, 10, 11)}


@dataclass(frozen=True)
class Baseline:
    """Plain vLLM's outputs for each round of the workload; its control held when it was built."""

    rounds: dict[str, list[Result]]

    def __getitem__(self, name: str) -> list[Result]:
        return self.rounds[name]


def plain_baseline(llm: vllm.LLM, rounds: dict[str, list[list[int]]]) -> Baseline:
    """Plain vLLM's outputs for ``rounds`` (name -> prompts), after checking the control on the last round."""
    outputs = {name: generate(llm, ids) for name, ids in rounds.items()}
    last = list(rounds)[-1]
    assert_kv_sensitive(outputs[last], generate(llm, with_changed_tokens(rounds[last])))
    return Baseline(outputs)


@pytest.fixture(scope="session")
def baseline(model_dir: Path) -> Iterator[Baseline]:
    llm = make_llm(model_dir, None)
    result = plain_baseline(llm, {name: prompts(tail) for name, tail in ROUNDS.items()})
    close(llm)  # before any other engine starts in this process
    yield result
