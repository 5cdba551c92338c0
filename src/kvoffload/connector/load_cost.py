"""Cost-aware loading: load a run of blocks from a tier below host only when that beats recomputing its tokens.

Place in the data flow: the scheduler half times every tier job it ships (from ``build_connector_meta`` to the
workers' report of it in ``update_connector_output``) and feeds each finished promotion (a lower tier -> host
copy) to ``LoadCost.observe_transfer``; it feeds each step's prefill work to ``observe_step``. When a lookup
finds blocks that only a lower tier holds, the index asks ``LoadCost.worth_loading(medium, blocks)``
before it queues their promotion; a "no" is a miss (the engine computes), counted in ``skipped_blocks``.

The estimate per tier: the latency and bandwidth of its recent promotions (a least-squares line of seconds
against bytes over the last ``WINDOW`` jobs), against the engine's prefill speed (tokens per second, configured or
measured from its steps). With too few samples it loads (there is no other way to learn a tier's speed), and it
loads every ``EXPLORE_EVERY``-th run it would skip, so an estimate made while the tier was slow can recover.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvoffload.blocks import Medium
from kvoffload.config import LoadPolicy

WINDOW = 32
MIN_SAMPLES = 2
EXPLORE_EVERY = 32


@dataclass(frozen=True)
class TierSpeed:
    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


class LoadCost:
    """Per tier speed from recent promotions; per engine prefill speed; the load-or-recompute decision.

    Args:
        policy: always / never / auto.
        block_tokens: tokens per offload block.
        block_bytes: bytes of one offload block, all groups (what a promotion of one block moves).
        prefill_tokens_per_s: the engine's prefill speed if the user knows it; else measured from its steps.
    """

    def __init__(self, policy: LoadPolicy, block_tokens: int, block_bytes: int,
                 prefill_tokens_per_s: float | None = None) -> None:
        self.policy = policy
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self._configured_tps = prefill_tokens_per_s
        self._samples: dict[Medium, deque[tuple[int, float]]] = {}
        self._step_tokens = 0
        self._step_seconds = 0.0
        self._declined: dict[Medium, int] = {}
        self.skipped_blocks = 0

    def observe_transfer(self, medium: Medium, nbytes: int, seconds: float) -> None:
        """A promotion from ``medium`` of ``nbytes`` finished successfully in ``seconds`` (ship to report)."""
        self._samples.setdefault(medium, deque(maxlen=WINDOW)).append((nbytes, max(seconds, 0.0)))

    def observe_step(self, prefill_tokens: int, seconds: float) -> None:
        """The engine computed ``prefill_tokens`` prompt tokens in a step that took ``seconds``."""
        if prefill_tokens > 0 and seconds > 0:
            self._step_tokens += prefill_tokens
            self._step_seconds += seconds

    @property
    def prefill_tokens_per_s(self) -> float | None:
        if self._configured_tps is not None:
            return self._configured_tps
        return self._step_tokens / self._step_seconds if self._step_seconds > 0 else None

    def speed(self, medium: Medium) -> TierSpeed | None:
        """The tier's recent latency and bandwidth (None: too few samples)."""
        samples = self._samples.get(medium)
        if samples is None or len(samples) < MIN_SAMPLES:
            return None
        return _fit(list(samples))

    def worth_loading(self, medium: Medium, blocks: int) -> bool:
        """Whether loading ``blocks`` offload blocks from ``medium`` is expected to beat recomputing them."""
        if self.policy is LoadPolicy.ALWAYS or blocks <= 0:
            return True
        if self.policy is LoadPolicy.NEVER:
            self.skipped_blocks += blocks
            return False
        speed, tps = self.speed(medium), self.prefill_tokens_per_s
        if speed is None or tps is None:
            return True  # nothing to compare yet: load, and learn the tier's speed
        if speed.seconds(blocks * self.block_bytes) < blocks * self.block_tokens / tps:
            return True
        declined = self._declined.get(medium, 0) + 1
        self._declined[medium] = declined
        if declined % EXPLORE_EVERY == 0:
            return True  # now and then anyway: the tier may have become fast again
        self.skipped_blocks += blocks
        return False


def _fit(samples: list[tuple[int, float]]) -> TierSpeed:
    """Least-squares ``seconds = latency + bytes / bandwidth``, both kept positive."""
    n = len(samples)
    mean_b = sum(b for b, _ in samples) / n
    mean_s = sum(s for _, s in samples) / n
    var = sum((b - mean_b) ** 2 for b, _ in samples)
    if var == 0:  # every job the same size: no slope to fit, all of it counts as bandwidth
        return TierSpeed(0.0, max(mean_b, 1.0) / max(mean_s, 1e-9))
    slope = sum((b - mean_b) * (s - mean_s) for b, s in samples) / var
    slope = max(slope, 1e-12)
    return TierSpeed(max(mean_s - slope * mean_b, 0.0), 1.0 / slope)
