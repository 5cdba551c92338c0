"""MLA at tensor_parallel_size=2 on vLLM's CPU backend: one copy in the shared tier, written once, loaded by both.

Every rank of a latent-attention model holds the same bytes, so the disk tier keeps one copy of each block
(``<world>/replicated/engine-<n>.kvs``) that only rank 0 writes and both ranks load (docs/mla.md). A host tier of 512
tokens per rank holds at most two of the four 200-token prefixes (the device cache computes two prompts at a time, both
filling at once): the second round's hits come back from disk. The baseline is plain vLLM at TP=2 reusing its own cached
KV (``tests.e2e.mla.cached_baseline``: CPU MLA turns vLLM's prefix caching off; the patch that leaves it on reaches the
engine processes because they are forked here), with its control built the same way. Like test_mla_model.py, it runs on
every MLA backend of ``tests.e2e.mla.mla_backends()``, each with its own block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm
from tests.e2e.conftest import (
    ROUNDS,
    TP,
    Baseline,
    Result,
    assert_same_outputs,
    close,
    generate,
    make_tp_llm,
    metric,
    prompts,
)
from tests.e2e.mla import SHAPE, MlaBackend, cached_baseline, hit_tokens, latent_page

from kvoffload.testing.slot_files import slot_files, stored_blocks
from kvoffload.tools.vllm.model import ModelFamily, write_tiny_model

pytestmark = pytest.mark.e2e

HOST_TOKENS = 512
"""The host tier of each rank, in tokens: two of the four prefixes at most."""


def block_bytes(backend: MlaBackend) -> int:
    """One offload block: a bf16 latent page per layer, the same bytes on every rank."""
    return latent_page(backend) * SHAPE.num_layers


def host_blocks(backend: MlaBackend) -> int:
    return HOST_TOKENS // backend.block_size


@pytest.fixture(scope="module", autouse=True)
def forked_bound_engines(tp_threads: pytest.MonkeyPatch) -> None:
    tp_threads.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # the baseline's patch must reach the engine core


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-deepseek-v2-tp"), ModelFamily.DEEPSEEK_V2, SHAPE)


def make_mla_tp_llm(model_dir: Path, extra_config: dict[str, object] | None, backend: MlaBackend,
                    device_blocks: int) -> vllm.LLM:
    return make_tp_llm(model_dir, extra_config, **{**backend.engine_args(), "num_gpu_blocks_override": device_blocks})


@pytest.fixture(scope="module")
def tp_baseline(model_dir: Path, backend: MlaBackend) -> Baseline:
    return cached_baseline(lambda: make_mla_tp_llm(model_dir, None, backend, 4 * backend.device_blocks), backend)


@dataclass(frozen=True)
class Run:
    outputs: dict[str, list[Result]]
    rank_dirs: list[str]
    files: int
    """Blocks the slot files' tables name (each written once, by one rank)."""
    counted: dict[str, float]
    """Bytes summed over both ranks, per direction, over both rounds."""


@pytest.fixture(scope="module")
def run(model_dir: Path, backend: MlaBackend, tmp_path_factory: pytest.TempPathFactory, tp_baseline: Baseline) -> Run:
    disk = tmp_path_factory.mktemp("mla-tp-disk")
    tiers = {"host_bytes": host_blocks(backend) * block_bytes(backend), "disk_path": str(disk)}
    llm = make_mla_tp_llm(model_dir, tiers, backend, backend.device_blocks)
    try:
        outputs = {name: generate(llm, prompts(tail)) for name, tail in ROUNDS.items()}
        counted = {d: metric(llm, "vllm:kvoffload_transfer_bytes", direction=d)
                   for d in ("host_to_disk", "disk_to_host", "host_to_device")}
    finally:
        close(llm)
    blocks = [block for path in slot_files(disk) for block in stored_blocks(path)]
    return Run(outputs, sorted({b.path.parent.name for b in blocks}), len(blocks), counted)


def test_outputs_equal_plain_vllm_at_tp2(run: Run, backend: MlaBackend, tp_baseline: Baseline) -> None:
    for name in ROUNDS:
        assert_same_outputs(run.outputs[name], tp_baseline[name])
    assert [r.cached_tokens for r in run.outputs["second"]] == [hit_tokens(backend)] * len(run.outputs["second"])


def test_the_disk_tier_holds_one_copy_written_once(run: Run, backend: MlaBackend) -> None:
    block = block_bytes(backend)
    assert run.rank_dirs == ["replicated"] and run.files > host_blocks(backend)
    # Rank 1's writes are skipped: the bytes written, summed over both ranks, are at most one copy of each block
    # (two writers would have written twice that; the last writes may end after the metrics were read).
    assert run.files * block / 2 < run.counted["host_to_disk"] <= run.files * block


def test_both_ranks_load_from_that_copy(run: Run, backend: MlaBackend) -> None:
    block = block_bytes(backend)
    hit_blocks = sum(r.cached_tokens for r in run.outputs["second"]) // backend.block_size
    # Each rank copies every hit block into its own device cache, from its own host tier, which holds only
    # host_blocks(): the others come back from the one copy on disk, on both ranks alike.
    assert run.counted["host_to_device"] == TP * hit_blocks * block
    promoted = run.counted["disk_to_host"]
    assert promoted >= TP * (hit_blocks - host_blocks(backend)) * block and promoted % (TP * block) == 0
