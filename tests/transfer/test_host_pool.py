"""HostPool: shape, slot views, clear errors for bad sizes, and which pools have their pages populated."""

from __future__ import annotations

import functools
import gc
import threading
import weakref

import pytest
import torch
from tests.transfer.pages import gated, resident_share

from kvoffload.transfer import warm_pages
from kvoffload.transfer.host_pool import HostPool, HostPoolAllocationError
from kvoffload.transfer.warm_pages import WarmState

SLOT = 1 << 20
SLOTS = 64  # 64 MiB: a fresh mapping of never-touched pages


def test_pool_is_one_int8_buffer_of_slots() -> None:
    pool = HostPool(num_slots=4, slot_bytes=128)
    assert pool.buffer.shape == (4, 128)
    assert pool.buffer.dtype == torch.int8
    assert pool.nbytes == 512


def test_slot_is_a_view_that_writes_the_buffer() -> None:
    pool = HostPool(3, 16)
    pool.slot(2).fill_(7)
    assert torch.all(pool.buffer[2] == 7)
    assert pool.slot(2).data_ptr() == pool.buffer.data_ptr() + 2 * 16


@pytest.mark.parametrize("index", [-1, 3])
def test_slot_out_of_range_names_the_slot(index: int) -> None:
    with pytest.raises(ValueError, match=f"slot {index}"):
        HostPool(3, 16).slot(index)


@pytest.mark.parametrize(("num_slots", "slot_bytes", "culprit"), [(0, 16, "num_slots"), (2, -1, "slot_bytes")])
def test_non_positive_sizes_are_rejected(num_slots: int, slot_bytes: int, culprit: str) -> None:
    with pytest.raises(ValueError, match=culprit):
        HostPool(num_slots, slot_bytes)


def test_impossible_allocation_names_the_size() -> None:
    with pytest.raises(HostPoolAllocationError, match=str(1 << 62)):
        HostPool(1 << 32, 1 << 30)


def test_pin_memory_without_cuda_gives_an_unpinned_pool() -> None:
    pool = HostPool(2, 16, pin_memory=True)
    assert pool.pinned == torch.cuda.is_available()


def test_a_private_pool_is_resident_from_the_start() -> None:
    pool = HostPool(SLOTS, SLOT)
    assert pool.warming is not None and pool.warming.wait(10)
    assert pool.warming.state is WarmState.WARM
    assert resident_share(pool.buffer) == 1.0


def test_a_pool_asked_not_to_warm_stays_cold() -> None:
    pool = HostPool(SLOTS, SLOT, warm=False)
    assert pool.warming is None
    assert resident_share(pool.buffer) < 0.01


def test_a_pool_over_a_callers_buffer_leaves_its_pages_alone() -> None:
    buffer = torch.empty((SLOTS, SLOT), dtype=torch.int8)
    pool = HostPool(SLOTS, SLOT, buffer=buffer)
    assert pool.warming is None
    assert resident_share(buffer) < 0.01


def test_a_pinned_pool_is_not_warmed() -> None:
    pool = HostPool(2, 4096, pin_memory=True)
    assert (pool.warming is None) == pool.pinned


def test_a_pool_dropped_while_warming_stops_its_thread_and_frees_its_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release, calls = threading.Event(), []
    monkeypatch.setattr(warm_pages, "warm", functools.partial(
        warm_pages.warm, sync_budget_s=0, chunk_bytes=SLOT, madvise=gated(release, calls)))
    pool = HostPool(SLOTS, SLOT)
    warming, buffer = pool.warming, weakref.ref(pool.buffer)
    assert warming is not None and warming.in_background
    del pool
    gc.collect()
    assert buffer() is not None  # the thread, inside a call, still holds it
    release.set()
    assert warming.wait(10)
    assert warming.state is WarmState.STOPPED and calls == [SLOT]
    assert buffer() is None
