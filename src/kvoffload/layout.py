"""KV cache layout: a description of an engine's KV tensors, and ``canonicalize()``.

(Work in progress: the description types and ``canonicalize()`` land next; ``CanonicalKV`` is the contract that
transfer handlers rely on and stays as it is.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockRef:
    """One layer's part of an engine block: row ``block_id`` of ``views[view]``, first ``nbytes`` bytes."""

    view: int
    nbytes: int


@dataclass(frozen=True)
class CanonicalKV:
    """The engine's KV cache as handlers see it.

    ``views``: int8 tensors shaped ``(num_blocks, page_bytes)``, one per distinct backing buffer (or per K/V half);
    row ``b`` holds engine block ``b``. Views alias the engine's memory; writing a view writes the cache.
    ``group_refs[g]``: the ordered refs that make up one block of KV-cache group ``g``. A block of group ``g`` is
    copied as the concatenation of ``views[r.view][block_id, :r.nbytes]`` for ``r`` in ``group_refs[g]``.
    """

    views: tuple[torch.Tensor, ...]
    group_refs: tuple[tuple[BlockRef, ...], ...]
    num_blocks: int

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one engine block of ``group`` once copied (padding excluded)."""
        return sum(r.nbytes for r in self.group_refs[group])

    @property
    def max_block_bytes(self) -> int:
        return max(self.group_block_bytes(g) for g in range(len(self.group_refs)))

    def describe(self) -> str:
        """A stable text of the layout, for the key namespace: same text, same page bytes."""
        groups = ";".join(",".join(f"{r.view}:{r.nbytes}" for r in refs) for refs in self.group_refs)
        pages = ",".join(str(v.shape[1]) for v in self.views)
        return f"pages={pages}|groups={groups}"
