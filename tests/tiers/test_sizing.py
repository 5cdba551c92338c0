"""Sizing the tiers from the configuration (both halves call these)."""

from __future__ import annotations

import pytest

from kvoffload.config import ConfigError, OffloadConfig
from kvoffload.testing import layouts
from kvoffload.tiers.sizing import host_num_slots


def test_a_host_tier_larger_than_the_available_memory_is_a_config_error_naming_host_bytes() -> None:
    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    config = OffloadConfig.from_dict({"host_bytes": 1 << 60})
    with pytest.raises(ConfigError, match=r"host_bytes.*MemAvailable"):
        host_num_slots(config, layout, 1)


def test_a_host_tier_that_fits_in_memory_is_sized_in_slots() -> None:
    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    slot = layout.group_block_bytes(0)
    assert host_num_slots(OffloadConfig.from_dict({"host_bytes": 10 * slot}), layout, 1) == 10


def test_a_host_tier_below_one_slot_is_a_config_error_naming_the_key_and_the_least_size() -> None:
    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    slot = layout.group_block_bytes(0)
    with pytest.raises(ConfigError, match=rf"host_bytes/host_gib: .* below one offload block .* host_bytes={slot}"):
        host_num_slots(OffloadConfig.from_dict({"host_bytes": slot - 1}), layout, 1)
    assert host_num_slots(OffloadConfig.from_dict({"host_bytes": slot}), layout, 1) == 1
