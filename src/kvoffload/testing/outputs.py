"""Comparing an engine's generated outputs with and without kvoffload, and the control that makes it mean something.

"Same outputs as plain vLLM" proves a load right only if the outputs depend on the KV cache at all. So every
comparison comes with a control: the same prompt with one token changed inside a block that kvoffload loads must
move plain vLLM's outputs by at least ``CONTROL_FACTOR`` times the comparison's ``TOLERANCE``. The e2e tests and
``kvoffload demo`` both use these functions. No engine import: outputs are plain token ids and logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

TOLERANCE = 1e-3
"""Largest difference between two runs' logprobs of one token at one generated position that counts as equal."""
CONTROL_FACTOR = 100
TOP_LOGPROBS = 20
"""Logprobs compared per generated position (vLLM's default limit): the distribution, not just the chosen
token, so that a small change in the KV shows even when greedy decoding picks the same tokens."""


class GeneratedOutput(Protocol):
    """One request's greedy output: the generated token ids and, per generated position, the top logprobs
    (token id -> logprob, the generated token among them)."""

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[Mapping[int, float]]: ...


def divergence(got: Sequence[GeneratedOutput], want: Sequence[GeneratedOutput]) -> float:
    """How far two runs' outputs are apart: infinite where any generated token differs, else the largest
    difference between the two runs' logprobs of one token at one position (tokens in both top lists)."""
    if len(got) != len(want) or any(list(g.tokens) != list(w.tokens) for g, w in zip(got, want, strict=False)):
        return math.inf
    return max((abs(top_g[t] - top_w[t]) for g, w in zip(got, want, strict=True)
                for top_g, top_w in zip(g.logprobs, w.logprobs, strict=True) for t in top_g.keys() & top_w.keys()),
               default=0.0)


def with_changed_token(prompt: Sequence[int], position: int, vocab_size: int, low: int = 2) -> list[int]:
    """``prompt`` with the token at ``position`` replaced by another id in ``[low, vocab_size)``."""
    changed = list(prompt)
    changed[position] = low + (changed[position] - low + 1) % (vocab_size - low)
    return changed


@dataclass(frozen=True)
class Control:
    """The outcome of a control: how far one changed prompt token moved plain outputs (inf: a token changed)."""

    shift: float

    @property
    def holds(self) -> bool:
        return self.shift >= CONTROL_FACTOR * TOLERANCE

    def as_json(self) -> dict[str, object]:
        finite = math.isfinite(self.shift)
        return {"tokens_changed": not finite, "max_logprob_shift": round(self.shift, 6) if finite else None,
                "required_shift": CONTROL_FACTOR * TOLERANCE, "holds": self.holds}


def control(plain: Sequence[GeneratedOutput], changed: Sequence[GeneratedOutput]) -> Control:
    """The weakest shift over the prompt pairs: every changed prompt must move its own output."""
    return Control(min(divergence([p], [c]) for p, c in zip(plain, changed, strict=True)))
