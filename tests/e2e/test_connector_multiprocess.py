"""kvoffload in vLLM's default multi-process mode, with the first load of the worker made to fail.

The scheduler half runs in the engine-core process, the worker half in a worker process; a failed load
(``inject_load_failures``) must be recomputed by vLLM, giving the same tokens as plain vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm
from tests.e2e.conftest import (
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


@pytest.fixture(scope="module")
def llm(model_dir: Path, baseline: Baseline) -> Iterator[vllm.LLM]:
    # Asks for the baseline first: its plain engine must be closed before this one starts.
    engine = make_llm(model_dir, {"host_bytes": 64 << 20, "inject_load_failures": 1}, multiprocess=True)
    yield engine
    close(engine)


def test_failed_load_is_recomputed_and_later_loads_hit_in_multiprocess_mode(llm: vllm.LLM,
                                                                            baseline: Baseline) -> None:
    first = generate(llm, prompts(ROUNDS["first"]))
    second = generate(llm, prompts(ROUNDS["second"]))

    assert_same_outputs(first, baseline["first"])
    assert_same_outputs(second, baseline["second"])
    assert metric(llm, "vllm:kvoffload_transfer_failed_jobs", direction="host_to_device") == 1
    assert metric(llm, "vllm:kvoffload_failed_load_tokens") > 0
    assert metric(llm, "vllm:kvoffload_transfer_jobs", direction="host_to_device") > 1
