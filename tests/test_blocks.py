"""Media and block specs: the values that cross from the scheduler half to the worker half."""

from __future__ import annotations

import pickle

import pytest

from kvoffload.blocks import Medium, TierBlocks
from kvoffload.keys import OffloadKey


def test_a_medium_has_one_instance_per_name_also_after_pickling() -> None:
    mine = Medium("ramtier")
    assert Medium("ramtier") is mine and Medium("disk") is Medium.DISK
    assert pickle.loads(pickle.dumps(mine)) is mine
    assert pickle.loads(pickle.dumps((Medium.HOST, Medium.REMOTE))) == (Medium.HOST, Medium.REMOTE)
    assert mine != Medium.DISK and len({Medium.HOST, Medium("host"), mine}) == 2


@pytest.mark.parametrize("name", ["", "a b", "dísk", "a/b", "a-b"])
def test_a_medium_name_is_letters_digits_and_underscores(name: str) -> None:
    with pytest.raises(ValueError, match="medium"):
        Medium(name)


def test_a_medium_is_immutable() -> None:
    with pytest.raises(AttributeError):
        Medium.DISK.value = "remote"  # type: ignore[misc]
    assert Medium.DISK.value == "disk"


def test_tier_blocks_name_a_tier_under_host_by_key_with_a_slot_per_key_where_its_index_gives_one() -> None:
    keys = (OffloadKey(b"k" * 16), OffloadKey(b"l" * 16))
    spec = TierBlocks(Medium("ramtier"), keys, (2,), slots=(3, 4))
    assert spec.medium is Medium("ramtier")
    assert TierBlocks(Medium.DISK, keys, (2,)).slots == ()  # a tier named by key alone
    for medium in (Medium.DEVICE, Medium.HOST):
        with pytest.raises(ValueError, match="not a tier under host"):
            TierBlocks(medium, keys, (2,))
    with pytest.raises(ValueError, match="slots"):
        TierBlocks(Medium("ramtier"), keys, (2,), slots=(3,))
    with pytest.raises(ValueError, match="group_sizes"):
        TierBlocks(Medium("ramtier"), keys, (1,), slots=(3, 4))
