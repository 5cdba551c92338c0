"""The remote tier in what vLLM sees: stats and metrics count its directions (its KV events: test_events.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.blocks import JobId, Medium
from kvoffload.connector.stats import TransferStats
from kvoffload.integrations.vllm.metrics import KVOffloadStats
from kvoffload.transfer.base import TransferResult


def test_remote_transfers_are_counted_per_direction() -> None:
    stats = TransferStats()
    stats.record(TransferResult(JobId(1), True, 100, 0.5, (Medium.HOST, Medium.REMOTE)))
    stats.record(TransferResult(JobId(2), False, 0, 0.1, (Medium.REMOTE, Medium.HOST)))
    reduced = KVOffloadStats.of(stats).aggregate(KVOffloadStats.of(stats)).reduce()
    assert reduced["host_to_remote_bytes"] == 200 and reduced["remote_to_host_failed_jobs"] == 2

