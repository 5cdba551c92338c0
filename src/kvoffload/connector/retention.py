"""The scheduler half's retention hints (docs/sessions.md): each request's hint read once, the keys of hinted
requests held on the tiers' shared ``RetentionBook``, and the figures shipped with the step's stats.

The hint is ``{"kvoffload": {"retain_s": N}}`` in the request's ``kv_transfer_params`` (vLLM's OpenAI server
forwards that field of the request body). A hinted request's prompt blocks are held when it is first looked up
(blocks an earlier turn left in a tier are kept from then on, and the prompt's new blocks as they are stored),
and its output's blocks when it finishes (its prompt's again if it ran longer than ``REFRESH_SHARE`` of its hint):
the pause the hint covers starts when the answer is sent. A bad hint is ignored, counted and warned about once per
engine; it never fails a request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvoffload.config import RetentionConfig
from kvoffload.connector.stats import RetentionFigures
from kvoffload.index.retention import RetentionBook

if TYPE_CHECKING:
    from kvoffload.connector.requests import EngineRequest, RequestState

logger = logging.getLogger(__name__)

HINT_KEY = "kvoffload"
"""kvoffload's entry in a request's ``kv_transfer_params``."""
RETAIN_S = "retain_s"
REFRESH_SHARE = 0.05
"""A finished request's prompt blocks are held again only if it ran longer than this share of its hint."""


class SchedulerRetention:
    """Hints read, keys held, figures kept.

    Args:
        config: the deployment's caps.
        book: the book every tier's retention was built on.
        block_bytes: bytes of one offload block (a host slot), for retained bytes.
    """

    def __init__(self, config: RetentionConfig, book: RetentionBook, block_bytes: int) -> None:
        self.max_retain_s = config.max_retain_s
        self.book = book
        self._block_bytes = block_bytes
        self._hints = [0, 0, 0]  # received, capped, ignored: since the last take
        self._warned = False
        self._reported: dict[str, tuple[int, int, int]] = {}
        self._bytes: dict[str, int] = {}
        """Each tier's retained bytes in the last figures (a gauge going back to 0 is news too)."""

    def retain_s(self, request: EngineRequest) -> float | None:
        """The seconds ``request`` asks its blocks to be kept (capped), or None: no hint, a zero one, or a bad one
        (ignored: counted, and warned about the first time)."""
        params = request.kv_transfer_params
        raw = params.get(HINT_KEY) if isinstance(params, Mapping) else None
        if raw is None:
            return None
        problem = hint_problem(raw)
        if problem is not None:
            self._hints[2] += 1
            if not self._warned:
                self._warned = True
                logger.warning("kvoffload: ignoring the retention hint %.200r of request %s: %s (warned once; "
                               "later ones are counted in vllm:kvoffload_retention_hints_total)", raw,
                               request.request_id, problem)
            return None
        self._hints[0] += 1
        seconds = float(raw[RETAIN_S])
        if seconds > self.max_retain_s:
            self._hints[1] += 1
            seconds = self.max_retain_s
        return seconds or None

    def hold_prompt(self, state: RequestState, num_blocks: int, groups: range) -> None:
        """At the hinted request's first lookup: hold its prompt's first ``num_blocks`` offload blocks in every
        group until its hint runs out, counted from now."""
        state.held_at = self.book.clock()
        self._hold(state, 0, num_blocks, groups)

    def hold_finished(self, state: RequestState, prompt_blocks: int, num_blocks: int, groups: range) -> None:
        """The hinted request finished with ``num_blocks`` full blocks: hold them until its hint runs out, counted
        from now. The prompt's blocks only when the request ran longer than ``REFRESH_SHARE`` of its hint: else
        their deadline is already within that share of the new one, and holding a long prompt's keys again cost
        more than the rest of the finish step (bench overhead: 3.5x with every other request hinted)."""
        held_at, retain_s = state.held_at, state.retain_s
        recent = held_at is not None and retain_s is not None and \
            self.book.clock() - held_at <= REFRESH_SHARE * retain_s
        self._hold(state, prompt_blocks if recent else 0, num_blocks, groups)

    def _hold(self, state: RequestState, first: int, end: int, groups: range) -> None:
        retain_s = state.retain_s
        if retain_s is None or end <= first:
            return
        keys = [key for g in groups for key in state.keys(first, end, g)]
        self.book.hold(keys, self.book.clock() + retain_s)

    def take_figures(self) -> RetentionFigures | None:
        """Hints since the last call, and each tier's retained bytes and counts (None: nothing changed)."""
        hints, self._hints = self._hints, [0, 0, 0]
        tiers: dict[str, list[int]] = {}
        for tier in self.book.tiers:
            counts = tier.counts()
            now = (counts.hits, counts.demoted, counts.evicted)
            before = self._reported.get(tier.tier, (0, 0, 0))
            self._reported[tier.tier] = now
            tiers[tier.tier] = [tier.retained() * self._block_bytes, *(a - b for a, b in zip(now, before,
                                                                                               strict=True))]
        retained = {tier: v[0] for tier, v in tiers.items()}
        moved = any(value != self._bytes.get(tier, 0) for tier, value in retained.items())
        self._bytes = retained
        if not any(hints) and not moved and not any(any(v[1:]) for v in tiers.values()):
            return None
        return RetentionFigures(hints, tiers)


def hint_problem(raw: Any) -> str | None:
    """Why ``raw`` (the value of ``kv_transfer_params["kvoffload"]``) is not a retention hint, or None if it is."""
    if not isinstance(raw, Mapping):
        return f"expected a mapping such as {{\"{RETAIN_S}\": 600}}, got {type(raw).__name__}"
    unknown = sorted(str(k) for k in raw if k != RETAIN_S)
    if unknown:
        return f"unknown key(s) {', '.join(unknown)[:200]} (known: {RETAIN_S})"
    if RETAIN_S not in raw:
        return f"no {RETAIN_S}"
    value = raw[RETAIN_S]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{RETAIN_S} must be a number of seconds, got {type(value).__name__}"
    if not math.isfinite(value) or value < 0:
        return f"{RETAIN_S} must be a finite number of seconds >= 0"
    return None


def make_retention(config: RetentionConfig | None, book: RetentionBook | None,
                   block_bytes: int) -> SchedulerRetention | None:
    """The scheduler's retention when hints are on and its tiers were built on ``book``."""
    if config is None or book is None:
        return None
    return SchedulerRetention(config, book, block_bytes)


__all__ = ["HINT_KEY", "REFRESH_SHARE", "RETAIN_S", "SchedulerRetention", "hint_problem", "make_retention"]
