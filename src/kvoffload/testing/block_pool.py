"""The simulated engine's device block pool: reference counts, an LRU free list and a prefix cache.

Like vLLM's, a freed block keeps its cached content until it is handed out again, so a later request with the same
prefix can reuse it; allocation takes the least recently freed block first. Block 0 is vLLM's null block: never handed
out, it stands in a block table for blocks a sliding-window group dropped.
"""

from __future__ import annotations

from collections import OrderedDict

from kvoffload.keys import BlockHash

CacheKey = tuple[int, BlockHash]
"""(KV-cache group, engine block hash)."""

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK + 1, num_blocks))
        self._cached: dict[CacheKey, int] = {}
        self._key_of: dict[int, CacheKey] = {}

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or None (and nothing changes) when fewer are free."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """Take a reference to a cached block (a prefix hit)."""
        self._refs[block] += 1
        self._free.pop(block, None)

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def free_uncached(self, blocks: list[int]) -> None:
        """Free blocks whose content is not valid (an aborted load): they must not serve as prefix hits."""
        for block in blocks:
            if self._refs[block] == 1:
                self._uncache(block)
        self.free(blocks)

    def cache(self, block: int, key: CacheKey) -> None:
        if key not in self._cached and block not in self._key_of:
            self._cached[key] = block
            self._key_of[block] = key

    def lookup(self, key: CacheKey) -> int | None:
        return self._cached.get(key)

    def drop_cache(self) -> None:
        """Forget every cached prefix (the engine's ``reset_prefix_cache``)."""
        self._cached.clear()
        self._key_of.clear()

    def _uncache(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]
