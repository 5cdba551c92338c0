"""The e2e output comparison catches a wrong load: one loaded block zeroed (``inject_load_corruption``) makes that
request's outputs differ from plain vLLM's, while the requests whose loads were right still match.

Without this, "identical to plain vLLM" could pass whatever kvoffload loads (as it did with dummy weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm
from tests.e2e.conftest import (
    ROUNDS,
    Baseline,
    assert_kv_sensitive,
    assert_same_outputs,
    close,
    generate,
    make_llm,
    metric,
    prompts,
)

from kvoffload.testing.outputs import TOLERANCE, divergence

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(model_dir: Path, baseline: Baseline) -> Iterator[vllm.LLM]:
    # Asks for the baseline first: its plain engine must be closed before this one starts.
    engine = make_llm(model_dir, {"host_bytes": 64 << 20, "inject_load_corruption": 1})
    yield engine
    close(engine)


def test_a_corrupted_loaded_block_makes_exactly_its_request_differ_from_plain_vllm(llm: vllm.LLM,
                                                                                   baseline: Baseline) -> None:
    assert_same_outputs(generate(llm, prompts(ROUNDS["first"])), baseline["first"])  # stores, no loads yet
    assert llm.reset_prefix_cache()

    second = generate(llm, prompts(ROUNDS["second"]))  # every prefix loads; the first load is zeroed

    assert all(r.cached_tokens > 0 for r in second)
    assert metric(llm, "vllm:kvoffload_transfer_failed_jobs") == 0  # the bad load looked successful
    assert divergence(second[:1], baseline["second"][:1]) > TOLERANCE
    with pytest.raises(AssertionError, match="differ from plain vLLM"):
        assert_same_outputs(second, baseline["second"])
    assert_same_outputs(second[1:], baseline["second"][1:])


def test_the_control_fails_for_outputs_that_ignore_a_changed_token(baseline: Baseline) -> None:
    # What a KV-insensitive model (e.g. vLLM's dummy weights) gives: the same outputs whatever the prompt.
    with pytest.raises(AssertionError, match="control failed"):
        assert_kv_sensitive(baseline["second"], baseline["second"])
