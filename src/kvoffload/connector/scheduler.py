"""The scheduler half: decides what to load and store each engine step. Never touches tensors.

Per step the engine asks it, for each new request, how many prefix tokens kvoffload can supply
(``get_num_new_matched_tokens``), tells it which device blocks it allocated (``update_state_after_alloc``: this
creates a load job), then asks for the step's ``ConnectorMetadata`` (``build_connector_meta``: stores for every block
that becomes full this step, background tier jobs, fences). Workers report finished jobs back
(``update_connector_output``); a job is done once every worker reported it, and failed if any worker failed it.

``ConnectorScheduler`` is the facade the engine adapter and the simulated engine call. It keeps the request states
and the step's assembly, and delegates by concern: load planning to ``loads.py``, the per-step scan for full
blocks and store admission to ``stores.py``, job ids, fences and completion to ``jobs.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvoffload.blocks import Medium
from kvoffload.config import OffloadConfig
from kvoffload.connector.announce import Announcement, Announcer, Describe
from kvoffload.connector.jobs import JobBook
from kvoffload.connector.load_cost import LoadCost
from kvoffload.connector.loads import LoadPlanner
from kvoffload.connector.metadata import ConnectorMetadata, WorkerReport
from kvoffload.connector.recording import TraceTap
from kvoffload.connector.requests import EngineRequest, RequestState, StepSchedule
from kvoffload.connector.retention import make_retention
from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.stores import StoreAdmitter, StoreScan
from kvoffload.connector.tenants import make_tenants
from kvoffload.index.admission import make_admission
from kvoffload.index.base import NO_STORE_COUNTS, BlockIndex, OffloadEvent, TierUsage
from kvoffload.index.retention import RetentionBook
from kvoffload.index.tenants import TenantBook, TenantPolicy
from kvoffload.index.tier_policies import retention_book_of
from kvoffload.keys import Namespace
from kvoffload.layout import KVCacheLayout
from kvoffload.tiers.sizing import host_slot_bytes, offload_factor
from kvoffload.tiers.spec import TierContext
from kvoffload.tiers.stack import build_index

logger = logging.getLogger(__name__)


class ConnectorScheduler:
    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, engine_block_size: int,
                 namespace: Namespace, index: BlockIndex | None = None,
                 null_block_id: int | None = None, flush_stores_next_step: bool = False,
                 clock: Callable[[], float] = time.monotonic, describe: Describe | None = None) -> None:
        """``null_block_id``: the engine's placeholder block (vLLM's block 0 stands in for blocks a sliding-window
        group has dropped); offload blocks that contain it are never stored, and loads leave a hole (``NO_BLOCK``)
        where it stands, so they never write it.

        ``flush_stores_next_step``: the engine may reuse or rewrite a block of a running request in the very
        next step (a sliding-window block that left the window, a Mamba state updated in place), so every store
        is flushed at the start of the next step, before the forward pass, instead of running beside it.

        ``clock``: monotonic seconds, for the timings behind cost-aware loading (tests drive a fake one).

        ``describe``: the engine describes its blocks for KV-aware routers (``connector.announce``); then
        ``take_announcements`` says what the tiers hold in the engine's own terms. None: the engine publishes no KV
        events, and nothing is described.
        """
        self.factor = offload_factor(config, engine_block_size)
        self.engine_block_size = engine_block_size
        self.offload_tokens = self.factor * engine_block_size
        self.num_groups = len(layout.groups)
        self.state_groups = frozenset(layout.state_groups)
        book = TenantBook.of_config(config.tenants) if config.tenants is not None else None
        held = RetentionBook(config.retention.share) if config.retention is not None else None
        self.index = index or build_index(config, TierContext(namespace, layout, self.factor, book, held))
        if index is not None:
            book, held = _book_of(index), retention_book_of(index.host_policy)
        self.tenants = make_tenants(config.tenants, book, host_slot_bytes(layout, self.factor))
        """With tenants on, whose blocks are and each tenant's figures (None: tenants off)."""
        self.retention = make_retention(config.retention, held, host_slot_bytes(layout, self.factor))
        """With hints on, each request's hint and the keys it holds (None: hints off)."""
        self.flush_stores_next_step = flush_stores_next_step
        self.load_cost = LoadCost(config.load_policy, self.offload_tokens, host_slot_bytes(layout, self.factor),
                                  config.prefill_tokens_per_s)
        self.index.set_load_cost(self.load_cost)
        self._clock = clock
        self._skipped_reported = 0
        self._store_reported = NO_STORE_COUNTS
        self._last_meta: tuple[float, int] | None = None
        self._root = namespace.chain_root()
        self._requests: dict[str, RequestState] = {}
        self._stats = SchedulerStats()
        """Counted into by the parts below too: reset in place (``take``), never replaced."""
        self._generation = 0
        """Bumped whenever a request state comes, goes, or changes its store threshold outside a step."""
        self._usage_moved = True
        """An index call that may change tier usage ran since ``take_usage_moved`` (stats skip it otherwise)."""
        self._trace = None if config.record_trace is None else TraceTap(config.record_trace, self.offload_tokens,
                                                                         clock)
        usage = self.index.usage()
        host = next(u for u in usage if u.medium == Medium.HOST)
        self.admission = make_admission(config.store_admission, host.capacity_blocks, self.index.host_policy)
        self.announcer = None if describe is None else Announcer(describe, self.index,
                                                                 max_blocks=sum(u.capacity_blocks for u in usage))
        self._jobs = JobBook(self.index, self._requests, self._stats, self.load_cost, namespace.world_size, clock)
        self._admitter = StoreAdmitter(self.admission, self._stats)
        self._loads = LoadPlanner(self.index, self._jobs, self._admitter, self._stats, self.factor,
                                  engine_block_size, self.num_groups, self.state_groups, null_block_id,
                                  self.announcer, self.tenants)
        self._stores = StoreScan(self.index, self._requests, self._jobs, self._admitter, self.factor,
                                 self.num_groups, null_block_id, self.announcer, self.tenants)

    @property
    def null_block_id(self) -> int | None:
        return self._stores.null_block_id

    @null_block_id.setter
    def null_block_id(self, block_id: int | None) -> None:
        self._loads.null_block_id = self._stores.null_block_id = block_id

    @property
    def world_size(self) -> int:
        """Workers that report each job (a job is done once all of them reported it)."""
        return self._jobs.world_size

    @world_size.setter
    def world_size(self, n: int) -> None:
        self._jobs.world_size = n

    # ---- load path -------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens kvoffload can load beyond the ``num_computed_tokens`` the engine already holds.

        Returns ``(tokens, True)`` for a hit (whole offload blocks; the load is asynchronous), ``(0, False)`` for a
        miss, and ``(None, False)`` when the next block is still being stored or promoted: ask again next step.
        """
        state = self._state(request)
        self._usage_moved = True  # a lookup may reserve host room for a promotion
        if state.retain_s is not None and state.held_at is None and self.retention is not None \
                and not state.ambiguous:
            # Before the lookup: a block an earlier turn left is then kept from this turn on, a new one as stored.
            self.retention.hold_prompt(state, state.prompt_tokens // self.offload_tokens, range(self.num_groups))
        return self._loads.lookup(request, state, num_computed_tokens)

    def may_hit(self, request: EngineRequest) -> bool:
        """Whether a lookup of ``request`` now would find (or wait for) its first offload block in every group that
        loads by runs: then ``get_num_new_matched_tokens`` will most likely answer with an asynchronous load.

        Cheap (one block hashed, once per request; one key per group looked up), for engines that sort waiting
        requests by whether they will load (vLLM's ``may_load_async``). A lookup may start the block's promotion
        from a lower tier, as the lookup that follows would.
        """
        state = self._state(request)
        if state.ambiguous or len(request.all_token_ids) <= self.offload_tokens:
            return False  # no full block before the last token, which the engine computes itself
        groups = [g for g in range(self.num_groups) if g not in self.state_groups] or [0]
        for group in groups:
            result = self.index.lookup(state.keys(0, 1, group))
            if result.hits == 0 and not result.pending:
                return False
        return True

    def update_state_after_alloc(self, request: EngineRequest, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """The engine allocated ``block_ids`` (all of the request's blocks, per group): start the planned load."""
        self._loads.start(self._state(request), block_ids, num_external_tokens)

    # ---- each step -------------------------------------------------------------------------------------------

    def build_connector_meta(self, step: StepSchedule) -> ConnectorMetadata:
        jobs = self._jobs
        if self.tenants is not None and self.tenants.poll():  # the quota file changed: new shares from now on
            self._usage_moved = True
        for req_id in step.preempted_req_ids:
            if (state := self._requests.get(req_id)) is not None:
                jobs.fence(state)
                state.block_ids = []
                state.scheduled = False
        full = self._stores.collect(step, self._generation)
        filled = 0 if full is None else full.count()
        self._observe_step(filled)
        store = None
        if full is not None and filled:
            self._usage_moved = True
            store = self._stores.store_job(full)
        if store is not None and self.flush_stores_next_step:
            jobs.to_flush_next.add(store.job_id)
        transfers = self.index.take_transfers()
        tier_jobs = [jobs.tier_job(t) for t in transfers] if transfers else []
        if not (store or tier_jobs or self._loads.new_loads or jobs.to_flush or jobs.to_flush_next):
            return NO_JOBS  # most decode steps
        loads = self._loads.take_new_loads()
        flush = jobs.take_flush()
        return ConnectorMetadata(tuple(loads), (store,) if store else (), tuple(tier_jobs), frozenset(flush))

    def limit_stores(self, request: EngineRequest, tokens: int) -> None:
        """Store no block of ``request`` past its first ``tokens`` tokens (models whose states are kept only
        for the prompt: ``adapters.stores_prompt_blocks_only``)."""
        state = self._state(request)
        if state.store_limit != tokens:
            state.store_limit = tokens
            self._generation += 1

    def _observe_step(self, filled_blocks: int) -> None:
        """The engine's prefill speed, roughly: tokens whose blocks filled in the last step over its length (from
        one ``build_connector_meta`` to the next: that step's forward pass)."""
        now = self._clock()
        if self._last_meta is not None:
            started, blocks = self._last_meta
            self.load_cost.observe_step(blocks // self.num_groups * self.offload_tokens, now - started)
        self._last_meta = (now, filled_blocks)

    def update_connector_output(self, report: WorkerReport) -> None:
        """Count worker reports; finish a job once every worker has reported it."""
        if self._jobs.report(report):
            self._usage_moved = True

    # ---- request end, resets, observability -------------------------------------------------------------------

    def request_finished(self, req_id: str) -> None:
        """The request is done (finished or aborted): its blocks may be reused once its pending jobs are flushed."""
        if (state := self._requests.pop(req_id, None)) is not None:
            if state.retain_s is not None and self.retention is not None and not state.ambiguous:
                # The pause the hint covers starts now: every block of the request, its output's too.
                self.retention.hold_finished(state, state.prompt_tokens // self.offload_tokens,
                                             len(state.request.all_token_ids) // self.offload_tokens,
                                             range(self.num_groups))
            self._jobs.fence(state)
            self._generation += 1
            if self._trace is not None:
                self._trace.finished(state)
        self._admitter.forget(req_id)

    def take_events(self) -> list[OffloadEvent]:
        """The tiers' events since the last call (as keys; ``take_announcements`` describes them)."""
        return self.index.take_events()

    def take_announcements(self) -> list[Announcement]:
        """The tiers' events since the last call, described for a KV-aware router (empty without ``describe``,
        though the events are drained all the same)."""
        events = self.index.take_events()
        if self.announcer is None:
            return []
        return self.announcer.take(events)

    def reset(self) -> bool:
        self.index.reset()
        if self.announcer is not None:
            self.announcer.reset()
        self._usage_moved = True
        return True

    def take_usage_moved(self) -> bool:
        """Whether the tiers' usage may have changed since the last call (a decode step without jobs: no)."""
        moved, self._usage_moved = self._usage_moved, False
        return moved

    def has_stats(self) -> bool:
        """Whether ``take_stats`` would return anything counted (asked every step)."""
        counts = self.index.store_counts()  # the same instance every step without a shared store: no compare
        return (self.load_cost.skipped_blocks != self._skipped_reported or not self._stats.is_empty()
                or (counts is not self._store_reported and counts != self._store_reported))

    def take_stats(self) -> SchedulerStats:
        """What was counted since the last call (the caller owns it)."""
        skipped = self.load_cost.skipped_blocks
        stats = self._stats.take()
        stats.skipped_slow_tokens = (skipped - self._skipped_reported) * self.offload_tokens
        self._skipped_reported = skipped
        counts, reported = self.index.store_counts(), self._store_reported
        stats.unanswered_lookups = counts.unanswered_lookups - reported.unanswered_lookups
        stats.undeleted_blocks = counts.undeleted_blocks - reported.undeleted_blocks
        self._store_reported = counts
        if self.tenants is not None:
            stats.tenants = self.tenants.take_figures()
        if self.retention is not None:
            stats.retention = self.retention.take_figures()
        return stats

    def usage(self) -> list[TierUsage]:
        return self.index.usage()

    def pool_counters(self) -> dict[str, int]:
        """The shared pool's counters (``host_scope`` node), else empty."""
        return self.index.pool_counters()

    def pool_directory(self) -> str | None:
        """Where the shared pool lives (``host_scope`` node), else None."""
        return self.index.pool_directory()

    def close(self) -> None:
        """The engine stops: the tiers release what they hold outside this process, the trace is flushed."""
        self.index.close()
        if self.tenants is not None:
            self.tenants.close()
        if self._trace is not None:
            self._trace.close()

    @property
    def num_pending_jobs(self) -> int:
        return len(self._jobs)

    def _state(self, request: EngineRequest) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(request, self._root, self.offload_tokens, self.num_groups,
                                 arrival=self._clock(), prompt_tokens=len(request.all_token_ids),
                                 retain_s=None if self.retention is None else self.retention.retain_s(request))
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


NO_JOBS = ConnectorMetadata()
"""A step's metadata when it has no job (frozen: one instance serves every such step)."""


def _book_of(index: BlockIndex) -> TenantBook | None:
    """The tenants' book of an index built elsewhere (tests, tools): its host tier's, if it has one."""
    policy = index.host_policy
    return policy.book if isinstance(policy, TenantPolicy) else None
