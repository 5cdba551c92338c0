"""The corrupted-load control zeroes a block the load really copies, whatever holes the load has."""

from __future__ import annotations

from kvoffload.blocks import NO_BLOCK, DeviceBlocks, HostBlocks
from kvoffload.transfer.faults import first_copied_slot


def test_a_load_without_holes_corrupts_its_first_slot() -> None:
    device = DeviceBlocks((5, 6, 7, 8), (4,))
    assert first_copied_slot(device, HostBlocks((20, 21), (2,)), factor=2) == 20


def test_leading_window_holes_move_the_corruption_to_the_first_copied_slot() -> None:
    """A sliding-window group dropped its first three engine blocks: the first copied one (k=3) is in slot 21."""
    device = DeviceBlocks((NO_BLOCK, NO_BLOCK, NO_BLOCK, 8), (4,))
    assert first_copied_slot(device, HostBlocks((20, 21), (2,)), factor=2) == 21


def test_skipped_sub_blocks_shift_the_pairing() -> None:
    """The engine holds the first sub-block of slot 20: entry 0 pairs with its second, entry 1 with slot 21."""
    device = DeviceBlocks((NO_BLOCK, 9), (2,))
    assert first_copied_slot(device, HostBlocks((20, 21), (2,), skip_sub_blocks=1), factor=2) == 21


def test_a_group_of_holes_passes_the_corruption_to_the_next_group() -> None:
    device = DeviceBlocks((NO_BLOCK, NO_BLOCK, 4, 5), (2, 2))
    assert first_copied_slot(device, HostBlocks((10, 11), (1, 1)), factor=2) == 11


def test_a_load_of_holes_only_corrupts_nothing() -> None:
    assert first_copied_slot(DeviceBlocks((NO_BLOCK,), (1,)), HostBlocks((3,), (1,)), factor=1) is None
