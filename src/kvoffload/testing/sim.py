"""A small simulated engine that drives both connector halves step by step, the way vLLM does.

Each step: schedule (decode running requests, admit waiting ones through the device prefix cache and then
kvoffload, preempt the newest request when blocks run out) -> ``build_connector_meta`` -> on every worker:
``handle_preemptions``, ``start_kv_transfers``, the forward pass, ``prepare_store_kv`` and the step's ``get_finished``
(finished loads, load errors, finished jobs, transfer stats) in either of vLLM's orders (``HookOrder``) ->
``update_connector_output`` -> finished loads, finished requests.

The forward pass writes deterministic bytes: an engine block's page is a pseudo-random function of the tokens up
to its end (its chained hash) and of the worker's rank, as tensor-parallel ranks hold different heads; with a
replicated layout (latent attention, ``KVCacheLayout.replicated``) every rank computes the same bytes. So every
block in the device cache can be checked bit for bit against what a real computation would hold
(``check_device_blocks``), whether it was computed or loaded.

Sliding-window groups work as in vLLM: block 0 is the null block, and a window group's blocks that no token still
to compute attends to are freed and replaced by it in the block table (``_drop_outside_window``). The null block
holds a sentinel pattern on every worker, and ``check_all`` raises if anything wrote it. State groups (Mamba-style
layers, ``KVCacheLayout.state_groups``) work as vLLM's ``MambaManager``: a window of one block, since the next
token needs only the state after the last computed block.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from kvoffload.canonical import CanonicalKV
from kvoffload.config import OffloadConfig
from kvoffload.connector.announce import Announcement, Describe
from kvoffload.connector.metadata import WorkerReport
from kvoffload.connector.requests import ScheduledRequest, StepSchedule
from kvoffload.connector.scheduler import ConnectorScheduler
from kvoffload.connector.stats import TransferStats
from kvoffload.connector.worker import ConnectorWorker
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout
from kvoffload.testing.block_pool import NULL_BLOCK, BlockPool
from kvoffload.testing.sim_values import (
    NULL_SENTINEL,
    HookOrder,
    SimRequest,
    Status,
    StepReport,
    block_matches,
    next_token,
    write_block,
)

KVCaches = Mapping[str, torch.Tensor]

class SimEngine:
    """Engine block pool + both connector halves (one scheduler, ``num_workers`` workers with their own KV).

    ``sliding_windows``: KV-cache group -> its sliding window in tokens, for the groups that have one; a state
    group's is one block. ``clock``: the scheduler half's (a fake one makes a tier slow without waiting).
    ``hook_order``: where each step's stores are handed to the workers (``HookOrder``). ``describe``: the engine
    publishes router events (``sim_values.SimDescriber`` describes its blocks; ``scheduler.take_announcements``).
    """

    def __init__(self, layout: KVCacheLayout, make_kv_caches: Callable[[], KVCaches], config: OffloadConfig,
                 block_size: int = 16, num_workers: int = 1, max_batch_tokens: int = 8192,
                 vocab_size: int = 1000, sliding_windows: Mapping[int, int] | None = None,
                 clock: Callable[[], float] | None = None, hook_order: HookOrder = HookOrder.SAVE_FIRST,
                 describe: Describe | None = None) -> None:
        self.layout = layout
        self.hook_order = hook_order
        self.block_size = block_size
        self.num_groups = len(layout.groups)
        self.vocab_size = vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.sliding_windows = {**dict.fromkeys(layout.state_groups, block_size), **(sliding_windows or {})}
        ns = Namespace(model="sim", dtype="int8", layout=layout.describe(), world_size=num_workers,
                       replicated=layout.replicated)
        self.page_ranks = [0] * num_workers if layout.replicated else list(range(num_workers))
        """Whose bytes each worker's forward pass computes (and its loads must hold): every rank its own, or
        all rank 0's for a replicated layout."""
        # Window blocks are freed while their request runs: stores must finish before the next forward pass.
        self.scheduler = ConnectorScheduler(config, layout, block_size, ns, null_block_id=NULL_BLOCK,
                                            flush_stores_next_step=bool(self.sliding_windows),
                                            clock=clock or time.monotonic, describe=describe)
        self.workers = [ConnectorWorker(config, layout, block_size, dataclasses.replace(ns, rank=r))
                        for r in range(num_workers)]
        for worker in self.workers:
            worker.register_kv_caches(make_kv_caches())
        self.kvs: list[CanonicalKV] = [w.kv for w in self.workers if w.kv is not None]
        self.transfer_stats = [TransferStats() for _ in self.workers]  # each worker's, summed over every poll
        for kv in self.kvs:
            for view in kv.views:
                view[NULL_BLOCK].fill_(NULL_SENTINEL)
        self.pool = BlockPool(layout.num_blocks)
        self.requests: dict[str, SimRequest] = {}
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.step_count = 0
        self._finished_loads: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._work: list[tuple[SimRequest, int, int]] = []
        self.computed_tokens = 0
        self.verified_blocks = 0
        self.announcements: list[Announcement] = []
        """With ``describe``: what the steps announced to routers, oldest first (the caller drains it)."""
        self.corrupt_blocks: list[tuple[str, int]] = []
        """(request id, engine block index) of loaded blocks whose bytes were wrong; must stay empty."""

    # ---- requests ---------------------------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt: Sequence[int], max_new_tokens: int = 1,
                    extra_keys: Iterable[str] = ()) -> SimRequest:
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} already exists")
        req = SimRequest(req_id, list(prompt), max_new_tokens, tuple(extra_keys), num_prompt_tokens=len(prompt))
        self.requests[req_id] = req
        self.waiting.append(req)
        return req

    def abort(self, req_id: str) -> None:
        req = self.requests[req_id]
        if req.status is Status.FINISHED:
            return
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        self._release(req, valid=req.status is not Status.LOADING)
        req.status = Status.FINISHED
        self.scheduler.request_finished(req_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or any(r.status is Status.LOADING for r in self.requests.values())

    def run(self, max_steps: int = 10_000, on_step: Callable[[SimEngine], None] | None = None) -> None:
        """Step until every request finished, every job completed and the tiers asked for no more jobs.

        Ends with a step that started with nothing to do and built empty metadata: a job that completes in a
        step may queue a tier transfer (a write-through) that only the next step's metadata ships.
        """
        for _ in range(max_steps):
            quiet = not self.has_work and self.scheduler.num_pending_jobs == 0
            idle = self.step().idle
            if on_step is not None:
                on_step(self)
            if quiet and idle:
                return
        raise RuntimeError(f"simulation did not finish in {max_steps} steps")

    def reset_prefix_cache(self) -> None:
        self.pool.drop_cache()
        self.scheduler.reset()

    # ---- one engine step --------------------------------------------------------------------------------------

    def step(self) -> StepReport:
        self.step_count += 1
        self._work = []
        scheduled, preempted = self._schedule()
        meta = self.scheduler.build_connector_meta(StepSchedule.of(scheduled, frozenset(preempted)))
        report = WorkerReport()
        for rank, worker in enumerate(self.workers):
            worker.handle_preemptions(meta)
            worker.start_kv_transfers(meta)
            self._forward(self.kvs[rank], self.page_ranks[rank])
            if self.hook_order is HookOrder.SAVE_FIRST:
                worker.prepare_store_kv(meta)
            report = report.aggregate(self._collect(rank))
            if self.hook_order is HookOrder.REPORT_FIRST:
                worker.prepare_store_kv(meta)
        self.scheduler.update_connector_output(report)
        if self.scheduler.announcer is not None:  # as vLLM asks for the connector's events after each step
            self.announcements += self.scheduler.take_announcements()
        self._sample()
        self._complete_loads()
        finished = self._finish_requests()
        tokens = sum(end - start for _, start, end in self._work)
        return StepReport(self.step_count, tokens, tuple(finished), meta.is_empty)

    def _collect(self, rank: int) -> WorkerReport:
        """One worker's poll of the step: finished loads, failed load blocks, stats; its finished jobs returned."""
        poll = self.workers[rank].get_finished()
        for req_id in poll.finished_loads:
            self._finished_loads[req_id] = self._finished_loads.get(req_id, 0) + 1
        self._load_errors |= poll.load_errors
        self.transfer_stats[rank] = self.transfer_stats[rank].aggregate(poll.stats or TransferStats())
        return poll.report

    def _schedule(self) -> tuple[list[ScheduledRequest], list[str]]:
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self.max_batch_tokens
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted to make room for an older request
            self._drop_outside_window(req, req.num_computed_tokens)
            while not self._grow(req, req.num_computed_tokens + 1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, req.num_computed_tokens + 1))
                budget -= 1
        for req in list(self.waiting):
            if self.running and len(req.all_token_ids) - req.num_computed_tokens > budget:
                break
            admitted = self._admit(req)
            if admitted is None:
                break
            if isinstance(admitted, ScheduledRequest):
                budget -= self._work[-1][2] - self._work[-1][1]
                scheduled.append(admitted)
        return scheduled, preempted

    def _admit(self, req: SimRequest) -> ScheduledRequest | bool | None:
        """Admit a waiting request: a ScheduledRequest, False (not computing this step), None (out of blocks)."""
        external, load_async = 0, False
        if not req.block_ids:  # a new or preempted request: look up the device prefix cache, then kvoffload
            hits = self._device_hits(req)
            computed = len(hits[0]) * self.block_size
            matched, load_async = self.scheduler.get_num_new_matched_tokens(req, computed)
            if matched is None:
                return False
            for blocks in hits:
                for block in blocks:
                    self.pool.share(block)
            req.block_ids, req.sent_blocks = hits, [0] * self.num_groups
            req.num_computed_tokens = req.device_hit_tokens = computed
            external = matched
        target = req.num_computed_tokens + external if load_async else len(req.all_token_ids)
        if not self._grow(req, target):
            self._release(req, valid=True)
            req.num_computed_tokens = 0
            return None
        self._drop_outside_window(req, req.num_computed_tokens + external)
        self.scheduler.update_state_after_alloc(req, req.block_ids, external)
        self.waiting.remove(req)
        if load_async:
            req.status, req.pending_load_tokens = Status.LOADING, external
            return False
        req.status = Status.RUNNING
        self.running.append(req)
        return self._scheduled(req, target)

    def _device_hits(self, req: SimRequest) -> list[list[int]]:
        limit = (len(req.all_token_ids) - 1) // self.block_size
        hashes = req.block_hashes(limit, self.block_size)
        hits: list[list[int]] = [[] for _ in range(self.num_groups)]
        for i in range(limit):
            blocks = [self.pool.lookup((g, hashes[i])) for g in range(self.num_groups)]
            if None in blocks:
                break
            for g in range(self.num_groups):
                hits[g].append(blocks[g])  # type: ignore[arg-type]
        return hits

    def _grow(self, req: SimRequest, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in every group; False (nothing changed) when out of blocks."""
        if not req.block_ids:
            req.block_ids, req.sent_blocks = [[] for _ in range(self.num_groups)], [0] * self.num_groups
        need = -(-num_tokens // self.block_size) - len(req.block_ids[0])
        if need <= 0:
            return True
        blocks = self.pool.allocate(need * self.num_groups)
        if blocks is None:
            return False
        for g in range(self.num_groups):
            req.block_ids[g].extend(blocks[g * need:(g + 1) * need])
        return True

    def _drop_outside_window(self, req: SimRequest, num_computed_tokens: int) -> None:
        """vLLM's ``remove_skipped_blocks``: from ``num_computed_tokens`` on, no token attends to a window
        group's blocks before the window, so they are freed and the null block takes their place."""
        for g, window in self.sliding_windows.items():
            ids = req.block_ids[g]
            for i in range(min(len(ids), max(0, num_computed_tokens - window + 1) // self.block_size)):
                if ids[i] != NULL_BLOCK:
                    self.pool.free([ids[i]])
                    ids[i] = NULL_BLOCK

    def _scheduled(self, req: SimRequest, computed_after: int) -> ScheduledRequest:
        new = tuple(tuple(ids[sent:]) for ids, sent in zip(req.block_ids, req.sent_blocks, strict=True))
        resumed = req.preemptions > 0 and req.sent_blocks[0] == 0
        req.sent_blocks = [len(ids) for ids in req.block_ids]
        self._work.append((req, req.num_computed_tokens, computed_after))
        req.num_computed_tokens = computed_after
        return ScheduledRequest(req.request_id, new, computed_after, resumed)

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self._release(req, valid=True)
        req.status, req.num_computed_tokens = Status.WAITING, 0
        req.preemptions += 1
        self.waiting.insert(0, req)

    def _release(self, req: SimRequest, valid: bool) -> None:
        for ids in req.block_ids:
            (self.pool.free if valid else self.pool.free_uncached)([b for b in reversed(ids) if b != NULL_BLOCK])
        req.block_ids, req.sent_blocks = [], []

    # ---- forward pass, sampling, completions ------------------------------------------------------------------

    def _forward(self, kv: CanonicalKV, page_rank: int) -> None:
        for req, start, end in self._work:
            for i in range(start // self.block_size, (end - 1) // self.block_size + 1):
                filled = min(end, (i + 1) * self.block_size)
                for g in range(self.num_groups):
                    write_block(kv, g, req.block_ids[g][i], req.page_seed(i, filled, self.block_size), page_rank)

    def _sample(self) -> None:
        for req, start, end in self._work:
            self.computed_tokens += end - start
            hashes = req.block_hashes(end // self.block_size, self.block_size)
            for g in range(self.num_groups):
                for i, h in enumerate(hashes):
                    if req.block_ids[g][i] != NULL_BLOCK:
                        self.pool.cache(req.block_ids[g][i], (g, h))
            if end == len(req.all_token_ids):
                req.all_token_ids.append(next_token(req.all_token_ids, self.vocab_size))
                if req.first_token_step is None:
                    req.first_token_step = self.step_count

    def _complete_loads(self) -> None:
        for req_id in [r for r, count in self._finished_loads.items() if count >= len(self.workers)]:
            del self._finished_loads[req_id]
            req = self.requests.get(req_id)
            if req is None or req.status is not Status.LOADING:
                continue  # aborted while loading
            first, stop = req.num_computed_tokens // self.block_size, req.num_computed_tokens + req.pending_load_tokens
            last = -(-stop // self.block_size)  # a full-prompt hit loads its last block too (the last token's)
            ok = first
            while ok < last and not any(req.block_ids[g][ok] in self._load_errors for g in range(self.num_groups)):
                ok += 1
            for g in range(self.num_groups):
                self._load_errors.difference_update(req.block_ids[g][first:last])
            self._verify_loaded(req, first, ok)
            req.status, req.pending_load_tokens = Status.WAITING, 0
            self.waiting.insert(0, req)
            if ok < last and self.sliding_windows:
                # Recomputing from block ``ok`` would need window blocks already dropped; vLLM too recomputes a
                # multi-group request whose load failed from the start.
                self._release(req, valid=False)
                req.num_computed_tokens = 0
                continue
            req.loaded_tokens += min(ok * self.block_size, stop) - req.num_computed_tokens
            req.num_computed_tokens = min(ok * self.block_size, stop)

    def _verify_loaded(self, req: SimRequest, first: int, end: int) -> None:
        """Check every loaded block, on every worker, against the bytes its tokens must produce."""
        hashes = req.block_hashes(end, self.block_size)
        for i in range(first, end):
            good = all(block_matches(kv, g, req.block_ids[g][i], hashes[i], self.page_ranks[rank])
                       for rank, kv in enumerate(self.kvs) for g in range(self.num_groups)
                       if req.block_ids[g][i] != NULL_BLOCK)
            self.verified_blocks += 1
            if not good:
                self.corrupt_blocks.append((req.request_id, i))

    def _finish_requests(self) -> list[str]:
        done = [r for r in self.running if r.num_new_tokens >= r.max_new_tokens]
        for req in done:
            self.running.remove(req)
            self._release(req, valid=True)
            req.status = Status.FINISHED
            self.scheduler.request_finished(req.request_id)
        return [r.request_id for r in done]

    # ---- expected bytes ---------------------------------------------------------------------------------------

    def check_device_blocks(self, req: SimRequest) -> list[tuple[int, int, int]]:
        """(rank, group, block index) of every computed full block whose device bytes are not what they must be."""
        bad = []
        full = req.num_computed_tokens // self.block_size if req.status is Status.RUNNING else 0
        for rank, kv in enumerate(self.kvs):
            for g in range(self.num_groups):
                for i in range(full):
                    if req.block_ids[g][i] == NULL_BLOCK:
                        continue
                    seed = req.block_hashes(i + 1, self.block_size)[i]
                    if not block_matches(kv, g, req.block_ids[g][i], seed, self.page_ranks[rank]):
                        bad.append((rank, g, i))
        return bad

    def null_block_intact(self) -> bool:
        """Whether the null block still holds ``NULL_SENTINEL`` on every worker."""
        return all(bool((view[NULL_BLOCK] == NULL_SENTINEL).all()) for kv in self.kvs for view in kv.views)

    def check_all(self) -> None:
        """Raise if any running request's device bytes are wrong, the null block was written, or a tier's
        bookkeeping is broken."""
        for req in self.running:
            bad = self.check_device_blocks(req)
            if bad:
                raise AssertionError(f"request {req.request_id}: wrong device bytes at {bad[:5]}")
        if not self.null_block_intact():
            raise AssertionError("the null block was written")
        self.scheduler.index.check_integrity()
