"""The scheduler half's load side: how many prefix tokens kvoffload can supply, and the load job for them.

``ConnectorScheduler.get_num_new_matched_tokens`` asks ``LoadPlanner.lookup`` how many leading offload blocks of a
new request are ready in every KV-cache group (the index's lookups) and keeps the hit as the request's
``PlannedLoad``; ``update_state_after_alloc`` asks ``LoadPlanner.start`` to pin those blocks and open a load job
(in ``jobs.py``) for the device blocks the engine allocated. The step's ``ConnectorMetadata`` takes the new load
jobs (``take_new_loads``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.blocks import NO_BLOCK, BlockSpec, DeviceBlocks, HostBlocks, TransferJob
from kvoffload.connector.announce import Announcer
from kvoffload.connector.jobs import JobBook, JobKind, regroup
from kvoffload.connector.metadata import LoadJob
from kvoffload.connector.requests import EngineRequest, PlannedLoad, RequestState
from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.stores import StoreAdmitter
from kvoffload.connector.tenants import SchedulerTenants
from kvoffload.index.base import BlockIndex
from kvoffload.keys import OffloadKey


class LoadPlanner:
    """Finds each new request's hit and starts its load. Not thread-safe: the engine's scheduler calls it from one
    thread."""

    def __init__(self, index: BlockIndex, jobs: JobBook, admission: StoreAdmitter, stats: SchedulerStats,
                 factor: int, engine_block_size: int, num_groups: int, state_groups: frozenset[int],
                 null_block_id: int | None, announcer: Announcer | None = None,
                 tenants: SchedulerTenants | None = None) -> None:
        """``announcer``: describes the blocks a lookup hits, for the router events (None: the engine publishes
        none). ``tenants``: counts each tenant's prompt and hit tokens (None: tenants off)."""
        self._tenants = tenants
        self._index = index
        self._announcer = announcer
        self._jobs = jobs
        self._admission = admission
        self._stats = stats
        self._factor = factor
        self._engine_block_size = engine_block_size
        self._offload_tokens = factor * engine_block_size
        self._num_groups = num_groups
        self._state_groups = state_groups
        self.null_block_id = null_block_id
        """The engine's placeholder block: a load leaves a hole (``NO_BLOCK``) where it stands."""
        self.new_loads: list[LoadJob] = []
        """Load jobs started since the last ``take_new_loads``."""

    def take_new_loads(self) -> list[LoadJob]:
        """The load jobs started since the last call (the caller owns the list)."""
        loads, self.new_loads = self.new_loads, []
        return loads

    def lookup(self, request: EngineRequest, state: RequestState, num_computed_tokens: int
               ) -> tuple[int | None, bool]:
        """Tokens kvoffload can load beyond the ``num_computed_tokens`` the engine already holds of ``request``
        (whose state is ``state``); a hit is kept in ``state.planned_load``. Returns what
        ``ConnectorScheduler.get_num_new_matched_tokens`` does."""
        state.planned_load = None
        self._admission.reused(request.request_id, num_computed_tokens // self._offload_tokens)
        num_tokens = len(request.all_token_ids)
        state.query_tokens = max(0, num_tokens - num_computed_tokens)
        if state.ambiguous:
            return 0, False
        end = self._loadable_blocks(num_tokens)
        self._admission.looked_up(state, end)
        first = num_computed_tokens // self._offload_tokens
        if first >= end:
            return 0, False
        hits, pending = end - first, False
        group_keys: dict[int, list[OffloadKey]] = {}
        for group in range(self._num_groups):
            if group in self._state_groups:
                continue
            keys = state.keys(first, first + hits, group)
            group_keys[group] = keys
            result = self._index.lookup(keys)
            if result.hits < hits:
                # The group with the shortest run decides, and whether its next block is on its way.
                hits, pending = result.hits, result.pending
        if self._announcer is not None and (hits or pending):
            # A hit or a promotion: their blocks may be announced on another tier soon (a promotion to the host,
            # another engine's block in a shared tier), and only now is the request at hand to describe them.
            end_described = end if pending else first + hits
            for group in range(self._num_groups):
                self._announcer.describe_run(state, state.keys(first, end_described, group), first, group)
        if pending:
            return None, False
        if self._state_groups:
            hits = self._state_hit(state, first, hits)
        # The engine computes the last prompt token itself, to sample from its logits: the hit stops before it.
        stop = min((first + hits) * self._offload_tokens, num_tokens - 1)
        hit_tokens = stop - num_computed_tokens
        if hits == 0 or hit_tokens <= 0:
            return 0, False
        planned_keys = tuple(k for g in range(self._num_groups)
                             for k in (state.keys(first + hits - 1, first + hits, g) if g in self._state_groups
                                       else group_keys[g][:hits]))
        state.planned_load = PlannedLoad(first, first + hits, planned_keys, num_computed_tokens, stop)
        return hit_tokens, True

    def _loadable_blocks(self, num_tokens: int) -> int:
        """How many leading offload blocks of a ``num_tokens``-token prompt a hit may load.

        Every block the prompt fills, the one holding its last token included: the hit then ends at
        ``num_tokens - 1``, and vLLM allocates the engine blocks of the computed and external tokens and passes
        them to ``update_state_after_alloc``. That covers every engine block of the last offload block, whatever
        the offload factor, as token ``num_tokens - 2`` lies in its last engine block whenever an engine block
        holds more than one token (with one-token blocks, ``_device_side`` leaves the unallocated one a hole).
        The load writes the block whole; the engine then computes the last token and writes its KV over the
        loaded copy of the same values. vLLM's own offloading connector loads the same blocks. An offload block
        the prompt does not fill is in no hit (only full blocks are stored).

        Not with state groups (Mamba-style layers): a state block is the state after all of its tokens, so
        loading the last one would give the engine the state after the last token, which it would then compute
        again on top of it (that token counted twice). One hit counts for every group, so such a model's hit stops
        before the block holding the last token, in every group, as vLLM's own connector stops at its state
        alignment; the engine computes that block's tokens.
        """
        if self._state_groups:
            return (num_tokens - 1) // self._offload_tokens
        return num_tokens // self._offload_tokens

    def _state_hit(self, state: RequestState, first: int, hits: int) -> int:
        """The longest run, at most ``hits`` blocks from ``first``, whose last block every state group holds.

        A state block is the state after its tokens, so a state group needs only the block where the loaded run
        ends (as vLLM's own prefix cache does: it keeps states only where a prefill chunk ended).
        """
        while hits > 0:
            keys = [state.keys(first + hits - 1, first + hits, g)[0] for g in sorted(self._state_groups)]
            if self._index.lookup(keys).hits == len(keys):
                return hits
            hits -= 1
        return 0

    def start(self, state: RequestState, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """The engine allocated ``block_ids`` (all of the request's blocks, per group): start the planned load.

        Counts the last lookup in the stats once, even when the engine calls this again without a new lookup.
        """
        state.block_ids = [list(ids) for ids in block_ids]
        plan, state.planned_load = state.planned_load, None
        loads = num_external_tokens > 0 and plan is not None
        if state.query_tokens is not None:  # engines may call this again without a new lookup
            self._stats.requests += 1
            self._stats.query_tokens += state.query_tokens
            if self._tenants is not None:
                self._tenants.count_tokens(state.request, state.query_tokens, num_external_tokens if loads else 0)
            state.query_tokens = None
        if not loads or plan is None:
            return
        req_id = state.request.request_id
        stop = plan.computed + num_external_tokens
        end = self._accepted_end(req_id, plan, stop)
        ebs = self._engine_block_size
        skip = plan.computed // ebs - plan.first * self._factor
        flat_keys = plan.keys if end == plan.end else tuple(
            k for g in range(self._num_groups) for k in state.keys(plan.first, end, g))
        src = self._index.prepare_load(flat_keys)
        self._index.touch(flat_keys)
        n = end - plan.first
        # Written: the engine blocks holding tokens the engine now counts as computed (-(-a // b): a / b rounded up).
        dst = self._device_side(state, plan.computed // ebs, end * self._factor, -(-stop // ebs))
        job = self._jobs.new_job(JobKind.LOAD, (req_id,), flat_keys, tokens=num_external_tokens)
        self._admission.reused(req_id, end)
        src = self._load_source(src, n, skip)
        self.new_loads.append(LoadJob(req_id, TransferJob(job, src, dst)))
        state.jobs.add(job)
        self._stats.hit_tokens += num_external_tokens

    def _accepted_end(self, req_id: str, plan: PlannedLoad, stop: int) -> int:
        """Where the load ends, in offload blocks, when the engine took the hit up to token ``stop``.

        vLLM takes the hit as offered, or cut back to an engine block boundary (DeepSeek V4's bounded replay):
        the load then covers only the blocks that hold the tokens it took. A state block is the state after all
        of the run's tokens, so with state groups only the whole hit can be served.

        Raises:
            ValueError: the engine took more tokens than the hit offered, or part of a hit with state groups.
        """
        if stop > plan.stop or (self._state_groups and stop != plan.stop):
            raise ValueError(f"request {req_id!r}: the engine took {stop - plan.computed} external tokens of a "
                             f"hit of {plan.stop - plan.computed}")
        return -(-stop // self._offload_tokens)

    def _device_side(self, state: RequestState, first_engine_block: int, last_engine_block: int,
                     written_end: int) -> DeviceBlocks:
        """The device blocks ``[first_engine_block, last_engine_block)`` of every group that a load writes, with
        holes (``NO_BLOCK``) where nothing may be written: from ``written_end`` on (blocks holding no token the
        engine counts as loaded; with one-token engine blocks, the last token's is not even allocated), and where
        the engine's null block stands."""
        f = self._factor
        per_group = last_engine_block - first_engine_block
        written = min(written_end, last_engine_block)
        device_ids: list[int] = []
        for ids in state.block_ids:
            row = ids[first_engine_block:written]
            device_ids.extend(row)
            device_ids.extend([NO_BLOCK] * (per_group - len(row)))
        for g in self._state_groups:  # only the run's last block holds a state worth loading
            start = g * per_group
            device_ids[start:start + max(0, per_group - f)] = [NO_BLOCK] * max(0, per_group - f)
        if self.null_block_id in device_ids:  # a window group dropped these blocks: nothing may write the null block
            device_ids = [NO_BLOCK if b == self.null_block_id else b for b in device_ids]
        return DeviceBlocks(tuple(device_ids), (per_group,) * self._num_groups)

    def _load_source(self, src: BlockSpec, n: int, skip: int) -> BlockSpec:
        """The host side of a load of ``n`` offload blocks per group, from ``prepare_load``'s one entry per key.

        A state group has one key (its run's last block): it is repeated ``n`` times, so every group lists ``n``
        entries; the device side leaves holes where those repeats stand, so only the last one is copied.
        """
        if not self._state_groups and not skip:
            return regroup(src, (n,) * self._num_groups)
        if not isinstance(src, HostBlocks):
            raise TypeError(f"loads come from host slots, not {type(src).__name__}")
        slots: list[int] = []
        epochs: list[int] = []  # a node pool's: they follow their slots
        at = 0
        for g in range(self._num_groups):
            taken = 1 if g in self._state_groups else n
            repeat = n if g in self._state_groups else 1
            slots.extend(src.slots[at:at + taken] * repeat)
            epochs.extend(src.epochs[at:at + taken] * repeat)
            at += taken
        return HostBlocks(tuple(slots), (n,) * self._num_groups, skip_sub_blocks=skip, epochs=tuple(epochs))
