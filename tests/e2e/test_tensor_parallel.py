"""kvoffload under tensor parallelism: real vLLM at ``tensor_parallel_size=2`` on the CPU backend.

Two worker processes (ranks 0 and 1, gloo between them) each hold half of the model's KV heads, so each rank's worker
half stores its own shard: the disk tier keeps one directory per rank (``tiers.disk.paths.rank_directory``), each with a
slot file of the engine's number whose table names the same blocks at the same slots (keys are the same on every rank),
with different bytes and each rank's own namespace fingerprint in the block's header. The one scheduler half counts a
job done only when both ranks reported it, and unions the ranks' failures: a block that fails to load on one rank is
recomputed on both.

Plain vLLM at TP=2 is the baseline, with its control (tests/e2e/conftest.py): one changed prompt token must move
its outputs, so the comparisons below can fail.

vLLM's automatic OpenMP binding wants one NUMA node per rank; on a one-node machine it stops start-up ("Not enough
allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so the engines here bind each rank to half of the
allowed CPUs by hand (``VLLM_CPU_OMP_THREADS_BIND``, docs/tensor-parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm
from tests.e2e.conftest import (
    BLOCK_SIZE,
    TP,
    Baseline,
    Result,
    assert_same_outputs,
    close,
    generate,
    make_tp_llm,
    metric,
    plain_baseline,
    prompts,
)

from kvoffload.testing.slot_files import StoredBlock, slot_files, stored_blocks
from kvoffload.tiers.lower.block_format import HEADER_BYTES

pytestmark = pytest.mark.e2e

SLOT_BYTES = 8192
"""One rank's bytes per block of the tiny model: 2 layers x 1 of its 2 KV heads x 32 tokens x K and V x 32 x bf16."""
FINGERPRINT = slice(16, 32)  # the namespace fingerprint in a block's header (tiers/lower/block_format.py)
ROUNDS = {"first": (7, 8), "second": (9, 10, 11), "third": (12, 13)}
"""The same four prefixes with new tails each round: one engine stores them, loads them, then fails to on rank 1."""
HOST_BLOCKS = 8
"""A host tier of 8 blocks per rank (a prefix is 6): each round's prefixes come back from the disk tier."""


@pytest.fixture(scope="module", autouse=True)
def bound_threads(tp_threads: pytest.MonkeyPatch) -> None:
    """Every engine here binds each rank to its half of the CPUs (before any of them starts)."""


@pytest.fixture(scope="module")
def tp_baseline(model_dir: Path) -> Baseline:
    llm = make_tp_llm(model_dir, None)
    try:
        return plain_baseline(llm, {name: prompts(tail) for name, tail in ROUNDS.items()})
    finally:
        close(llm)


@dataclass(frozen=True)
class Run:
    """What kvoffload at TP=2 gave and did, per round."""

    outputs: dict[str, list[Result]]
    files: dict[str, dict[str, bytes]]
    """Rank directory name -> (block -> its bytes) of the blocks the slot files' tables name, as the first two rounds
    left the disk tier (a block: its file's name, slot and name in the table)."""
    damaged: int
    counts: dict[str, dict[str, float]]
    """Round -> metric (``COUNTED``) -> what it counted in that round, summed over both ranks."""
    host_used_bytes: float
    """The gauge after the first round, which fills both ranks' host tiers."""


COUNTED = {"promotions": ("vllm:kvoffload_transfer_jobs", "disk_to_host"),
           "failed_promotions": ("vllm:kvoffload_transfer_failed_jobs", "disk_to_host"),
           "loads": ("vllm:kvoffload_transfer_jobs", "host_to_device"),
           "loaded_bytes": ("vllm:kvoffload_transfer_bytes", "host_to_device"),
           "failed_loads": ("vllm:kvoffload_transfer_failed_jobs", "host_to_device")}


def counted(llm: vllm.LLM) -> dict[str, float]:
    totals = {name: metric(llm, series, direction=d) for name, (series, d) in COUNTED.items()}
    return totals | {"hit_tokens": metric(llm, "vllm:kvoffload_hit_tokens")}


@pytest.fixture(scope="module")
def run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, tp_baseline: Baseline) -> Run:
    """Store the prefixes, load them back from disk on both ranks, damage rank 1's blocks, load them again."""
    disk = tmp_path_factory.mktemp("tp-disk")
    llm = make_tp_llm(model_dir, {"host_bytes": HOST_BLOCKS * SLOT_BYTES, "disk_path": str(disk)})
    outputs, counts, files, damaged, host_used = {}, {}, {}, 0, 0.0
    try:
        before = counted(llm)
        for name, tail in ROUNDS.items():
            if name == "third":
                files = block_files(disk)
                damaged = corrupt_payloads(disk, rank=1)
            outputs[name] = generate(llm, prompts(tail))
            after = counted(llm)
            counts[name] = {k: after[k] - before[k] for k in after}
            before = after
            if name == "first":
                host_used = metric(llm, "vllm:kvoffload_host_used_bytes")
    finally:
        close(llm)
    return Run(outputs, files, damaged, counts, host_used)


def rank_blocks(disk: Path) -> dict[str, list[StoredBlock]]:
    """Rank directory name -> the blocks its slot files' tables name."""
    ranks: dict[str, list[StoredBlock]] = {}
    for path in slot_files(disk):
        if path.parent.name.startswith("rank"):
            ranks.setdefault(path.parent.name, []).extend(stored_blocks(path))
    return ranks


def block_files(disk: Path) -> dict[str, dict[str, bytes]]:
    """Rank directory name -> (``<file>:<slot>:<name>`` -> the block's bytes) of every block the slot files'
    tables name under ``disk``."""
    ranks: dict[str, dict[str, bytes]] = {}
    for rank, blocks in rank_blocks(disk).items():
        contents = ranks.setdefault(rank, {})
        for block in blocks:
            with open(block.path, "rb") as f:
                f.seek(block.offset)
                contents[f"{block.path.name}:{block.slot}:{block.name.hex()}"] = f.read(block.nbytes)
    return ranks


def corrupt_payloads(disk: Path, rank: int) -> int:
    """Flip one payload byte of every block rank ``rank``'s tables name (its checksum then fails); how many."""
    blocks = rank_blocks(disk).get(f"rank{rank}", [])
    for block in blocks:
        with open(block.path, "r+b") as f:
            f.seek(block.offset + HEADER_BYTES + 100)
            byte = f.read(1)[0]
            f.seek(block.offset + HEADER_BYTES + 100)
            f.write(bytes([byte ^ 0xFF]))
    return len(blocks)


def test_outputs_equal_plain_vllm_at_tp2(run: Run, tp_baseline: Baseline) -> None:
    for name in ROUNDS:
        assert_same_outputs(run.outputs[name], tp_baseline[name])


def test_each_rank_stores_its_own_shard_under_its_own_namespace(run: Run) -> None:
    assert sorted(run.files) == ["rank0", "rank1"]
    rank0, rank1 = run.files["rank0"], run.files["rank1"]
    assert rank0 and rank0.keys() == rank1.keys(), "both ranks store the same keys"
    assert all(rank0[n][HEADER_BYTES:] != rank1[n][HEADER_BYTES:] for n in rank0), "each rank its own shard"
    fingerprints = [{data[FINGERPRINT] for data in rank.values()} for rank in (rank0, rank1)]
    assert all(len(fp) == 1 for fp in fingerprints) and fingerprints[0] != fingerprints[1], fingerprints


def test_both_ranks_load_their_shards_back_from_disk(run: Run) -> None:
    second = run.counts["second"]
    hits = [r.cached_tokens for r in run.outputs["second"]]

    assert all(h > 0 for h in hits), f"every prompt of the second round hits its stored prefix: {hits}"
    assert second["hit_tokens"] == sum(hits)
    assert second["promotions"] > 0 and second["failed_promotions"] == 0
    # The metrics sum both ranks: every loaded block moved one shard on each rank.
    assert second["loaded_bytes"] == TP * sum(hits) // BLOCK_SIZE * SLOT_BYTES
    assert second["failed_loads"] == 0


def test_load_failing_on_one_rank_is_recomputed_on_both(run: Run) -> None:
    third = run.counts["third"]
    hits = [r.cached_tokens for r in run.outputs["third"]]

    assert run.damaged > 0
    # Each promotion ran on both ranks and failed on rank 1 alone; no rank loaded those blocks into its KV.
    assert third["failed_promotions"] > 0 and third["promotions"] == TP * third["failed_promotions"], third
    assert third["loads"] == 0 and third["hit_tokens"] == 0 and hits == [0] * len(hits), (third, hits)


def test_the_host_gauge_counts_both_ranks_pools(run: Run) -> None:
    # Four 6-block prefixes fill each rank's 8-block host tier; the gauge is what the engine's host RAM holds.
    assert run.host_used_bytes == TP * HOST_BLOCKS * SLOT_BYTES
