"""HostPool: shape, slot views, and clear errors for bad sizes."""

from __future__ import annotations

import pytest
import torch

from kvoffload.transfer.host_pool import HostPool, HostPoolAllocationError


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
