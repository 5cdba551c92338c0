"""What a transfer job moves: a list of blocks on one medium.

Specs are small, picklable values; they cross from the scheduler half to the worker half inside
``ConnectorMetadata``. A job copies ``src`` to ``dst``; the two specs name the same blocks in the same order.

Block order and groups: a spec lists the blocks of KV-cache group 0 first, then group 1, and so on;
``group_sizes[g]`` says how many entries belong to group ``g``. On the device, one entry is one engine block; on the
host and in every tier under it one entry is one offload block, which holds ``factor`` consecutive engine blocks
(sub-blocks).
A load may begin inside an offload block whose first sub-blocks the engine already holds: ``skip_sub_blocks`` says
how many leading sub-blocks of each group's first entry are not copied.

Holes: a load's ``DeviceBlocks`` entry may be ``NO_BLOCK``, a position that is not copied. The scheduler half puts
one wherever the engine's block table holds its null block (vLLM's block 0 stands in for the blocks a sliding-window
group dropped; nothing may write it). A hole keeps its position, so the entries after it still pair with their
host sub-blocks. Stores never have holes: an offload block with a dropped sub-block is not stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NewType

from kvoffload.keys import OffloadKey

JobId = NewType("JobId", int)

NO_BLOCK = -1
"""A hole in a load's ``DeviceBlocks``: this position is not copied."""


class Medium:
    """Where blocks are: the device, the host pool, or a tier under host, named by ``value``.

    Open, not an enum: a tier from another package (``kvoffload.tiers`` entry points) brings its own medium. Like an
    enum member, each name has one instance (``Medium("disk") is Medium.DISK``, also after pickling), so comparing
    and hashing media costs what it costs for enum members: media route every job and count every transfer.
    """

    __slots__ = ("value",)
    _instances: ClassVar[dict[str, Medium]] = {}

    DEVICE: ClassVar[Medium]
    HOST: ClassVar[Medium]
    DISK: ClassVar[Medium]
    REMOTE: ClassVar[Medium]
    OBJECT: ClassVar[Medium]
    BUILT_IN: ClassVar[tuple[Medium, ...]]
    """kvoffload's own media, in the order the tiers are stacked."""

    value: str

    def __new__(cls, value: str) -> Medium:
        found = cls._instances.get(value)
        if found is not None:
            return found
        if not isinstance(value, str) or not value.replace("_", "").isalnum() or not value.isascii():
            raise ValueError(f"medium {value!r}: a medium is named by ASCII letters, digits and underscores")
        medium = super().__new__(cls)
        object.__setattr__(medium, "value", value)
        return cls._instances.setdefault(value, medium)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Medium is immutable")

    def __reduce__(self) -> tuple[type[Medium], tuple[str]]:
        return (Medium, (self.value,))  # unpickled as the one instance of its name

    def __repr__(self) -> str:
        return f"Medium({self.value!r})"


Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE, Medium.OBJECT = (
    Medium(v) for v in ("device", "host", "disk", "remote", "object"))
Medium.BUILT_IN = (Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE, Medium.OBJECT)


def _check_groups(name: str, entries: int, group_sizes: tuple[int, ...]) -> None:
    if any(n < 0 for n in group_sizes) or sum(group_sizes) != entries:
        raise ValueError(f"{name}: group_sizes {group_sizes} do not add up to {entries} blocks")


@dataclass(frozen=True)
class DeviceBlocks:
    """Engine blocks in the device KV cache (one entry per engine block; ``NO_BLOCK`` for a hole in a load)."""

    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]

    medium = Medium.DEVICE

    def __post_init__(self) -> None:
        _check_groups("DeviceBlocks", len(self.block_ids), self.group_sizes)

    @property
    def real_block_ids(self) -> tuple[int, ...]:
        """The block ids that are copied: every entry but the holes."""
        return tuple(b for b in self.block_ids if b != NO_BLOCK)


@dataclass(frozen=True)
class HostBlocks:
    """Slots of the host tier's pool (one entry per offload block)."""

    slots: tuple[int, ...]
    group_sizes: tuple[int, ...]
    skip_sub_blocks: int = 0
    epochs: tuple[int, ...] = ()
    """Node pool only: each slot's epoch when the scheduler pinned or reserved it (a load fails when its slot's
    epoch changed, or was 0: gone before it was pinned); empty for a private pool."""

    medium = Medium.HOST

    def __post_init__(self) -> None:
        _check_groups("HostBlocks", len(self.slots), self.group_sizes)
        if self.skip_sub_blocks < 0:
            raise ValueError(f"HostBlocks: skip_sub_blocks {self.skip_sub_blocks} is negative")
        if self.epochs and len(self.epochs) != len(self.slots):
            raise ValueError(f"HostBlocks: {len(self.epochs)} epochs for {len(self.slots)} slots")


@dataclass(frozen=True)
class TierBlocks:
    """Entries of a tier under host, named by key (one entry per offload block): the disk tier's files, the remote
    tier's values, the object tier's objects, a plug-in tier's entries. ``slots``, where its index gives each entry a
    slot (a plug-in tier addressed by slot, like ``tests/tiers/plugin``'s), pairs with ``keys``; empty for a tier
    addressed by key alone."""

    medium: Medium
    keys: tuple[OffloadKey, ...]
    group_sizes: tuple[int, ...]
    slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_groups("TierBlocks", len(self.keys), self.group_sizes)
        if self.slots and len(self.slots) != len(self.keys):
            raise ValueError(f"TierBlocks: {len(self.slots)} slots for {len(self.keys)} keys")
        if self.medium in (Medium.DEVICE, Medium.HOST):
            raise ValueError(f"TierBlocks: medium {self.medium.value!r} is not a tier under host")


BlockSpec = DeviceBlocks | HostBlocks | TierBlocks


@dataclass(frozen=True)
class TransferJob:
    """Copy ``src`` to ``dst``. Job ids increase monotonically within one scheduler."""

    job_id: JobId
    src: BlockSpec
    dst: BlockSpec

    @property
    def transfer_type(self) -> tuple[Medium, Medium]:
        return (self.src.medium, self.dst.medium)


def transfer_name(transfer_type: tuple[Medium, Medium]) -> str:
    """``"device_to_host"`` and friends: the label used in stats and metrics."""
    return f"{transfer_type[0].value}_to_{transfer_type[1].value}"
