"""The remote tier in what vLLM sees: KV events name it apart from host and disk, stats and metrics count its
directions."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.blocks import JobId, Medium
from kvoffload.connector.stats import TransferStats
from kvoffload.index.base import EventKind, OffloadEvent
from kvoffload.integrations.vllm.events import MEDIUM_REMOTE, kv_events
from kvoffload.integrations.vllm.metrics import KVOffloadStats
from kvoffload.keys import OffloadKey
from kvoffload.transfer.base import TransferResult

KEY = OffloadKey(b"k" * 16)


def test_kv_events_name_the_remote_tier_apart_from_cpu_and_storage() -> None:
    events = [OffloadEvent(EventKind.STORED, (KEY,), medium) for medium in Medium.BUILT_IN]
    names = {medium: e.medium for medium, e in zip(Medium.BUILT_IN, kv_events(events, 16), strict=True)}
    assert names[Medium.REMOTE] == MEDIUM_REMOTE == "REMOTE"
    assert len(set(names.values())) == len(Medium.BUILT_IN)
    (removed,) = kv_events([OffloadEvent(EventKind.REMOVED, (KEY,), Medium.REMOTE)], 16)
    assert removed.medium == "REMOTE" and removed.block_hashes == [bytes(KEY)]


def test_remote_transfers_are_counted_per_direction() -> None:
    stats = TransferStats()
    stats.record(TransferResult(JobId(1), True, 100, 0.5, (Medium.HOST, Medium.REMOTE)))
    stats.record(TransferResult(JobId(2), False, 0, 0.1, (Medium.REMOTE, Medium.HOST)))
    reduced = KVOffloadStats.of(stats).aggregate(KVOffloadStats.of(stats)).reduce()
    assert reduced["host_to_remote_bytes"] == 200 and reduced["remote_to_host_failed_jobs"] == 2

