"""Tensor parallelism in the simulated engine: one scheduler half, two worker halves (ranks 0 and 1).

Under tensor parallelism each rank holds a different shard of every KV page (its own KV heads), and so does the
simulated engine: a page's bytes are a function of its tokens and of the rank that computed it
(``sim_values.page_bytes``, ``SimEngine.page_ranks``). A rank that stored, or loaded, another rank's shard is then
visible. The properties, each shown once to catch a deliberately wrong result (a ``mutant`` case or a test
named ``..._is_caught``):

- each rank stores its own shard under its own namespace: a slot file of the same engine number under ``rank0/``
  and under ``rank1/``, whose tables name the same blocks at the same slots, each block holding its rank's device
  bytes and its rank's namespace fingerprint;
- a job counts as finished only when both ranks reported it (one rank's report leaves it pending);
- a load that fails on one rank only is recomputed on both, and every rank's device bytes are right afterwards.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tests.testing.engines import MADE

from kvoffload.blocks import Medium
from kvoffload.connector.metadata import WorkerReport
from kvoffload.connector.worker import WorkerFinished
from kvoffload.keys import Namespace
from kvoffload.testing import sim_values, sim_workload, slot_files
from kvoffload.testing.sim import SimEngine, SimRequest, Status
from kvoffload.testing.sim_workload import tokens
from kvoffload.tiers.disk.paths import rank_directory, slot_file_path
from kvoffload.tiers.disk.slot_file import ENTRY_BYTES
from kvoffload.tiers.lower.block_format import HEADER_BYTES
from kvoffload.transfer.faults import FailFirstLoads
from kvoffload.transfer.router import JobRouter

BLOCK = 4
PROMPT_TOKENS = 16  # 4 blocks
RANKS = 2
FINGERPRINT = slice(16, 32)  # the namespace fingerprint in a block's header (tiers/lower/block_format.py)


def make_engine(host_blocks: int = 16, disk: Path | None = None) -> SimEngine:
    tier = {} if disk is None else {"disk_path": str(disk), "disk_bytes": 1 << 20}
    MADE.append(sim_workload.make_engine(block_size=BLOCK, host_blocks=host_blocks, workers=RANKS, **tier))
    return MADE[-1]


def run_checked(engine: SimEngine) -> None:
    sim_workload.run_checked(engine, ship_write_through=True)


def expected_pages(engine: SimEngine, req: SimRequest, rank: int) -> set[bytes]:
    """The bytes rank ``rank`` computed for each full block of ``req``."""
    return {sim_values.page_bytes(engine.kvs[rank], 0, h, rank).numpy().tobytes() for h in req.hashes}


def slot_file(disk: Path, ns: Namespace) -> Path:
    """Engine 0's slot file in ``ns``'s rank directory (the only engine here)."""
    return Path(slot_file_path(rank_directory(disk, ns), 0))


def block_bytes(block: slot_files.StoredBlock) -> bytes:
    with open(block.path, "rb") as f:
        f.seek(block.offset)
        return f.read(block.nbytes)


def shard_problems(engine: SimEngine, disk: Path, req: SimRequest) -> list[str]:
    """What is wrong with the blocks the ranks' slot files name for ``req``; empty when each rank holds its own
    shard."""
    problems = []
    named: list[set[tuple[int, bytes]]] = []
    for rank, worker in enumerate(engine.workers):
        ns = worker.namespace
        blocks = slot_files.stored_blocks(slot_file(disk, ns))
        named.append({(b.slot, b.name) for b in blocks})
        if ns.rank != rank:
            problems.append(f"worker {rank} has the namespace of rank {ns.rank}")
        contents = [block_bytes(b) for b in blocks]
        if {c[FINGERPRINT] for c in contents} != {ns.fingerprint()}:
            problems.append(f"rank {rank}'s blocks do not all carry its namespace fingerprint")
        if {c[HEADER_BYTES:] for c in contents} != expected_pages(engine, req, rank):
            problems.append(f"rank {rank}'s blocks do not hold its own device bytes")
    if named[0] != named[1] or not named[0]:
        problems.append(f"the ranks' tables name different blocks: {len(named[0])} and {len(named[1])} entries")
    return problems


def store_prompt(engine: SimEngine) -> SimRequest:
    req = engine.add_request("a", tokens(PROMPT_TOKENS, seed=1))
    run_checked(engine)
    assert len(req.hashes) == PROMPT_TOKENS // BLOCK
    return req


def test_each_rank_stores_its_own_shard_under_its_own_namespace(tmp_path: Path) -> None:
    engine = make_engine(disk=tmp_path)
    req = store_prompt(engine)

    assert shard_problems(engine, tmp_path, req) == []
    assert expected_pages(engine, req, 0).isdisjoint(expected_pages(engine, req, 1))  # shards, not copies
    rank0, rank1 = (rank_directory(tmp_path, w.namespace) for w in engine.workers)
    assert (rank0.name, rank1.name) == ("rank0", "rank1") and rank0.parent == rank1.parent
    assert len(slot_files.stored_blocks(slot_file(tmp_path, engine.workers[0].namespace))) == PROMPT_TOKENS // BLOCK


def test_a_rank_holding_another_ranks_shard_is_caught(tmp_path: Path) -> None:
    engine = make_engine(disk=tmp_path)
    req = store_prompt(engine)
    rank1 = slot_file(tmp_path, engine.workers[1].namespace)
    with open(rank1, "r+b") as f:  # rank 1's blocks replaced by rank 0's, as a mixed-up writer would leave them
        for block in slot_files.stored_blocks(slot_file(tmp_path, engine.workers[0].namespace)):
            f.seek(block.offset)
            f.write(block_bytes(block))

    assert shard_problems(engine, tmp_path, req) == [
        "rank 1's blocks do not all carry its namespace fingerprint",
        "rank 1's blocks do not hold its own device bytes",
    ]


def test_ranks_naming_different_blocks_are_caught(tmp_path: Path) -> None:
    engine = make_engine(disk=tmp_path)
    req = store_prompt(engine)
    rank1 = slot_file(tmp_path, engine.workers[1].namespace)
    first = slot_files.stored_blocks(rank1)[0]
    with open(rank1, "r+b") as f:  # rank 1's table loses an entry, as a store failed on rank 1 only leaves it
        f.seek(slot_files.layout_of(rank1).entry_offset(first.slot))
        f.write(bytes(ENTRY_BYTES))

    assert shard_problems(engine, tmp_path, req) == [
        "rank 1's blocks do not hold its own device bytes",  # one is missing
        f"the ranks' tables name different blocks: {PROMPT_TOKENS // BLOCK} and {PROMPT_TOKENS // BLOCK - 1} entries"]


def test_ranks_computing_the_same_bytes_are_caught(tmp_path: Path) -> None:
    engine = make_engine(disk=tmp_path)
    engine.page_ranks = [0, 0]  # the mutant: rank 1 computes (and so stores) rank 0's shard
    req = store_prompt(engine)

    assert shard_problems(engine, tmp_path, req) == ["rank 1's blocks do not hold its own device bytes"]


def test_each_rank_loads_its_own_shard_back() -> None:
    engine = make_engine()
    prompt = store_prompt(engine).all_token_ids[:PROMPT_TOKENS]
    engine.pool.drop_cache()
    b = engine.add_request("b", [*prompt, 7])
    run_checked(engine)

    assert b.status is Status.FINISHED and b.loaded_tokens == PROMPT_TOKENS
    assert engine.corrupt_blocks == [] and engine.verified_blocks == PROMPT_TOKENS // BLOCK


def test_a_rank_loading_another_ranks_shard_is_caught() -> None:
    engine = make_engine()
    prompt = store_prompt(engine).all_token_ids[:PROMPT_TOKENS]
    engine.pool.drop_cache()
    pools = [w.pool for w in engine.workers]
    assert pools[0] is not None and pools[1] is not None
    for slot in range(pools[0].num_slots):  # the host tiers' shards swapped between the ranks
        mine, theirs = pools[0].slot(slot), pools[1].slot(slot)
        kept = mine.clone()
        mine.copy_(theirs)
        theirs.copy_(kept)
    b = engine.add_request("b", [*prompt, 7])
    engine.run()

    assert b.loaded_tokens == PROMPT_TOKENS
    assert engine.corrupt_blocks == [("b", i) for i in range(PROMPT_TOKENS // BLOCK)]


def fail_next_load(engine: SimEngine, rank: int) -> None:
    """Rank ``rank``'s next device load fails (a host-only engine: one handler both ways)."""
    worker = engine.workers[rank]
    (handler,) = worker.transfers.handlers
    faulty = FailFirstLoads(handler, 1)
    transfers = JobRouter()
    transfers.register(Medium.DEVICE, Medium.HOST, faulty)
    transfers.register(Medium.HOST, Medium.DEVICE, faulty)
    worker.transfers = transfers


# ---- a job is done only when both ranks reported it ---------------------------------------------------------


class HeldReports:
    """Keeps one worker's reports from the scheduler half until released, as a slow rank would."""

    def __init__(self, engine: SimEngine, rank: int) -> None:
        self._poll = engine.workers[rank].get_finished
        self._held = WorkerReport()
        self.releasing = False
        engine.workers[rank].get_finished = self  # type: ignore[method-assign]

    def __call__(self) -> WorkerFinished:
        poll = self._poll()
        self._held = self._held.aggregate(poll.report)
        if not self.releasing:
            return dataclasses.replace(poll, report=WorkerReport())
        report, self._held = self._held, WorkerReport()
        return dataclasses.replace(poll, report=report)

    @property
    def held_jobs(self) -> int:
        return len(self._held.completed) + len(self._held.failed)


def step_checked(engine: SimEngine, n: int) -> None:
    for _ in range(n):
        engine.step()
        engine.check_all()


def stored_blocks(engine: SimEngine) -> int:
    """Host blocks the scheduler half counts as stored (ready, unpinned): a reset drops exactly these."""
    before = sum(u.used_blocks for u in engine.scheduler.usage())
    engine.scheduler.reset()
    return before - sum(u.used_blocks for u in engine.scheduler.usage())


@pytest.mark.parametrize("scheduler_world_size", [RANKS, 1], ids=["counts-both-ranks", "mutant-counts-one"])
def test_store_is_done_only_when_both_ranks_reported_it(scheduler_world_size: int) -> None:
    engine = make_engine()
    engine.scheduler.world_size = scheduler_world_size  # the mutant finishes a job on its first report
    held = HeldReports(engine, rank=1)
    engine.add_request("a", tokens(PROMPT_TOKENS, seed=1))
    step_checked(engine, 20)
    pending_with_one_report = engine.scheduler.num_pending_jobs

    if scheduler_world_size == 1:  # caught: rank 0's report alone finished the store
        assert held.held_jobs == 1 and pending_with_one_report == 0
        return
    assert held.held_jobs == 1 and pending_with_one_report == 1
    held.releasing = True
    step_checked(engine, 2)
    assert engine.scheduler.num_pending_jobs == 0
    assert stored_blocks(engine) == PROMPT_TOKENS // BLOCK


@pytest.mark.parametrize("scheduler_world_size", [RANKS, 1], ids=["counts-both-ranks", "mutant-counts-one"])
def test_load_is_done_only_when_both_ranks_reported_it(scheduler_world_size: int) -> None:
    engine = make_engine()
    prompt = store_prompt(engine).all_token_ids[:PROMPT_TOKENS]
    engine.pool.drop_cache()
    engine.scheduler.world_size = scheduler_world_size
    held = HeldReports(engine, rank=1)
    b = engine.add_request("b", [*prompt, 7], max_new_tokens=2)  # fills no new block
    step_checked(engine, 20)
    # The load's host blocks stay pinned while a rank may still be copying them: a reset keeps them.
    pinned = PROMPT_TOKENS // BLOCK - stored_blocks(engine)

    if scheduler_world_size == 1:  # caught: rank 0's report alone unpinned blocks rank 1 may still read
        assert held.held_jobs == 1 and pinned == 0
        return
    assert b.loaded_tokens == PROMPT_TOKENS and held.held_jobs == 1
    assert pinned == PROMPT_TOKENS // BLOCK and engine.scheduler.num_pending_jobs == 1
    held.releasing = True
    engine.run(on_step=lambda e: e.check_all())
    assert engine.scheduler.num_pending_jobs == 0 and engine.corrupt_blocks == []


@pytest.mark.parametrize("scheduler_world_size", [RANKS, 1], ids=["counts-both-ranks", "mutant-counts-one"])
def test_load_failed_on_one_rank_counts_only_once_the_other_reported(scheduler_world_size: int) -> None:
    engine = make_engine()
    prompt = store_prompt(engine).all_token_ids[:PROMPT_TOKENS]
    engine.pool.drop_cache()
    engine.scheduler.world_size = scheduler_world_size
    fail_next_load(engine, rank=0)
    held = HeldReports(engine, rank=1)
    engine.add_request("b", [*prompt, 7], max_new_tokens=2)
    step_checked(engine, 20)
    failed_with_one_report = engine.scheduler.take_stats().failed_load_tokens

    if scheduler_world_size == 1:  # caught: rank 0's failure alone finished the load
        assert failed_with_one_report == PROMPT_TOKENS and engine.scheduler.num_pending_jobs == 0
        return
    assert failed_with_one_report == 0 and held.held_jobs == 1 and engine.scheduler.num_pending_jobs == 1
    held.releasing = True  # rank 1's load succeeded; the job still failed, on rank 0
    step_checked(engine, 2)
    assert engine.scheduler.take_stats().failed_load_tokens == PROMPT_TOKENS
    assert engine.scheduler.num_pending_jobs == 0 and engine.corrupt_blocks == []


# ---- a load failing on one rank ------------------------------------------------------------------------------


def scrub_free_blocks(engine: SimEngine) -> None:
    """Overwrite every device block but the null one on every rank (nothing runs now), so a block that nobody
    loaded or computed afterwards holds wrong bytes."""
    for kv in engine.kvs:
        for view in kv.views:
            view[1:].fill_(0x11)


@pytest.mark.parametrize("ignore_rank1_errors", [False, True], ids=["unions-errors", "mutant-ignores-rank1"])
def test_load_failing_on_one_rank_is_recomputed_on_both(ignore_rank1_errors: bool) -> None:
    engine = make_engine()
    prompt = store_prompt(engine).all_token_ids[:PROMPT_TOKENS]
    engine.pool.drop_cache()
    scrub_free_blocks(engine)
    fail_next_load(engine, rank=1)
    if ignore_rank1_errors:  # the mutant: an engine that takes only rank 0's failed blocks
        poll = engine.workers[1].get_finished

        def no_errors() -> WorkerFinished:
            return dataclasses.replace(poll(), load_errors=frozenset())

        engine.workers[1].get_finished = no_errors  # type: ignore[method-assign]
    b = engine.add_request("b", [*prompt, 7], max_new_tokens=4)

    if ignore_rank1_errors:  # caught: rank 1 computes on blocks it never received
        with pytest.raises(AssertionError, match="request b: wrong device bytes at \\[\\(1, 0, 0\\)"):
            engine.run(on_step=lambda e: e.check_all())
        assert engine.corrupt_blocks == [("b", i) for i in range(PROMPT_TOKENS // BLOCK)]
        return
    run_checked(engine)
    assert b.status is Status.FINISHED and b.loaded_tokens == 0  # recomputed, on both ranks
    assert engine.corrupt_blocks == []
    assert engine.scheduler.take_stats().failed_load_tokens == PROMPT_TOKENS

    c = engine.add_request("c", [*prompt, 8])  # the stored blocks are intact on both ranks: the next load hits
    engine.pool.drop_cache()
    run_checked(engine)
    assert c.loaded_tokens == PROMPT_TOKENS and engine.corrupt_blocks == []
    assert engine.verified_blocks == PROMPT_TOKENS // BLOCK


def test_ranks_have_their_own_namespaces() -> None:
    engine = make_engine()
    namespaces: list[Namespace] = [w.namespace for w in engine.workers]

    assert [ns.rank for ns in namespaces] == [0, 1] and {ns.world_size for ns in namespaces} == {RANKS}
    assert namespaces[0].fingerprint() != namespaces[1].fingerprint()
    assert namespaces[0].chain_root() == namespaces[1].chain_root()  # one scheduler keys both ranks' blocks
    assert dataclasses.replace(namespaces[1], rank=0) == namespaces[0]
