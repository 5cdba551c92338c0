"""The retention series on vLLM's ``/metrics`` (docs/sessions.md, docs/metrics.md):

    vllm:kvoffload_retention_hints_total{outcome}        hints received (received), capped to max_retain_s
                                                         (capped: also counted as received), ignored as bad
    vllm:kvoffload_retained_bytes{tier}                  bytes of retained blocks in each tier (gauge)
    vllm:kvoffload_retained_hit_blocks_total{tier}       uses of retained blocks (a load of one, from that tier)
    vllm:kvoffload_retained_demoted_blocks_total{tier}   retained blocks made ordinary: the tier's share was full
    vllm:kvoffload_retained_evicted_blocks_total{tier}   retained blocks evicted (every unretained one had gone)

Built only with hints on (``max_retain_s`` above 0). Labels are bounded: three outcomes, the configured tiers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.connector.stats import RetentionFigures
from kvoffload.tiers.stack import tier_specs

OUTCOMES = ("received", "capped", "ignored")


class RetentionMetrics:
    """The series above, made with the stat logger's own metric classes."""

    def __init__(self, counter: Any, gauge: Any, labelnames: list[str]) -> None:
        self.hints: Any = counter(name="vllm:kvoffload_retention_hints",
                                  documentation="Retention hints: received, capped to max_retain_s, ignored as bad.",
                                  labelnames=[*labelnames, "outcome"])
        self.retained: Any = gauge(name="vllm:kvoffload_retained_bytes",
                                   documentation="Bytes of retained blocks in each tier.",
                                   multiprocess_mode="mostrecent", labelnames=[*labelnames, "tier"])
        self.blocks: list[Any] = [counter(name=f"vllm:kvoffload_retained_{what}_blocks", documentation=doc,
                                          labelnames=[*labelnames, "tier"])
                                  for what, doc in (("hit", "Uses of retained blocks, per tier."),
                                                    ("demoted", "Retained blocks made ordinary: the share was full."),
                                                    ("evicted", "Retained blocks evicted, per tier."))]

    def start_at_zero(self, engines: Iterable[list[object]], config: OffloadConfig) -> None:
        tiers = ["host", *(spec.medium.value for spec in tier_specs(config))]
        for labels in engines:
            for outcome in OUTCOMES:
                self.hints.labels(*labels, outcome)
            for tier in tiers:
                self.retained.labels(*labels, tier).set(0)
                for metric in self.blocks:
                    metric.labels(*labels, tier)

    def observe(self, labels: list[object], figures: RetentionFigures) -> None:
        for outcome, value in zip(OUTCOMES, figures.hints, strict=True):
            if value:
                self.hints.labels(*labels, outcome).inc(value)
        for tier, (retained, *counts) in figures.tiers.items():
            self.retained.labels(*labels, tier).set(retained)
            for metric, value in zip(self.blocks, counts, strict=True):
                if value:
                    metric.labels(*labels, tier).inc(value)
