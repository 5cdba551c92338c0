"""What the scheduler half reads from the engine, and what it remembers per request.

The engine hands over requests through the small ``EngineRequest`` protocol and each step's schedule as a
``StepSchedule``; an engine adapter (``integrations/``) converts its own objects into these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from kvoffload.blocks import JobId
from kvoffload.config import TenantBy
from kvoffload.keys import BlockHash, OffloadKey, chain_hashes, frame_extra_keys, offload_key


class EngineRequest(Protocol):
    """An engine request, as the scheduler half sees it."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt and generated tokens so far; it grows, and the scheduler half re-reads it each step."""
        ...

    @property
    def extra_keys(self) -> Sequence[str]:
        """Anything besides tokens that changes the KV (LoRA name, cache salt, multimodal hashes)."""
        ...

    def tenant(self, by: TenantBy) -> str | None:
        """The request's tenant (docs/tenants.md): its cache salt (``by`` cache_salt) or LoRA adapter name
        (``by`` lora); None when it has none (the shared tenant) or ``by`` is none. Asked only with tenants on."""
        ...

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """What the client asked of KV connectors (vLLM's ``kv_transfer_params``): kvoffload reads its retention
        hint there (docs/sessions.md). Read once, when the request is first seen; None: nothing asked."""
        ...


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in this engine step (one row of a ``StepSchedule``, for ``StepSchedule.of``).

    ``new_block_ids[g]``: the engine blocks of group ``g`` appended this step; for the first schedule of a request
    (and when ``resumed`` after a preemption) all of its blocks. ``num_computed_tokens``: tokens whose KV is in the
    device cache once this step has run.
    """

    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    resumed: bool = False


class StepSchedule(NamedTuple):
    """The requests scheduled in one engine step, by columns: entry ``i`` of each column is request ``i``.

    Columns, not an object per request: a decode step of hundreds of requests costs the scheduler half a few
    C-level passes over them (``ConnectorScheduler.build_connector_meta``), and an engine adapter passes the
    engine's own lists as they are. ``new_block_ids[i]``: request ``i``'s new blocks per group (see
    ``ScheduledRequest``), or None (or empty) when it got none. ``computed_tokens[i] + computed_offset``: its
    tokens whose KV is in the device cache once the step has run; the offset is 0 or 1 (1: the engine's own count
    from before a decode step in which every request computes one token, passed without a copy). ``resumed``:
    requests scheduled again after a preemption (their ``new_block_ids`` are all of their blocks).
    """

    req_ids: Sequence[str]
    new_block_ids: Sequence[Sequence[Sequence[int]] | None]
    computed_tokens: Sequence[int]
    computed_offset: int = 0
    resumed: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()

    @classmethod
    def of(cls, scheduled: Sequence[ScheduledRequest] = (),
           preempted_req_ids: frozenset[str] = frozenset()) -> StepSchedule:
        """The columns of ``scheduled`` (a request whose every group got no block has None)."""
        return cls([r.req_id for r in scheduled],
                   [r.new_block_ids if any(r.new_block_ids) else None for r in scheduled],
                   [r.num_computed_tokens for r in scheduled], 0,
                   frozenset(r.req_id for r in scheduled if r.resumed), preempted_req_ids)

    def computed_after(self) -> list[int]:
        """Each request's tokens computed once the step has run."""
        return [n + self.computed_offset for n in self.computed_tokens]

    def check(self) -> None:
        """Raises ValueError when the columns differ in length or the offset is not 0 or 1."""
        n = len(self.req_ids)
        if len(self.new_block_ids) != n or len(self.computed_tokens) != n or self.computed_offset not in (0, 1):
            raise ValueError(f"StepSchedule: columns of {n} ids, {len(self.new_block_ids)} block lists and "
                             f"{len(self.computed_tokens)} computed counts, offset {self.computed_offset}")


@dataclass(frozen=True)
class PlannedLoad:
    """A hit found by ``get_num_new_matched_tokens``: offload blocks ``[first, end)`` and their keys, group 0's
    first, a state group's being only block ``end - 1`` (kept so the load does not hash them again). The engine
    held ``computed`` tokens; the hit supplies them up to token ``stop``: ``end`` blocks' tokens, or one token
    fewer when the run's last block holds the prompt's last token (the engine computes that one)."""

    first: int
    end: int
    keys: tuple[OffloadKey, ...]
    computed: int
    stop: int


@dataclass
class RequestState:
    """The scheduler half's memory of one request."""

    request: EngineRequest
    root: bytes
    offload_tokens: int
    num_groups: int
    block_ids: list[list[int]] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    scheduled: bool = False
    next_store_block: int = 0
    """Offload blocks before this one are stored, loaded, or were skipped."""
    store_limit: int | None = None
    """No block past this many tokens is stored (``ConnectorScheduler.limit_stores``)."""
    planned_load: PlannedLoad | None = None
    query_tokens: int | None = None
    """Tokens asked for by the last lookup, until counted in the stats (once per lookup)."""
    jobs: set[JobId] = field(default_factory=set)
    """Jobs in flight that read or write this request's device blocks."""
    ambiguous: bool = False
    """Another live request had the same id: no loads or stores for this id until it is finished."""
    arrival: float = 0.0
    """Scheduler clock when the request was first seen (for ``record_trace``)."""
    prompt_tokens: int = 0
    """Tokens the request had when first seen: its prompt."""
    retain_s: float | None = None
    """How long the request's blocks are to be kept (its retention hint, capped); None: no hint."""
    held_at: float | None = None
    """When its prompt's blocks were held (at its first lookup; the retention book's clock); None: not yet."""
    _framed_extra: bytes | None = None
    _keys: list[list[OffloadKey]] = field(default_factory=list)

    def block_hashes(self, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` offload blocks (computed once, as tokens arrive)."""
        hashes = self.hashes
        if len(hashes) < num_blocks:
            if self._framed_extra is None:  # an engine request's extra keys are fixed for its life
                self._framed_extra = frame_extra_keys(tuple(self.request.extra_keys))
            n = self.offload_tokens
            tokens = self.request.all_token_ids[len(hashes) * n:num_blocks * n]
            hashes.extend(chain_hashes(hashes[-1] if hashes else self.root, tokens, n, self._framed_extra))
        return hashes[:num_blocks]

    def keys(self, first: int, end: int, group: int) -> list[OffloadKey]:
        """Group ``group``'s keys of offload blocks ``[first, end)`` (derived once per block and group)."""
        while len(self._keys) <= group:
            self._keys.append([])
        keys = self._keys[group]
        if len(keys) < end:
            keys.extend(offload_key(h, group) for h in self.block_hashes(end)[len(keys):end])
        return keys[first:end]

    def full_blocks(self, num_tokens: int) -> int:
        """Offload blocks that ``num_tokens`` computed tokens fill, within the tokens known and the store limit."""
        limit = len(self.request.all_token_ids) if self.store_limit is None else self.store_limit
        return min(num_tokens, limit, len(self.request.all_token_ids)) // self.offload_tokens

    def store_threshold(self) -> int:
        """Computed tokens at which the next offload block to store is full; ``NEVER`` when none will be."""
        tokens = (self.next_store_block + 1) * self.offload_tokens
        if self.ambiguous or (self.store_limit is not None and tokens > self.store_limit):
            return NEVER
        return tokens


NEVER = 1 << 62
"""A store threshold no token count reaches."""
