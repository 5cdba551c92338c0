"""What one replay measured: hit rates, blocks stored and wasted, bytes moved."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ReplayResult:
    """Totals of one replay of a trace at one capacity.

    Blocks are references (a block used by ten requests counts ten times in ``blocks``); stored, evicted and wasted
    blocks count tier events.
    """

    strategy: str
    """The eviction policy (``EvictionPolicy`` value) or bound (``optimum``, ``unbounded``)."""
    admission: str
    capacity_blocks: int
    block_tokens: int
    requests: int
    input_tokens: int
    hit_tokens: int
    """Per request ``min(hit blocks * block_tokens, input_length)``: a hit on a partial last block counts the tokens
    it holds."""
    blocks: int
    hit_blocks: int
    stored_blocks: int
    declined_blocks: int
    """Missed blocks never offered to the tier: refused by the admission rule or the optimum's bypass, or past what
    fits in the tier."""
    evicted_blocks: int
    wasted_blocks: int
    """Stored blocks evicted before any request read them."""
    unread_blocks: int
    """Stored blocks still resident at the end that no request read."""
    seconds: float
    """The replay's wall time, not counting reading the trace nor a next-use table the caller passed in."""

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_tokens

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def waste(self) -> float:
        """The fraction of stored blocks evicted unread."""
        return self.wasted_blocks / self.stored_blocks if self.stored_blocks else 0.0

    def loaded_bytes(self, bytes_per_token: int) -> int:
        """Bytes loaded from the tier: whole blocks, one per block hit."""
        return self.hit_blocks * self.block_tokens * bytes_per_token

    def stored_bytes(self, bytes_per_token: int) -> int:
        return self.stored_blocks * self.block_tokens * bytes_per_token

    def to_dict(self, bytes_per_token: int | None = None) -> dict[str, Any]:
        """The fields and rates as a JSON-ready dict; bytes too when ``bytes_per_token`` is given."""
        doc: dict[str, Any] = {**asdict(self), "capacity_tokens": self.capacity_tokens,
                               "token_hit_rate": self.token_hit_rate, "block_hit_rate": self.block_hit_rate,
                               "waste": self.waste}
        if bytes_per_token is not None:
            doc["loaded_bytes"] = self.loaded_bytes(bytes_per_token)
            doc["stored_bytes"] = self.stored_bytes(bytes_per_token)
        return doc
