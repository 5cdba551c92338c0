"""The scheduler half's store side: each step's scan for offload blocks that became full, and store admission.

``ConnectorScheduler.build_connector_meta`` passes the step's schedule (``StepSchedule``, columns) to
``StoreScan.collect``, which tracks the requests' new device blocks and returns their offload blocks that became full
(``FullBlocks``); ``StoreScan.store_job`` turns them into the step's one store job (the index skips blocks it holds
and evicts through its policy), opened in the job book (``jobs.py``). With tenants on, each key is assigned to its
request's tenant just before the store is prepared (``SchedulerTenants``; connector/tenants.py).

Store admission (``config.store_admission``, index/admission.py) sees each block a request computes once, when
it becomes full: the rule says how many leading ones of the step's new full blocks to store, and the request stores
none after one it declined (a block is useless without its parent). Blocks the request found cached (device prefix
cache or a kvoffload load, ``StoreAdmitter.reused``) are reuses, stored without asking (the index skips those it
holds).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload import _stepscan
from kvoffload.blocks import DeviceBlocks, TransferJob
from kvoffload.connector.announce import Announcer
from kvoffload.connector.jobs import JobBook, JobKind, regroup
from kvoffload.connector.requests import NEVER, RequestState, StepSchedule
from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.tenants import SchedulerTenants
from kvoffload.index.admission import Admission, AdmitAll
from kvoffload.index.base import BlockIndex
from kvoffload.keys import OffloadKey

logger = logging.getLogger(__name__)

DECLINED = -1
"""``StoreAdmitter`` mark of a request whose store admission declined a block: it stores no later block."""


@dataclass
class FullBlocks:
    """Offload blocks that became full this step, by group: their keys, their device blocks (``factor`` per key),
    the request of each key and its place there (offload block index); the step's store job is made of them."""

    keys: list[list[OffloadKey]]
    device_blocks: list[list[int]]
    owners: list[list[RequestState]]
    blocks: list[list[int]]

    @classmethod
    def empty(cls, num_groups: int) -> FullBlocks:
        return cls([[] for _ in range(num_groups)], [[] for _ in range(num_groups)], [[] for _ in range(num_groups)],
                   [[] for _ in range(num_groups)])

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


class StoreAdmitter:
    """Which of a request's new full blocks are stored, by the configured rule; counts them in ``stats``."""

    def __init__(self, rule: Admission, stats: SchedulerStats) -> None:
        self.rule = rule
        self._admit_all = isinstance(rule, AdmitAll)
        self._stats = stats
        self._watched: set[str] = set()
        """Requests whose prompt the rule has seen (``looked_up``): it sees each once."""
        self._offer_from: dict[str, int] = {}
        """Per request, the first offload block it computed itself (the ones before are reuses), or ``DECLINED``
        once admission declined one of its blocks; kept only when admission is not ``all``."""

    def reused(self, req_id: str, blocks: int) -> None:
        """The request found its first ``blocks`` offload blocks cached: admission is not asked about them."""
        if not self._admit_all:
            mark = self._offer_from.get(req_id, 0)
            if mark != DECLINED and blocks > mark:
                self._offer_from[req_id] = blocks

    def looked_up(self, state: RequestState, end: int) -> None:
        """The request's first ``end`` offload blocks are being looked up: a rule that learns from lookups sees
        their keys, the first time only (a request may be looked up again, step after step)."""
        if not self.rule.watches_lookups:
            return
        req_id = state.request.request_id
        if req_id not in self._watched:
            self._watched.add(req_id)
            self.rule.looked_up(state.keys(0, end, 0))

    def forget(self, req_id: str) -> None:
        """The request is finished."""
        self._offer_from.pop(req_id, None)
        self._watched.discard(req_id)

    def admitted_end(self, state: RequestState, first: int, end: int) -> int:
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
        admitted = self.rule.admit(offered)
        if mark == DECLINED:
            stats.declined_blocks += len(offered)
            return first
        stats.admitted_blocks += admitted
        stats.declined_blocks += len(offered) - admitted
        if admitted < len(offered):
            self._offer_from[req_id] = DECLINED
        return start + admitted


class StoreScan:
    """Finds, each step, the scheduled requests' offload blocks that became full, and makes the step's store job.

    ``requests`` is the scheduler's live map of request states (shared, not copied); ``collect``'s ``generation``
    says whether it may have changed since the last step. Not thread-safe: the engine's scheduler calls it from one
    thread.
    """

    def __init__(self, index: BlockIndex, requests: dict[str, RequestState], jobs: JobBook,
                 admission: StoreAdmitter, factor: int, num_groups: int, null_block_id: int | None,
                 announcer: Announcer | None = None, tenants: SchedulerTenants | None = None) -> None:
        """``announcer``: describes each block stored, for the router events (None: the engine publishes none).
        ``tenants``: whose the stored keys are, told to the host tier's book before each store (None: tenants
        off)."""
        self._index = index
        self._tenants = tenants
        self._announcer = announcer
        self._requests = requests
        self._jobs = jobs
        self._admission = admission
        self._factor = factor
        self._num_groups = num_groups
        self.null_block_id = null_block_id
        """The engine's placeholder block: offload blocks that contain it are not stored."""
        self._columns: _Columns | None = None

    def collect(self, step: StepSchedule, generation: int) -> FullBlocks | None:
        """Track the scheduled requests' new blocks; their offload blocks that became full (None: none did).

        ``generation`` changes whenever a request state came, went, or changed its store threshold outside a step.

        Hot: every step, every running request. Python runs per request only for a request that got new blocks
        or whose computed tokens reached its store threshold (the next offload block is full); finding those (and
        checking the columns) is one pass in C (``kvoffload._stepscan``): two ``compress`` passes in Python, and
        numpy before them, cost more, each finding its code and data cold after the engine's own work. Most
        decode steps of most requests are neither.
        """
        states, partial = self._columns_of(step.req_ids, generation)
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
            full = full or FullBlocks.empty(self._num_groups)
            self._full_blocks(state, computed[i] + step.computed_offset, full)
            partial[i] = state.store_threshold() - 1
        return full

    def _columns_of(self, req_ids: Sequence[str], generation: int
                    ) -> tuple[list[RequestState | None], array[int]]:
        """The states of ``req_ids`` and, aligned with them, the most computed tokens at which each one's next
        offload block is still partial (its store threshold less one).

        Kept from the last step while the engine schedules the same requests in the same order and no request
        state came or went (a decode step): then it costs one list comparison.
        """
        cached = self._columns
        if cached is not None and cached.generation == generation and cached.req_ids == req_ids:
            return cached.states, cached.partial
        states = [self._requests.get(r) for r in req_ids]
        for i, state in enumerate(states):
            if state is None or state.ambiguous:
                logger.debug("scheduled request %s was never looked up or shares its id; not storing it",
                             req_ids[i])
                states[i] = None
        partial = array("q", [(NEVER if s is None else s.store_threshold()) - 1 for s in states])
        self._columns = _Columns(list(req_ids), states, partial, generation)
        return states, partial

    def _full_blocks(self, state: RequestState, computed: int, out: FullBlocks) -> None:
        """Add the request's offload blocks that ``computed`` tokens fill and that are not yet stored to ``out``."""
        first = state.next_store_block
        end = state.full_blocks(computed)
        if end <= first:
            return
        state.next_store_block = end
        end = self._admission.admitted_end(state, first, end)
        if end <= first:
            return
        f, null = self._factor, self.null_block_id
        for g in range(self._num_groups):
            keys = state.keys(first, end, g)
            device = state.block_ids[g][first * f:end * f]
            blocks: Sequence[int] = range(first, end)
            if null in device:  # a window group dropped some: those blocks are not stored
                kept = [i for i in range(len(keys)) if null not in device[i * f:(i + 1) * f]]
                keys = [keys[i] for i in kept]
                device = [b for i in kept for b in device[i * f:(i + 1) * f]]
                blocks = [first + i for i in kept]
            out.keys[g] += keys
            out.device_blocks[g] += device
            out.owners[g] += [state] * len(keys)
            out.blocks[g] += blocks

    def store_job(self, full: FullBlocks) -> TransferJob | None:
        """One store job per step for every request's new full blocks: one submit, one copy plan (None: nothing
        to store, or the index has no room)."""
        keys = [k for group in full.keys for k in group]  # specs list group 0's blocks first
        if not keys:
            return None
        if self._tenants is None:
            out = self._index.prepare_store(keys)
        else:
            self._tenants.assign(full.keys, full.owners)
            try:
                out = self._index.prepare_store(keys)
            finally:
                self._tenants.book.clear()
        if out is None or not out.keys_to_store:
            return None
        if len(out.keys_to_store) < len(keys):  # some are stored already, or two requests share a block
            full = _only(full, set(out.keys_to_store), self._factor)
        group_sizes = tuple(len(group) for group in full.keys)
        src = DeviceBlocks(tuple(b for group in full.device_blocks for b in group),
                           tuple(n * self._factor for n in group_sizes))
        if self._announcer is not None:
            self._describe(full)
        owners = {id(st): st for group in full.owners for st in group}
        job = self._jobs.new_job(JobKind.STORE, tuple(st.request.request_id for st in owners.values()),
                                 out.keys_to_store)
        for state in owners.values():
            state.jobs.add(job)
        return TransferJob(job, src, regroup(out.store_spec, group_sizes))


    def _describe(self, full: FullBlocks) -> None:
        """Describe the blocks about to be stored (the announcer keeps each until its store event)."""
        describe = self._announcer.describe_block  # type: ignore[union-attr]
        for g, keys in enumerate(full.keys):
            for key, owner, block in zip(keys, full.owners[g], full.blocks[g], strict=True):
                describe(owner, key, block, g)


def _only(full: FullBlocks, chosen: set[OffloadKey], factor: int) -> FullBlocks:
    """The blocks of ``full`` whose keys are in ``chosen``, each once (in ``full``'s order)."""
    kept = FullBlocks.empty(len(full.keys))
    for g, keys in enumerate(full.keys):
        for i, key in enumerate(keys):
            if key in chosen:
                chosen.discard(key)  # two requests may share a block: store it once
                kept.keys[g].append(key)
                kept.device_blocks[g] += full.device_blocks[g][i * factor:(i + 1) * factor]
                kept.owners[g].append(full.owners[g][i])
                kept.blocks[g].append(full.blocks[g][i])
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
