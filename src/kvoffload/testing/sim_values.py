"""The simulated engine's values (``testing.sim``): its requests and step reports, and the page model, the bytes a
block's page holds as a function of its tokens, group and rank, which a loaded block must match bit for bit."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvoffload.canonical import CanonicalKV
from kvoffload.config import TenantBy
from kvoffload.index.base import BlockDescription
from kvoffload.keys import BlockHash, hash_block

NULL_SENTINEL = 0x5A
"""Every byte of the null block, on every worker: no write may change it."""


class HookOrder(enum.Enum):
    """Where a step's ``prepare_store_kv`` (vLLM's ``wait_for_save``) runs among the worker's hooks."""

    SAVE_FIRST = "save first"
    """Before the step's reports: vLLM's model runners without speculative decoding."""
    REPORT_FIRST = "report first"
    """After them: vLLM's runners with speculative decoding, which call ``wait_for_save`` once the drafter ran
    (V1's ``finalize_kv_connector``; Model Runner V2's ``finalize_step``, vLLM 0.33)."""


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SimRequest:
    request_id: str
    all_token_ids: list[int]
    max_new_tokens: int
    extra_keys: tuple[str, ...] = ()
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    sent_blocks: list[int] = field(default_factory=list)
    pending_load_tokens: int = 0
    loaded_tokens: int = 0
    device_hit_tokens: int = 0
    preemptions: int = 0
    first_token_step: int | None = None
    hashes: list[BlockHash] = field(default_factory=list)
    engine_hashes: list[int] = field(default_factory=list)
    """The simulated engine's own hash of each full engine block (``SimDescriber``), as its router events name
    them: computed once, as blocks fill."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the client asked of KV connectors: a retention hint, ``{"kvoffload": {"retain_s": N}}``."""

    @property
    def num_new_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def tenant(self, by: TenantBy) -> str | None:
        """From the extra keys, as vLLM's request gives it: ``salt:NAME`` is the cache salt, ``lora:NAME`` the
        LoRA adapter."""
        prefix = {TenantBy.CACHE_SALT: "salt:", TenantBy.LORA: "lora:"}.get(by)
        if prefix is None:
            return None
        return next((k[len(prefix):] for k in self.extra_keys if k.startswith(prefix) and len(k) > len(prefix)), None)

    def block_hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """The chained hashes of the first ``num_blocks`` full blocks (remembered as they are computed)."""
        while len(self.hashes) < num_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else b"sim-engine"
            self.hashes.append(hash_block(parent, self.all_token_ids[i * block_size:(i + 1) * block_size],
                                          self.extra_keys))
        return self.hashes[:num_blocks]

    def page_seed(self, block: int, filled: int, block_size: int) -> bytes:
        """What block ``block``'s page bytes derive from when ``filled`` tokens are computed (its hash once full)."""
        if filled == (block + 1) * block_size:
            return self.block_hashes(block + 1, block_size)[block]
        parent = self.block_hashes(block, block_size)[-1] if block else b"sim-engine"
        return hash_block(parent, self.all_token_ids[block * block_size:filled], self.extra_keys)


@dataclass(frozen=True)
class StepReport:
    step: int
    scheduled_tokens: int
    finished: tuple[str, ...]
    idle: bool
    """The step's connector metadata was empty (no job started or flushed)."""



def next_token(tokens: Sequence[int], vocab_size: int) -> int:
    """The simulated model's greedy choice: a deterministic function of the recent context."""
    return int.from_bytes(hash_block(b"sim-sample", tokens[-8:])[:4], "little") % vocab_size


def page_bytes(kv: CanonicalKV, group: int, seed: bytes, rank: int = 0) -> torch.Tensor:
    """A block's bytes: a function of its tokens' ``seed``, its group and the rank that computed it."""
    # The CPU generator keeps only a seed's low 32 bits: group and rank go there.
    gen = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little") >> 1 ^ group ^ rank << 16)
    return torch.randint(-128, 128, (kv.group_block_bytes(group),), dtype=torch.int8, generator=gen)


def write_block(kv: CanonicalKV, group: int, block: int, seed: bytes, rank: int = 0) -> None:
    data, offset = page_bytes(kv, group, seed, rank), 0
    for ref in kv.group_refs[group]:
        kv.views[ref.view][block, :ref.nbytes].copy_(data[offset:offset + ref.nbytes])
        offset += ref.nbytes


def block_matches(kv: CanonicalKV, group: int, block: int, seed: bytes, rank: int = 0) -> bool:
    data, offset = page_bytes(kv, group, seed, rank), 0
    for ref in kv.group_refs[group]:
        if not torch.equal(kv.views[ref.view][block, :ref.nbytes], data[offset:offset + ref.nbytes]):
            return False
        offset += ref.nbytes
    return True


class SimDescriber:
    """Describes the simulated engine's offload blocks for router events (``connector.announce.Describe``), as an
    engine adapter does: the engine's own hash of each engine block an offload block covers (a 64-bit int chained
    over the block's tokens and the request's extra keys, like vLLM's), its parent's, its tokens. ``calls`` counts
    the descriptions made (the cost a lookup or a store pays)."""

    def __init__(self, block_size: int, factor: int, state_groups: frozenset[int] = frozenset()) -> None:
        self.block_size = block_size
        self.factor = factor
        self.state_groups = state_groups
        self.calls = 0

    def __call__(self, request: object, block: int, group: int) -> BlockDescription | None:
        if not isinstance(request, SimRequest):
            return None
        self.calls += 1
        first, end = block * self.factor, (block + 1) * self.factor
        hashes = self.engine_hashes(request, end)
        if len(hashes) < end:
            return None
        parent = hashes[first - 1] if first else None
        if group in self.state_groups:
            return BlockDescription((hashes[end - 1],), hashes[end - 2] if end - first > 1 else parent, (),
                                    self.block_size, group)
        size = self.block_size
        return BlockDescription(tuple(hashes[first:end]), parent, tuple(request.all_token_ids[first * size:end * size]),
                                size, group, extra_keys=(tuple(request.extra_keys),) * self.factor
                                if request.extra_keys else None)

    def engine_hashes(self, request: SimRequest, blocks: int) -> list[int]:
        """The engine's hashes of ``request``'s first ``blocks`` engine blocks (fewer when fewer are full)."""
        known, size = request.engine_hashes, self.block_size
        full = min(blocks, len(request.all_token_ids) // size)
        for b in range(len(known), full):
            parent = known[-1].to_bytes(8, "big") if known else b"sim-root"
            digest = hash_block(parent, request.all_token_ids[b * size:(b + 1) * size], request.extra_keys)
            known.append(int.from_bytes(digest[:8], "big"))
        return known[:blocks]
