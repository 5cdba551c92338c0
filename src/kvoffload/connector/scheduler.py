"""The scheduler half: decides what to load and store each engine step. Never touches tensors.

Per step the engine asks it, for each new request, how many prefix tokens kvoffload can supply
(``get_num_new_matched_tokens``), tells it which device blocks it allocated (``update_state_after_alloc``: this
creates a load job), then asks for the step's ``ConnectorMetadata`` (``build_connector_meta``: stores for every block
that becomes full this step, background tier jobs, fences). Workers report finished jobs back
(``update_connector_output``); a job is done once every worker reported it, and failed if any worker failed it.

Store admission (``config.store_admission``, manager/admission.py) sees each block a request computes once, when
it becomes full: the rule says how many leading ones of the step's new full blocks to store, and the request stores
none after one it declined (a block is useless without its parent). Blocks the request found cached (device prefix
cache or a kvoffload load) are reuses, stored without asking (the manager skips those it holds).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from kvoffload import _stepscan
from kvoffload.config import OffloadConfig
from kvoffload.connector.load_cost import LoadCost
from kvoffload.connector.metadata import ConnectorMetadata, LoadJob, WorkerMetadata
from kvoffload.connector.recording import TraceTap
from kvoffload.connector.requests import (
    NEVER,
    EngineRequest,
    PlannedLoad,
    RequestState,
    StepSchedule,
)
from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.tiers import build_manager, host_slot_bytes, offload_factor
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.layout import KVCacheLayout
from kvoffload.manager.admission import AdmitAll, make_admission
from kvoffload.manager.base import OffloadEvent, ResidencyManager, TierTransfer, TierUsage
from kvoffload.specs import NO_BLOCK, BlockSpec, DeviceBlocks, HostBlocks, JobId, Medium, TransferJob

logger = logging.getLogger(__name__)


class JobKind(Enum):
    LOAD = "load"
    STORE = "store"
    TIER = "tier"


@dataclass
class _FullBlocks:
    """Offload blocks that became full this step, by group: their keys, their device blocks (``factor`` per key)
    and the request of each key; the step's store job is made of them."""

    keys: list[list[OffloadKey]]
    device_blocks: list[list[int]]
    owners: list[list[RequestState]]

    @classmethod
    def empty(cls, num_groups: int) -> _FullBlocks:
        return cls([[] for _ in range(num_groups)], [[] for _ in range(num_groups)], [[] for _ in range(num_groups)])

    def count(self) -> int:
        return sum(len(keys) for keys in self.keys)


@dataclass(frozen=True)
class _Columns:
    """The last step's scheduled requests: their states (None: not stored) and store thresholds less one,
    aligned."""

    req_ids: list[str]
    states: list[RequestState | None]
    partial: array[int]
    """int64, for ``_stepscan.scan``: kept across steps, a list's scattered int objects would each be a cache miss."""
    generation: int


@dataclass
class _PendingJob:
    kind: JobKind
    req_ids: tuple[str, ...]
    keys: tuple[OffloadKey, ...] = ()
    transfer_id: int = -1
    blocks: int = 0
    """A load's offload blocks per group (its tokens, once multiplied by the offload block size)."""
    ok: int = 0
    failed: int = 0


class ConnectorScheduler:
    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, engine_block_size: int,
                 namespace: Namespace, manager: ResidencyManager | None = None,
                 null_block_id: int | None = None, flush_stores_next_step: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``null_block_id``: the engine's placeholder block (vLLM's block 0 stands in for blocks a sliding-window
        group has dropped); offload blocks that contain it are never stored, and loads leave a hole (``NO_BLOCK``)
        where it stands, so they never write it.

        ``flush_stores_next_step``: the engine may reuse or rewrite a block of a running request in the very
        next step (a sliding-window block that left the window, a Mamba state updated in place), so every store
        is flushed at the start of the next step, before the forward pass, instead of running beside it.

        ``clock``: monotonic seconds, for the timings behind cost-aware loading (tests drive a fake one).
        """
        self.factor = offload_factor(config, engine_block_size)
        self.engine_block_size = engine_block_size
        self.offload_tokens = self.factor * engine_block_size
        self.num_groups = len(layout.groups)
        self.state_groups = frozenset(layout.state_groups)
        self.world_size = namespace.world_size
        self.manager = manager or build_manager(config, layout, self.factor, namespace)
        self.null_block_id = null_block_id
        self.flush_stores_next_step = flush_stores_next_step
        self.load_cost = LoadCost(config.load_policy, self.offload_tokens, host_slot_bytes(layout, self.factor),
                                  config.prefill_tokens_per_s)
        self.manager.set_load_cost(self.load_cost)
        self._clock = clock
        self._skipped_reported = 0
        self._promotions: dict[JobId, tuple[Medium, int, float]] = {}
        self._last_meta: tuple[float, int] | None = None
        self._root = namespace.chain_root()
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[JobId, _PendingJob] = {}
        self._job_ids = itertools.count()
        self._new_loads: list[LoadJob] = []
        self._to_flush: set[JobId] = set()
        self._to_flush_next: set[JobId] = set()
        self._stats = SchedulerStats()
        self._generation = 0
        """Bumped whenever a request state comes, goes, or changes its store threshold outside a step."""
        self._columns: _Columns | None = None
        self._usage_moved = True
        self._trace = None if config.record_trace is None else TraceTap(config.record_trace, self.offload_tokens,
                                                                         clock)
        """A manager call that may change tier usage ran since ``take_usage_moved`` (stats skip it otherwise)."""
        host = next(u for u in self.manager.usage() if u.medium is Medium.HOST)
        self.admission = make_admission(config.store_admission, host.capacity_blocks)
        self._admit_all = isinstance(self.admission, AdmitAll)
        self._offer_from: dict[str, int] = {}
        """Per request, the first offload block it computed itself (the ones before are reuses), or ``DECLINED``
        once admission declined one of its blocks; kept only when admission is not ``all``."""

    # ---- load path -------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens kvoffload can load beyond the ``num_computed_tokens`` the engine already holds.

        Returns ``(tokens, True)`` for a hit (whole offload blocks; the load is asynchronous), ``(0, False)`` for a
        miss, and ``(None, False)`` when the next block is still being stored or promoted: ask again next step.
        """
        state = self._state(request)
        state.planned_load = None
        self._usage_moved = True  # a lookup may reserve host room for a promotion
        self._reused(request.request_id, num_computed_tokens // self.offload_tokens)
        num_tokens = len(request.all_token_ids)
        state.query_tokens = max(0, num_tokens - num_computed_tokens)
        if state.ambiguous:
            return 0, False
        # The engine must compute at least the last prompt token itself, to sample from its logits.
        end = (num_tokens - 1) // self.offload_tokens
        first = num_computed_tokens // self.offload_tokens
        if first >= end:
            return 0, False
        hits, pending = end - first, False
        group_keys: dict[int, list[OffloadKey]] = {}
        for group in range(self.num_groups):
            if group in self.state_groups:
                continue
            keys = state.keys(first, first + hits, group)
            group_keys[group] = keys
            result = self.manager.lookup(keys)
            if result.hits < hits:
                # The group with the shortest run decides, and whether its next block is on its way.
                hits, pending = result.hits, result.pending
        if pending:
            return None, False
        if self.state_groups:
            hits = self._state_hit(state, first, hits)
        hit_tokens = (first + hits) * self.offload_tokens - num_computed_tokens
        if hits == 0 or hit_tokens <= 0:
            return 0, False
        planned_keys = tuple(k for g in range(self.num_groups)
                             for k in (state.keys(first + hits - 1, first + hits, g) if g in self.state_groups
                                       else group_keys[g][:hits]))
        state.planned_load = PlannedLoad(first, first + hits, planned_keys)
        return hit_tokens, True

    def _state_hit(self, state: RequestState, first: int, hits: int) -> int:
        """The longest run, at most ``hits`` blocks from ``first``, whose last block every state group holds.

        A state block is the state after its tokens, so a state group needs only the block where the loaded run
        ends (as vLLM's own prefix cache does: it keeps states only where a prefill chunk ended).
        """
        while hits > 0:
            keys = [state.keys(first + hits - 1, first + hits, g)[0] for g in sorted(self.state_groups)]
            if self.manager.lookup(keys).hits == len(keys):
                return hits
            hits -= 1
        return 0

    def update_state_after_alloc(self, request: EngineRequest, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """The engine allocated ``block_ids`` (all of the request's blocks, per group): start the planned load."""
        state = self._state(request)
        state.block_ids = [list(ids) for ids in block_ids]
        plan, state.planned_load = state.planned_load, None
        if state.query_tokens is not None:  # engines may call this again without a new lookup
            self._stats.requests += 1
            self._stats.query_tokens += state.query_tokens
            state.query_tokens = None
        if num_external_tokens == 0 or plan is None:
            return
        computed = plan.end * self.offload_tokens - num_external_tokens
        skip = computed // self.engine_block_size - plan.first * self.factor
        flat_keys = plan.keys
        src = self.manager.prepare_load(flat_keys)
        self.manager.touch(flat_keys)
        n = plan.end - plan.first
        first_engine_block = computed // self.engine_block_size
        last_engine_block = plan.end * self.factor
        per_group = last_engine_block - first_engine_block
        device_ids = [b for ids in state.block_ids for b in ids[first_engine_block:last_engine_block]]
        for g in self.state_groups:  # only the run's last block holds a state worth loading
            start = g * per_group
            device_ids[start:start + max(0, per_group - self.factor)] = [NO_BLOCK] * max(0, per_group - self.factor)
        if self.null_block_id in device_ids:  # a window group dropped these blocks: nothing may write the null block
            device_ids = [NO_BLOCK if b == self.null_block_id else b for b in device_ids]
        dst = DeviceBlocks(tuple(device_ids), (per_group,) * self.num_groups)
        job = self._new_job(JobKind.LOAD, (request.request_id,), flat_keys, blocks=n)
        self._reused(request.request_id, plan.end)
        src = self._load_source(src, n, skip)
        self._new_loads.append(LoadJob(request.request_id, TransferJob(job, src, dst)))
        state.jobs.add(job)
        self._stats.hit_tokens += num_external_tokens

    def _load_source(self, src: BlockSpec, n: int, skip: int) -> BlockSpec:
        """The host side of a load of ``n`` offload blocks per group, from ``prepare_load``'s one entry per key.

        A state group has one key (its run's last block): it is repeated ``n`` times, so every group lists ``n``
        entries; the device side leaves holes where those repeats stand, so only the last one is copied.
        """
        if not self.state_groups and not skip:
            return _regroup(src, (n,) * self.num_groups)
        if not isinstance(src, HostBlocks):
            raise TypeError(f"loads come from host slots, not {type(src).__name__}")
        slots: list[int] = []
        at = 0
        for g in range(self.num_groups):
            taken = 1 if g in self.state_groups else n
            group_slots = src.slots[at:at + taken]
            slots.extend(group_slots * n if g in self.state_groups else group_slots)
            at += taken
        return HostBlocks(tuple(slots), (n,) * self.num_groups, skip_sub_blocks=skip)

    # ---- each step -------------------------------------------------------------------------------------------

    def build_connector_meta(self, step: StepSchedule) -> ConnectorMetadata:
        for req_id in step.preempted_req_ids:
            self._fence(req_id)
            if (state := self._requests.get(req_id)) is not None:
                state.block_ids = []
                state.scheduled = False
        full = self._collect_stores(step)
        self._observe_step(0 if full is None else full.count())
        store = None if full is None else self._store_job(full)
        if store is not None and self.flush_stores_next_step:
            self._to_flush_next.add(store.job_id)
        transfers = self.manager.take_transfers()
        tier_jobs = [self._tier_job(t) for t in transfers] if transfers else []
        if not (store or tier_jobs or self._new_loads or self._to_flush or self._to_flush_next):
            return NO_JOBS  # most decode steps
        loads, self._new_loads = self._new_loads, []
        flush, self._to_flush, self._to_flush_next = self._to_flush, self._to_flush_next, set()
        return ConnectorMetadata(tuple(loads), (store,) if store else (), tuple(tier_jobs), frozenset(flush))

    def _collect_stores(self, step: StepSchedule) -> _FullBlocks | None:
        """Track the scheduled requests' new blocks; their offload blocks that became full (None: none did).

        Hot: every step, every running request. Python runs per request only for a request that got new blocks
        or whose computed tokens reached its store threshold (the next offload block is full); finding those (and
        checking the columns) is one pass in C (``kvoffload._stepscan``): two ``compress`` passes in Python, and
        numpy before them, cost more, each finding its code and data cold after the engine's own work. Most
        decode steps of most requests are neither.
        """
        states, partial = self._columns_of(step.req_ids)
        # Request i's next block is full once its computed tokens exceed partial[i]: computed + offset > partial.
        new_block_ids, computed = step.new_block_ids, step.computed_tokens
        grown, filled = _stepscan.scan(len(states), new_block_ids, computed, partial, step.computed_offset)
        for i in grown:
            if (state := states[i]) is not None:
                _add_blocks(state, new_block_ids[i], step.req_ids[i] in step.resumed)  # type: ignore[arg-type]
        full = None
        for i in filled:
            state = states[i]
            assert state is not None  # a request without state has the threshold NEVER
            full = full or _FullBlocks.empty(self.num_groups)
            self._full_blocks(state, computed[i] + step.computed_offset, full)
            partial[i] = state.store_threshold() - 1
        return full

    def _columns_of(self, req_ids: Sequence[str]) -> tuple[list[RequestState | None], array[int]]:
        """The states of ``req_ids`` and, aligned with them, the most computed tokens at which each one's next
        offload block is still partial (its store threshold less one).

        Kept from the last step while the engine schedules the same requests in the same order and no request
        state came or went (a decode step): then it costs one list comparison.
        """
        cached = self._columns
        if cached is not None and cached.generation == self._generation and cached.req_ids == req_ids:
            return cached.states, cached.partial
        states = [self._requests.get(r) for r in req_ids]
        for i, state in enumerate(states):
            if state is None or state.ambiguous:
                logger.debug("scheduled request %s was never looked up or shares its id; not storing it",
                             req_ids[i])
                states[i] = None
        partial = array("q", [(NEVER if s is None else s.store_threshold()) - 1 for s in states])
        self._columns = _Columns(list(req_ids), states, partial, self._generation)
        return states, partial

    def _full_blocks(self, state: RequestState, computed: int, out: _FullBlocks) -> None:
        """Add the request's offload blocks that ``computed`` tokens fill and that are not yet stored to ``out``."""
        first = state.next_store_block
        end = state.full_blocks(computed)
        if end <= first:
            return
        state.next_store_block = end
        end = self._admitted_end(state, first, end)
        if end <= first:
            return
        f, null = self.factor, self.null_block_id
        for g in range(self.num_groups):
            keys = state.keys(first, end, g)
            device = state.block_ids[g][first * f:end * f]
            if null in device:  # a window group dropped some: those blocks are not stored
                kept = [i for i in range(len(keys)) if null not in device[i * f:(i + 1) * f]]
                keys = [keys[i] for i in kept]
                device = [b for i in kept for b in device[i * f:(i + 1) * f]]
            out.keys[g] += keys
            out.device_blocks[g] += device
            out.owners[g] += [state] * len(keys)

    def _reused(self, req_id: str, blocks: int) -> None:
        """The request found its first ``blocks`` offload blocks cached: admission is not asked about them."""
        if not self._admit_all:
            mark = self._offer_from.get(req_id, 0)
            if mark != DECLINED and blocks > mark:
                self._offer_from[req_id] = blocks

    def _admitted_end(self, state: RequestState, first: int, end: int) -> int:
        """Where the stored part of the request's new full blocks ``[first, end)`` ends, admission asked.

        Each block is offered once (``next_store_block`` moves past it); after a declined block the request
        stores nothing more, though its later blocks are still offered, so that they count as seen.
        """
        stats = self._stats
        if self._admit_all:
            stats.admitted_blocks += end - first
            return end
        req_id = state.request.request_id
        mark = self._offer_from.get(req_id, 0)
        start = first if mark == DECLINED else min(end, max(first, mark))
        offered = state.keys(start, end, 0)  # group 0's keys name the blocks: all groups' go or stay together
        admitted = self.admission.admit(offered)
        if mark == DECLINED:
            stats.declined_blocks += len(offered)
            return first
        stats.admitted_blocks += admitted
        stats.declined_blocks += len(offered) - admitted
        if admitted < len(offered):
            self._offer_from[req_id] = DECLINED
        return start + admitted

    def limit_stores(self, request: EngineRequest, tokens: int) -> None:
        """Store no block of ``request`` past its first ``tokens`` tokens (models whose states are kept only
        for the prompt: ``adapters.stores_prompt_blocks_only``)."""
        state = self._state(request)
        if state.store_limit != tokens:
            state.store_limit = tokens
            self._generation += 1

    def _store_job(self, full: _FullBlocks) -> TransferJob | None:
        """One store job per step for every request's new full blocks: one submit, one copy plan."""
        keys = [k for group in full.keys for k in group]  # specs list group 0's blocks first
        if not keys:
            return None
        self._usage_moved = True
        out = self.manager.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return None
        if len(out.keys_to_store) < len(keys):  # some are stored already, or two requests share a block
            full = _only(full, set(out.keys_to_store), self.factor)
        group_sizes = tuple(len(group) for group in full.keys)
        src = DeviceBlocks(tuple(b for group in full.device_blocks for b in group),
                           tuple(n * self.factor for n in group_sizes))
        owners = {id(st): st for group in full.owners for st in group}
        job = self._new_job(JobKind.STORE, tuple(st.request.request_id for st in owners.values()),
                            out.keys_to_store)
        for state in owners.values():
            state.jobs.add(job)
        return TransferJob(job, src, _regroup(out.store_spec, group_sizes))

    def _tier_job(self, transfer: TierTransfer) -> TransferJob:
        job = self._new_job(JobKind.TIER, (), (), transfer.transfer_id)
        if transfer.dst.medium is Medium.HOST:  # a promotion: timed for the tier's speed (load_cost)
            nbytes = sum(transfer.src.group_sizes) * self.load_cost.block_bytes
            self._promotions[job] = (transfer.src.medium, nbytes, self._clock())
        return TransferJob(job, transfer.src, transfer.dst)

    def _observe_step(self, filled_blocks: int) -> None:
        """The engine's prefill speed, roughly: tokens whose blocks filled in the last step over its length (from
        one ``build_connector_meta`` to the next: that step's forward pass)."""
        now = self._clock()
        if self._last_meta is not None:
            started, blocks = self._last_meta
            self.load_cost.observe_step(blocks // self.num_groups * self.offload_tokens, now - started)
        self._last_meta = (now, filled_blocks)

    def update_connector_output(self, report: WorkerMetadata) -> None:
        """Count worker reports; finish a job once every worker has reported it."""
        for job_ids, ok in ((report.completed, True), (report.failed, False)):
            for job_id, count in job_ids.items():
                job = self._jobs.get(job_id)
                if job is None:
                    logger.warning("report for unknown job %d ignored", job_id)
                    continue
                if ok:
                    job.ok += count
                else:
                    job.failed += count
                if job.ok + job.failed >= self.world_size:
                    self._finish(job_id, job)

    def _finish(self, job_id: JobId, job: _PendingJob) -> None:
        del self._jobs[job_id]
        self._usage_moved = True
        success = job.failed == 0
        for req_id in job.req_ids:
            if (state := self._requests.get(req_id)) is not None:
                state.jobs.discard(job_id)
        if job.kind is JobKind.LOAD:
            self.manager.complete_load(job.keys, success)
            if not success:
                self._stats.failed_load_tokens += job.blocks * self.offload_tokens
        elif job.kind is JobKind.STORE:
            self.manager.complete_store(job.keys, success)
        else:
            self.manager.complete_transfer(job.transfer_id, success)
            timed = self._promotions.pop(job_id, None)
            if timed is not None and success:
                medium, nbytes, started = timed
                self.load_cost.observe_transfer(medium, nbytes, self._clock() - started)

    # ---- request end, resets, observability -------------------------------------------------------------------

    def request_finished(self, req_id: str) -> None:
        """The request is done (finished or aborted): its blocks may be reused once its pending jobs are flushed."""
        self._fence(req_id)
        self._offer_from.pop(req_id, None)
        if (state := self._requests.pop(req_id, None)) is not None:
            self._generation += 1
            if self._trace is not None:
                self._trace.finished(state)

    def _fence(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is not None:
            self._to_flush |= state.jobs
            state.jobs = set()

    def take_events(self) -> list[OffloadEvent]:
        return self.manager.take_events()

    def reset(self) -> bool:
        self.manager.reset()
        self._usage_moved = True
        return True

    def take_usage_moved(self) -> bool:
        """Whether the tiers' usage may have changed since the last call (a decode step without jobs: no)."""
        moved, self._usage_moved = self._usage_moved, False
        return moved

    def has_stats(self) -> bool:
        """Whether ``take_stats`` would return anything counted (asked every step: allocates nothing)."""
        return self.load_cost.skipped_blocks != self._skipped_reported or not self._stats.is_empty()

    def take_stats(self) -> SchedulerStats:
        """What was counted since the last call (the caller owns it)."""
        skipped = self.load_cost.skipped_blocks
        stats, self._stats = self._stats, SchedulerStats()
        stats.skipped_slow_tokens = (skipped - self._skipped_reported) * self.offload_tokens
        self._skipped_reported = skipped
        return stats

    def usage(self) -> list[TierUsage]:
        return self.manager.usage()

    @property
    def num_pending_jobs(self) -> int:
        return len(self._jobs)

    def _state(self, request: EngineRequest) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(request, self._root, self.offload_tokens, self.num_groups,
                                 arrival=self._clock(), prompt_tokens=len(request.all_token_ids))
            self._requests[request.request_id] = state
            self._generation += 1
        elif state.request is not request and state.request != request and not state.ambiguous:
            # Another live request with this id: its hashes (tokens, salt) are not this one's, and the engine's
            # schedule names requests by id alone, so neither's blocks can be told apart. Until the id is
            # finished, nothing is loaded into or stored from either of them.
            logger.warning("two live requests share the id %r; kvoffload skips both", request.request_id)
            state.ambiguous = True
            self._generation += 1
        return state

    def _new_job(self, kind: JobKind, req_ids: tuple[str, ...], keys: tuple[OffloadKey, ...],
                 transfer_id: int = -1, blocks: int = 0) -> JobId:
        job_id = JobId(next(self._job_ids))
        self._jobs[job_id] = _PendingJob(kind, req_ids, tuple(keys), transfer_id, blocks=blocks)
        return job_id


DECLINED = -1
"""``_offer_from`` mark of a request whose store admission declined a block: it stores no later block."""

NO_JOBS = ConnectorMetadata()
"""A step's metadata when it has no job (frozen: one instance serves every such step)."""


def _only(full: _FullBlocks, chosen: set[OffloadKey], factor: int) -> _FullBlocks:
    """The blocks of ``full`` whose keys are in ``chosen``, each once (in ``full``'s order)."""
    kept = _FullBlocks.empty(len(full.keys))
    for g, keys in enumerate(full.keys):
        for i, key in enumerate(keys):
            if key in chosen:
                chosen.discard(key)  # two requests may share a block: store it once
                kept.keys[g].append(key)
                kept.device_blocks[g] += full.device_blocks[g][i * factor:(i + 1) * factor]
                kept.owners[g].append(full.owners[g][i])
    return kept


def _add_blocks(state: RequestState, new: Sequence[Sequence[int]], resumed: bool) -> None:
    """The engine allocated ``new`` blocks per group to the request: all of them on its first schedule and when
    resumed after a preemption, else blocks appended to those it had."""
    if state.scheduled and not resumed:
        for ids, more in zip(state.block_ids, new, strict=True):
            ids.extend(more)
    else:
        state.block_ids = [list(ids) for ids in new]
        state.scheduled = True


def _regroup(spec: BlockSpec, group_sizes: tuple[int, ...]) -> BlockSpec:
    """A manager returns one flat group; the job needs the per-group split of the same entries."""
    return dataclasses.replace(spec, group_sizes=group_sizes)
