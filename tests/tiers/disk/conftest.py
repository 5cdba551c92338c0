"""The disk handler's tests take ``config``, a disk tier in the test's own directory (two I/O threads, a breaker
of three errors, a one-second read deadline, a small budget), and ``handler``, a handler of it over a fresh pool
(engine 0's slot file prepared)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.tiers.disk.handlers import BUDGET, ENTRY, NS, make_pool, prepare

from kvoffload.config import DiskTierConfig
from kvoffload.tiers.disk.handler import DiskHandler


@pytest.fixture
def config(tmp_path: Path) -> DiskTierConfig:
    return DiskTierConfig(path=tmp_path / "disk", io_threads=2, breaker_errors=3, breaker_cooldown_s=10.0,
                          read_deadline_s=1.0, capacity_bytes=BUDGET)


@pytest.fixture
def handler(config: DiskTierConfig) -> Iterator[DiskHandler]:
    prepare(config)  # the scheduler's part: the slot file
    h = DiskHandler(config, make_pool(), NS, ENTRY)
    yield h
    h.shutdown()
