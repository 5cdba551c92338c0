"""What the remote handler's tests build jobs and handlers with: keys, a host pool of random bytes, a config with a
small breaker, store and load jobs, running one to its result, a slot's bytes, and counting warnings."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from tests.tiers.jobs import Groups, TierJobs, run

from kvoffload.blocks import Medium
from kvoffload.config import RemoteTierConfig
from kvoffload.keys import Namespace, OffloadKey, offload_key
from kvoffload.tiers.remote.handler import RemoteHandler
from kvoffload.transfer.host_pool import HostPool

NS = Namespace(model="m", dtype="bf16", layout="pages=64")
ENTRY = (48, 32)  # two KV-cache groups with different block sizes
SLOT = 64


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, salt: int = 0) -> tuple[OffloadKey, ...]:
    return tuple(offload_key(bytes([salt, i]) * 8, 0) for i in range(n))  # type: ignore[arg-type]


def make_pool(slots: int = 16) -> HostPool:
    pool = HostPool(slots, SLOT)
    pool.buffer.copy_(torch.randint(-128, 128, (slots, SLOT), dtype=torch.int8))
    return pool


def make_config(url: str, **changes: Any) -> RemoteTierConfig:
    return dataclasses.replace(RemoteTierConfig(urls=(url,), breaker_errors=3, breaker_cooldown_s=10.0), **changes)


__all__ = ["Groups", "load", "run", "store"]  # the shared job builders, bound to this tier (tests/tiers/jobs.py)

_jobs = TierJobs(Medium.REMOTE)
store, load = _jobs.store, _jobs.load


def row(handler: RemoteHandler, slot: int, nbytes: int = ENTRY[0]) -> bytes:
    return bytes(handler._slots[slot, :nbytes])


class Handler:
    """A handler over a fresh pool, shut down on exit."""

    def __init__(self, config: RemoteTierConfig, ns: Namespace = NS, **kwargs: Any) -> None:
        self.handler = RemoteHandler(config, make_pool(), ns, ENTRY, **kwargs)

    def __enter__(self) -> RemoteHandler:
        return self.handler

    def __exit__(self, *exc: object) -> None:
        self.handler.shutdown()


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return len([r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()])
