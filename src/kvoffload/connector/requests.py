"""What the scheduler half reads from the engine, and what it remembers per request.

The engine hands over requests through the small ``EngineRequest`` protocol and each step's schedule as a
``StepSchedule``; an engine adapter (``integrations/``) converts its own objects into these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.keys import BlockHash, OffloadKey, hash_block, offload_key
from kvoffload.specs import JobId


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


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in this engine step.

    ``new_block_ids[g]``: the engine blocks of group ``g`` appended this step; for the first schedule of a request
    (and when ``resumed`` after a preemption) all of its blocks. ``num_computed_tokens``: tokens whose KV is in the
    device cache once this step has run.
    """

    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    resumed: bool = False


@dataclass(frozen=True)
class StepSchedule:
    scheduled: tuple[ScheduledRequest, ...]
    preempted_req_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PlannedLoad:
    """A hit found by ``get_num_new_matched_tokens``: offload blocks ``[first, end)`` and their keys, group 0's
    first, a state group's being only block ``end - 1`` (kept so the load does not hash them again)."""

    first: int
    end: int
    keys: tuple[OffloadKey, ...]


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
    planned_load: PlannedLoad | None = None
    query_tokens: int | None = None
    """Tokens asked for by the last lookup, until counted in the stats (once per lookup)."""
    jobs: set[JobId] = field(default_factory=set)
    """Jobs in flight that read or write this request's device blocks."""
    ambiguous: bool = False
    """Another live request had the same id: no loads or stores for this id until it is finished."""

    def block_hashes(self, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` offload blocks (computed once, as tokens arrive)."""
        tokens = self.request.all_token_ids
        extra = tuple(self.request.extra_keys)
        n = self.offload_tokens
        while len(self.hashes) < num_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes.append(hash_block(parent, tokens[i * n:(i + 1) * n], extra))
        return self.hashes[:num_blocks]

    def keys(self, first: int, end: int, group: int) -> list[OffloadKey]:
        return [offload_key(h, group) for h in self.block_hashes(end)[first:end]]

    def full_blocks(self, num_tokens: int) -> int:
        return min(num_tokens, len(self.request.all_token_ids)) // self.offload_tokens
