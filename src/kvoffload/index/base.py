"""Scheduler-side residency: what each tier holds, and the interface every tier's index implements.

An index is not a data store: it never touches bytes (and imports no torch). The connector's scheduler
half asks it where blocks are, reserves room for new ones, and tells it when the worker half finished a copy.
Lifecycle of a block: ``prepare_store`` (in flight) -> ``complete_store(success)`` (ready, or forgotten) ->
``prepare_load`` (pinned, cannot be evicted) -> ``complete_load`` (unpinned). Eviction picks only ready, unpinned
blocks.

Managers are not thread-safe: the scheduler half calls them from one thread.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload.blocks import BlockSpec, Medium
from kvoffload.keys import OffloadKey

if TYPE_CHECKING:
    from kvoffload.index.policies.base import Policy


class IntegrityError(RuntimeError):
    """An index's bookkeeping broke one of its conservation laws (a bug, never an input error)."""


@dataclass(frozen=True)
class LookupResult:
    """How many leading keys can be loaded now, and whether the next one will be loadable soon.

    ``pending`` is True when the first key that is not a hit is being stored or promoted from a lower tier: the
    caller should ask again later instead of recomputing it.
    """

    hits: int
    pending: bool = False


@dataclass(frozen=True)
class PrepareStoreOutput:
    """Room reserved by ``prepare_store``.

    ``keys_to_store``: the keys the caller must copy (keys already held or in flight are left out), in input order.
    ``store_spec``: where to copy them (one entry per key in ``keys_to_store``).
    ``evicted_keys``: keys removed from the tier to make room.
    """

    keys_to_store: tuple[OffloadKey, ...]
    store_spec: BlockSpec
    evicted_keys: tuple[OffloadKey, ...]


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


EngineHash = int | bytes
"""An engine's own hash of one engine block, as its KV events publish it (vLLM: an unsigned 64-bit int, or the
hash's bytes under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""


@dataclass(frozen=True, slots=True)
class BlockDescription:
    """One offload block of one KV-cache group as a KV-aware router indexes it: what the engine's own KV events
    say of the engine blocks it covers (``connector.announce``). Engine-neutral: the engine adapter fills it from
    its request, and turns it into its events."""

    block_hashes: tuple[EngineHash, ...]
    """The engine's hash of each engine block the offload block covers, in order."""
    parent_hash: EngineHash | None
    """The engine's hash of the engine block before the first (None: the prefix's first block)."""
    token_ids: tuple[int, ...]
    """The offload block's tokens (``len(block_hashes) * block_size``; empty for a state group's block)."""
    block_size: int
    """Tokens per engine block (per hash)."""
    group: int
    """The KV-cache group."""
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    """What besides tokens went into each hash, one entry per hash, as the engine's events publish it."""


@dataclass(frozen=True)
class OffloadEvent:
    """Keys that became loadable (``STORED``) or stopped being loadable (``REMOVED``) on ``medium``.

    ``descriptions``: empty, or one per key (None where unknown) when the tier learned the keys from another engine
    (the node pool's blocks other engines stored): this engine never saw their requests.
    """

    kind: EventKind
    keys: tuple[OffloadKey, ...]
    medium: Medium
    descriptions: tuple[BlockDescription | None, ...] = ()


@dataclass(frozen=True, eq=False)
class TierTransfer:
    """A copy a tier wants run in the background (promotion from disk, write-through to disk).

    The connector ships it to the workers as a job (its one id is the job's) and hands the same object back with
    its outcome, ``complete_transfer(transfer, success)``. Compared by identity: two transfers are never the same.
    """

    src: BlockSpec
    dst: BlockSpec


@dataclass(frozen=True)
class TierUsage:
    medium: Medium
    used_blocks: int
    capacity_blocks: int


@dataclass(frozen=True)
class StoreCounts:
    """What a shared store's background work gave up since its index was made (``tiers.lower.background``):
    lookups that were misses because the store did not answer (a failure, a timeout, a search too late or
    refused, the tier switched off after failures), and blocks whose delete failed or was dropped."""

    unanswered_lookups: int = 0
    undeleted_blocks: int = 0

    def __add__(self, other: StoreCounts) -> StoreCounts:
        return StoreCounts(self.unanswered_lookups + other.unanswered_lookups,
                           self.undeleted_blocks + other.undeleted_blocks)


NO_STORE_COUNTS = StoreCounts()
"""The counts of an index with no shared store (one instance: the engine compares them every step)."""


class LoadAdvisor(Protocol):
    """Says whether loading blocks from a tier below host beats recomputing them (connector.load_cost)."""

    def worth_loading(self, medium: Medium, blocks: int) -> bool: ...


class BlockIndex(ABC):
    """Index of one tier (or a stack of tiers behind one face)."""

    @abstractmethod
    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult:
        """Count the leading keys that are ready to load.

        Args:
            keys: consecutive block keys of one KV-cache group, in prefix order.
        Returns:
            The number of leading ready keys, and whether the first non-ready one is in flight.
        """

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec:
        """Pin ``keys`` for a load and say where they are.

        Args:
            keys: keys that the last ``lookup`` reported as hits.
        Returns:
            The source spec, one entry per key, in order (``group_sizes`` is ``(len(keys),)``; callers regroup).
        Raises:
            KeyError: a key is not ready (a caller bug).
        """

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark ``keys`` as recently used (the eviction policy's input). Unknown keys are ignored."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Unpin ``keys`` after a load. On failure the keys are dropped from the tier once nothing pins them."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Reserve room for the keys not yet held, evicting ready, unpinned blocks if needed.

        Returns:
            The reservation, or None when there is not enough room; then nothing was changed.
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Make stored keys loadable, or forget them (and free their room) when the store failed."""

    @abstractmethod
    def take_events(self) -> list[OffloadEvent]:
        """Events since the last call, oldest first."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every ready, unpinned block (pinned and in-flight blocks stay until completed)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Check the index's conservation laws.

        Raises:
            IntegrityError: the bookkeeping is inconsistent.
        """

    def take_transfers(self) -> list[TierTransfer]:
        """Background copies this tier wants run (none for a single tier)."""
        return []

    def set_load_cost(self, advisor: LoadAdvisor) -> None:  # noqa: B027 (a hook: single tiers ignore it)
        """Consult ``advisor`` before loading blocks that only a tier below host holds (a single tier has none)."""

    def complete_transfer(self, transfer: TierTransfer, success: bool) -> None:
        """Outcome of a copy handed out by ``take_transfers``.

        Raises:
            KeyError: ``transfer`` is not one this index handed out and has not seen complete.
        """
        raise KeyError(f"unknown tier transfer {transfer}")

    @abstractmethod
    def usage(self) -> list[TierUsage]:
        """Blocks held per tier (ready, pinned or in flight) and capacity, for metrics; top tier first."""

    @property
    def host_policy(self) -> Policy | None:
        """The host tier's eviction policy object, for an admission rule that steers it (``AdaptiveAdmission``);
        None where the tier orders its blocks itself (the node tier's shared index)."""
        return None

    def pool_counters(self) -> dict[str, int]:
        """Counters of a pool this index shares with other engines (the node tier's: ``NodeIndex.pool_counters``);
        empty when it shares none."""
        return {}

    def pool_directory(self) -> str | None:
        """Where the pool this index shares lives (the node tier's namespace directory), read at scrape time by
        the engine's /metrics; None when it shares none."""
        return None

    def store_counts(self) -> StoreCounts:
        """What a shared store's background work gave up so far (none for a tier this process answers itself)."""
        return NO_STORE_COUNTS

    def close(self) -> None:  # noqa: B027 (a hook: an index of this process's memory holds nothing to release)
        """The engine stops: release what this index holds outside the process (the node tier's attachment)."""

    def share_descriptions(self, medium: Medium,  # noqa: B027 (a hook: a private tier shares nothing)
                           described: Sequence[tuple[OffloadKey, BlockDescription]]) -> None:
        """This engine announced ``described`` keys as stored on ``medium``: a tier that other engines load from
        passes them on, so that every engine attached announces the blocks (the node pool: ``tiers.node.announce``;
        its index then reports other engines' blocks as events with ``descriptions``). Called once a step at
        most, only when the engine publishes KV events."""


class LowerIndex(Protocol):
    """The index of a tier under host, as ``TieredIndex`` uses it (``DiskIndex``, ``RemoteIndex``).

    The methods mean what they mean on ``BlockIndex``, with the keys of one tier transfer at a time:
    ``lookup`` counts the leading keys a promotion can read now; ``prepare_load`` pins them for a promotion and
    returns the promotion's source spec (this tier's medium, one entry per key, one group); ``prepare_store``
    reserves room for a write. Like every index, none of them raises on a data-path failure: an unreachable tier
    is a miss, or a store refused with None.

    A tier whose lookup crosses a network never answers it on the engine step: ``lookup`` answers ``pending``
    (hits not used) while its answer is being found in the background, and the engine asks again at a later step
    with the same keys, which takes the answer (``tiers.lower.probed_index``; such an index offers tests
    ``wait_answers(timeout_s)``). Every other tier answers at once, ``pending`` only for a key whose store is in
    flight. Either way ``TieredIndex`` promotes nothing and asks again later.
    ``close`` releases its threads and connections when the engine stops.
    """

    @property
    def medium(self) -> Medium: ...

    def lookup(self, keys: Sequence[OffloadKey]) -> LookupResult: ...

    def prepare_load(self, keys: Sequence[OffloadKey]) -> BlockSpec: ...

    def touch(self, keys: Sequence[OffloadKey]) -> None: ...

    def complete_load(self, keys: Sequence[OffloadKey], success: bool = True) -> None: ...

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None: ...

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None: ...

    def take_events(self) -> list[OffloadEvent]: ...

    def reset(self) -> None: ...

    def check_integrity(self) -> None: ...

    def usage(self) -> list[TierUsage]: ...

    def store_counts(self) -> StoreCounts: ...

    def close(self) -> None: ...


class HostIndex(BlockIndex):
    """The host tier's index as ``TieredIndex`` uses it: ``SlotIndex``, or the node tier's ``NodeIndex``."""

    medium = Medium.HOST
    capacity: int
    """Host slots: the host pool's slot count."""

    @abstractmethod
    def complete_store_keys(self, keys: Sequence[OffloadKey], success: bool = True) -> list[OffloadKey]:
        """``complete_store``, returning the keys it made ready (those the tiers below then write through)."""
