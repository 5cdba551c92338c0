"""What a KV-aware router is told: the tiers' events, each block described as the engine's own KV events describe
the engine blocks it covers.

A router (Dynamo's KV router, llm-d's precise prefix-cache scorer) indexes each engine's blocks by the engine's
block hashes and token ids, per medium. The tiers know blocks only by their offload keys, so the scheduler half
describes a block (``BlockDescription``, through the engine adapter's ``Describe``) while its request is at hand:

- when the block is stored (the step's store job: its keys that are really copied), and
- when a lookup hits it (a block this engine did not store: another engine's in a shared tier, one found on disk
  at start-up), so that its promotion to the host is announced too.

``Announcer.take`` turns the tiers' ``OffloadEvent`` values into ``Announcement`` values: a ``STORED`` key is
announced on its medium with its description (kept while any medium holds it, so a later store of the same block
on another tier, a write-through to disk, is announced alike), and a ``REMOVED`` key is announced only on a medium
it was announced on, with the same hashes, then forgotten once no medium holds it. Keys whose description is
unknown are not announced (counted in ``undescribed``): a router never sees a hash that is not the engine's.

Blocks another engine stored in a shared pool arrive with their descriptions (``OffloadEvent.descriptions``,
``tiers.node.announce``); the ones this engine describes itself it passes to the tier
(``BlockIndex.share_descriptions``) so that every engine attached announces them.

Bounded: descriptions waiting for their store (``MAX_WAITING``) and announced blocks (``max_blocks``, the tiers'
capacity) drop their oldest beyond their bound (counted in ``forgotten``: a router keeps scoring such a block after
its removal until its next eviction from the router's own index). Each announced block keeps its description with
the tokens packed (4 bytes a token); ``kvoffload bench overhead`` measures the bytes a block and the step's cost.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.blocks import Medium
from kvoffload.connector.requests import EngineRequest, RequestState
from kvoffload.index.base import BlockDescription, BlockIndex, EventKind, OffloadEvent
from kvoffload.keys import OffloadKey

Describe = Callable[[EngineRequest, int, int], "BlockDescription | None"]
"""``describe(request, block, group)``: offload block ``block`` of ``request`` in KV-cache group ``group`` as the
engine's KV events describe it; None when the engine cannot (its hashes do not cover the block yet)."""

MAX_WAITING = 1 << 16
"""Descriptions kept for blocks not yet announced (a store in flight, a lookup's hit before its promotion): a
store job's blocks complete in a step or two, so this bounds only stores that failed and hits never promoted."""
MAX_BLOCKS = 1 << 20
"""The most announced blocks kept, whatever the tiers' capacity (about 300 MB at 32-token blocks)."""
_TOKENS = "I"
"""Token ids packed as unsigned 32-bit (every tokenizer's vocabulary fits), 4 bytes a token."""


@dataclass(frozen=True, slots=True)
class Announcement:
    """One block a router learns of: loadable (``STORED``) or no longer (``REMOVED``) on ``medium``."""

    kind: EventKind
    medium: Medium
    description: BlockDescription


@dataclass(slots=True)
class _Announced:
    """An announced block: its description without tokens, its tokens packed, the media it was announced on."""

    description: BlockDescription
    tokens: array[int] | tuple[int, ...]
    media: int

    def unpacked(self) -> BlockDescription:
        return _with_tokens(self.description, tuple(self.tokens))


class Announcer:
    """Describes blocks while their requests are at hand and announces the tiers' events with those descriptions.

    Not thread-safe: the scheduler half calls it from one thread.
    """

    def __init__(self, describe: Describe, index: BlockIndex, max_blocks: int = MAX_BLOCKS) -> None:
        self.describe = describe
        """The engine adapter's describer."""
        self._index = index
        self.max_blocks = max(1, min(max_blocks, MAX_BLOCKS))
        self._waiting: dict[OffloadKey, BlockDescription] = {}
        self._announced: dict[OffloadKey, _Announced] = {}
        self._bits: dict[Medium, int] = {}
        self._started = False
        self.undescribed = 0
        """Stored keys not announced: no description was found for them."""
        self.forgotten = 0
        """Announced or waiting blocks dropped at the bounds: their removal will not be announced."""

    def describe_run(self, state: RequestState, keys: Sequence[OffloadKey], first: int, group: int) -> None:
        """A lookup hit ``keys``, ``state``'s offload blocks ``first, first + 1, ...`` of ``group``: describe the
        ones neither waiting nor announced (their promotion to the host, or a shared tier's own event, may come)."""
        waiting, announced = self._waiting, self._announced
        for i, key in enumerate(keys):
            if key not in waiting and key not in announced and not self.describe_block(state, key, first + i, group):
                return  # the engine's hashes end here: the blocks after cannot be described either

    def describe_block(self, state: RequestState, key: OffloadKey, block: int, group: int) -> bool:
        """Describe ``key``, ``state``'s offload block ``block`` of ``group``, for its coming store event; False
        when the engine cannot describe it."""
        description = self.describe(state.request, block, group)
        if description is None:
            return False
        waiting = self._waiting
        waiting[key] = description
        if len(waiting) > MAX_WAITING:
            del waiting[next(iter(waiting))]
            self.forgotten += 1
        return True

    def take(self, events: Sequence[OffloadEvent]) -> list[Announcement]:
        """The announcements of ``events`` (oldest first); passes this engine's own stored blocks to the tiers that
        share them."""
        out: list[Announcement] = []
        shared: dict[Medium, list[tuple[OffloadKey, BlockDescription]]] = {}
        if not self._started:
            # The first share, empty or not, tells a shared host tier that this engine announces: it then reads
            # what the other engines attached announce (an engine that stores nothing itself learns them too).
            self._started = True
            shared[Medium.HOST] = []
        for event in events:
            if event.kind is EventKind.STORED:
                self._stored(event, out, shared)
            else:
                self._removed(event, out)
        for medium, described in shared.items():
            self._index.share_descriptions(medium, described)
        return out

    def _stored(self, event: OffloadEvent, out: list[Announcement],
                shared: dict[Medium, list[tuple[OffloadKey, BlockDescription]]]) -> None:
        medium = event.medium
        bit = self._bit(medium)
        given = event.descriptions
        for i, key in enumerate(event.keys):
            description = given[i] if given else None
            own = description is None
            kept = self._announced.get(key)
            if description is None:
                description = self._waiting.pop(key, None)
                if description is None and kept is not None:
                    description = kept.unpacked()
            if description is None:
                self.undescribed += 1
                continue
            if kept is not None and kept.media & bit:
                continue  # announced on this medium already (a block stored again after a failed load, say)
            if kept is None:
                kept = self._keep(key, description)
            kept.media |= bit
            out.append(Announcement(EventKind.STORED, medium, description))
            if own:
                shared.setdefault(medium, []).append((key, description))

    def _removed(self, event: OffloadEvent, out: list[Announcement]) -> None:
        medium = event.medium
        bit = self._bit(medium)
        for key in event.keys:
            kept = self._announced.get(key)
            if kept is None or not kept.media & bit:
                continue  # never announced there: nothing for a router to drop
            kept.media &= ~bit
            out.append(Announcement(EventKind.REMOVED, medium, kept.description))
            if not kept.media:
                del self._announced[key]

    def _keep(self, key: OffloadKey, description: BlockDescription) -> _Announced:
        kept = _Announced(_with_tokens(description, ()), _packed(description.token_ids), 0)
        announced = self._announced
        announced[key] = kept
        if len(announced) > self.max_blocks:
            del announced[next(iter(announced))]
            self.forgotten += 1
        return kept

    def _bit(self, medium: Medium) -> int:
        bit = self._bits.get(medium)
        if bit is None:
            bit = self._bits[medium] = 1 << len(self._bits)
        return bit

    def reset(self) -> None:
        """The tiers forgot their blocks (the engine's prefix cache reset: vLLM publishes ``AllBlocksCleared``,
        which clears a router's every medium of this engine): nothing is announced any more, and a block stored
        again is announced again."""
        self._waiting.clear()
        self._announced.clear()

    @property
    def announced_blocks(self) -> int:
        """Blocks announced on some medium and not yet removed from all of them."""
        return len(self._announced)


def _with_tokens(d: BlockDescription, tokens: tuple[int, ...]) -> BlockDescription:
    # Built field by field: dataclasses.replace costs microseconds a call, and this runs for every block announced.
    return BlockDescription(d.block_hashes, d.parent_hash, tokens, d.block_size, d.group, d.lora_id, d.lora_name,
                            d.extra_keys)


def _packed(tokens: tuple[int, ...]) -> array[int] | tuple[int, ...]:
    try:
        return array(_TOKENS, tokens)
    except OverflowError:  # a token id outside 32 bits (none that a tokenizer makes): kept as it came, never raised
        return tokens
