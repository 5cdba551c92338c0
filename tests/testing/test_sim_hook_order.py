"""The worker half in both of vLLM's hook orders (``HookOrder``): with speculative decoding vLLM hands a step's
stores over (``wait_for_save``) only after it collected the step's reports (the worker half's ``poll``). Either
way every store goes out at the start of the next step, once on every worker, is reported once and only after it
went out, and its blocks come back bit-exact."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvoffload.blocks import JobId, TransferJob
from kvoffload.connector.metadata import ConnectorMetadata
from kvoffload.connector.worker import WorkerFinished
from kvoffload.testing import layouts, sim_workload
from kvoffload.testing.sim import HookOrder, SimEngine, Status

BLOCK = 4
ORDERS = list(HookOrder)


def make_engine(order: HookOrder, layout: str = "attention", workers: int = 1,
                windows: dict[int, int] | None = None) -> SimEngine:
    make = {"attention": layouts.attention_layout, "shared_buffer": layouts.shared_buffer_layout}[layout]
    return sim_workload.make_engine(make, block_size=BLOCK, host_blocks=256, workers=workers, sliding_windows=windows,
                                    hook_order=order)


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 for i in range(n)]


@dataclass
class JobLog:
    """When each store job was made (step), and on each worker when it was submitted and reported, in order."""

    made: dict[JobId, int] = field(default_factory=dict)
    events: list[tuple[str, int, int, JobId]] = field(default_factory=list)
    """(what, step, worker, job): "submitted" or "reported", in the order they happened."""

    def of(self, what: str, worker: int) -> list[tuple[int, JobId]]:
        return [(step, job) for w_, step, w, job in self.events if w_ == what and w == worker]


def record_jobs(engine: SimEngine) -> JobLog:
    log = JobLog()
    build = engine.scheduler.build_connector_meta

    def build_meta(step: Any) -> ConnectorMetadata:
        meta = build(step)
        log.made.update((job.job_id, engine.step_count) for job in meta.store_jobs)
        return meta

    engine.scheduler.build_connector_meta = build_meta  # type: ignore[method-assign]
    for rank, worker in enumerate(engine.workers):
        submit, poll = worker.transfers.submit, worker.get_finished

        def submitted(job: TransferJob, rank: int = rank, submit: Any = submit) -> bool:
            log.events.append(("submitted", engine.step_count, rank, job.job_id))
            return bool(submit(job))

        def reported(rank: int = rank, poll: Any = poll) -> WorkerFinished:
            result: WorkerFinished = poll()
            log.events.extend(("reported", engine.step_count, rank, job) for job in result.report.completed)
            return result

        worker.transfers.submit = submitted  # type: ignore[method-assign]
        worker.get_finished = reported  # type: ignore[method-assign]
    return log


def run_turns(engine: SimEngine, turns: int = 3) -> None:
    """A chat of two conversations: each turn's prompt is the last turn's whole sequence and a few new tokens."""
    history = {c: tokens(18, seed=c) for c in range(2)}
    for turn in range(turns):
        for c in history:
            req = engine.add_request(f"{c}-{turn}", history[c], max_new_tokens=5)
            engine.run(on_step=lambda e: e.check_all())
            history[c] = req.all_token_ids + tokens(6, seed=10 * turn + c)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(("layout", "windows"), [("attention", None), ("shared_buffer", {1: 2 * BLOCK})],
                         ids=["attention", "sliding_window"])
@pytest.mark.parametrize("order", ORDERS, ids=[o.name for o in ORDERS])
def test_every_store_goes_out_at_the_next_step_once_per_worker_and_is_reported_once_after_it(
        order: HookOrder, layout: str, windows: dict[int, int] | None, workers: int) -> None:
    engine = make_engine(order, layout, workers, windows)
    log = record_jobs(engine)

    run_turns(engine)

    assert log.made, "the workload stored nothing"
    for rank in range(workers):
        submitted = [(step, job) for step, job in log.of("submitted", rank) if job in log.made]
        reported = [(step, job) for step, job in log.of("reported", rank) if job in log.made]
        assert Counter(job for _, job in submitted) == Counter(list(log.made))  # each once: none lost, none twice
        assert {job: step for step, job in submitted} == {job: made + 1 for job, made in log.made.items()}
        assert Counter(job for _, job in reported) == Counter(list(log.made))
        went_out = {job: i for i, (what, _, w, job) in enumerate(log.events) if what == "submitted" and w == rank}
        for i, (what, _, w, job) in enumerate(log.events):
            if what == "reported" and w == rank and job in log.made:
                assert went_out[job] < i, f"store {job} reported before it was submitted"
    assert engine.scheduler.num_pending_jobs == 0
    assert engine.corrupt_blocks == []


@pytest.mark.parametrize("order", ORDERS, ids=[o.name for o in ORDERS])
def test_blocks_stored_in_either_order_load_back_bit_exact(order: HookOrder) -> None:
    engine = make_engine(order, workers=2)
    prompt = tokens(40, seed=3)
    engine.add_request("a", prompt, max_new_tokens=3)
    engine.run(on_step=lambda e: e.check_all())
    engine.pool.drop_cache()  # only kvoffload still has the prefix

    b = engine.add_request("b", [*prompt, 1, 2])
    engine.run(on_step=lambda e: e.check_all())

    assert b.status is Status.FINISHED and b.device_hit_tokens == 0
    assert b.loaded_tokens == 40 // BLOCK * BLOCK  # every full block of the prompt came from kvoffload
    assert engine.verified_blocks == 40 // BLOCK and engine.corrupt_blocks == []
