"""KVOffloadStats: what a step's scheduler-side counters carry to vLLM's metrics."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.connector.stats import SchedulerStats
from kvoffload.integrations.vllm.metrics import KVOffloadStats


def test_failed_load_tokens_of_a_step_without_lookups_reach_the_stats() -> None:
    # A load fails steps after its request's lookup: its tokens must not wait for (or miss) a step with lookups.
    stats = KVOffloadStats.of(lookups=SchedulerStats(failed_load_tokens=64))
    assert not stats.is_empty() and stats.lookups.failed_load_tokens == 64
    assert KVOffloadStats.of(lookups=SchedulerStats(skipped_slow_tokens=32)).lookups.skipped_slow_tokens == 32
    assert KVOffloadStats.of(lookups=SchedulerStats()).is_empty()
