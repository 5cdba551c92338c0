"""Sizing the tiers from the configuration (both halves call these)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.config import ConfigError, OffloadConfig
from kvoffload.keys import Namespace
from kvoffload.testing import layouts
from kvoffload.tiers import sizing
from kvoffload.tiers.host.spec import PrivateHostSpec
from kvoffload.tiers.sizing import host_num_slots
from kvoffload.tiers.spec import TierContext


def test_a_private_host_tier_larger_than_the_available_memory_is_a_config_error_naming_host_bytes() -> None:
    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    config = OffloadConfig.from_dict({"host_bytes": 1 << 60})
    with pytest.raises(ConfigError, match=r"host_bytes.*MemAvailable"):
        PrivateHostSpec(config).num_slots(TierContext(Namespace("m", "int8", "t"), layout, 1))
    assert host_num_slots(config, layout, 1) > 0  # a node pool's sizing leaves MemAvailable to making its files


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


def cgroup_tree(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup of one line and a /sys/fs/cgroup holding ``files`` (path: content)."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(proc_line + "\n")
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text + "\n")
    return proc, cgroups


@pytest.mark.parametrize(("proc_line", "files", "limit"), [
    ("0::/a/b", {"a/memory.max": "1000", "a/b/memory.max": "max"}, 1000),  # v2: an ancestor's limit binds
    ("0::/a/b", {"memory.max": "max", "a/b/memory.max": "max"}, None),
    ("4:memory:/x/y", {"memory/memory.limit_in_bytes": "5000"}, 5000),  # v1 in a cgroup namespace: the root
    ("4:memory:/x/y", {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),  # v1's "no limit"
    ("garbage", {}, None),
], ids=["v2-ancestor", "v2-none", "v1-namespaced", "v1-unlimited", "unreadable"])
def test_the_container_memory_limit_is_the_lowest_of_the_cgroup_and_its_ancestors(
        tmp_path: Path, proc_line: str, files: dict[str, str], limit: int | None) -> None:
    assert sizing.container_memory_limit(*cgroup_tree(tmp_path, proc_line, files)) == limit


def test_no_proc_means_no_known_limit(tmp_path: Path) -> None:
    assert sizing.container_memory_limit(tmp_path / "none", tmp_path / "none") is None


@pytest.mark.parametrize("scope", [{}, {"host_scope": "node"}], ids=["private", "node"])
def test_a_pool_over_the_container_memory_limit_is_a_config_error_naming_host_bytes(
        monkeypatch: pytest.MonkeyPatch, scope: dict[str, str]) -> None:
    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    slot = layout.group_block_bytes(0)
    monkeypatch.setattr(sizing, "container_memory_limit", lambda: 10 * slot)
    with pytest.raises(ConfigError, match=rf"host_bytes/host_gib: .*memory limit \({10 * slot} bytes"):
        host_num_slots(OffloadConfig.from_dict({"host_bytes": 10 * slot, **scope}), layout, 1)
    assert host_num_slots(OffloadConfig.from_dict({"host_bytes": 9 * slot, **scope}), layout, 1) == 9
