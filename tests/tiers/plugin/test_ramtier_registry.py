"""The ram tier through the registry, as a user turns it on: ``extra_tiers`` names it, the entry point its package
registered makes its spec, and a tier nobody registered or an option it refuses is a ``ConfigError`` naming
``extra_tiers.<name>``."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

from kvoffload.blocks import Medium
from kvoffload.config import ConfigError, OffloadConfig
from kvoffload.index.tiered import TieredIndex
from kvoffload.keys import Namespace
from kvoffload.testing import layouts
from kvoffload.tiers import stack
from kvoffload.tiers.registry import GROUP, installed_tiers
from kvoffload.tiers.spec import TierContext
from kvoffload.transfer.host_pool import HostPool


def config(**options: Any) -> OffloadConfig:
    return OffloadConfig.from_dict({"host_bytes": 1 << 20, "extra_tiers": {"ramtier": options}})


def context() -> TierContext:
    layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
    return TierContext(Namespace(model="m", dtype="int8", layout="sim"), layout, 1)


def test_without_the_package_installed_the_tier_is_unknown() -> None:
    assert "ramtier" not in installed_tiers()
    with pytest.raises(ConfigError, match=r"extra_tiers\.ramtier: no installed package registers"):
        stack.tier_specs(config(capacity_blocks=64))


def test_extra_tiers_gives_the_registered_spec(ramtier_installed: Path) -> None:
    assert [e.value for e in importlib.metadata.entry_points(group=GROUP) if e.name == "ramtier"] == \
        ["ramtier.spec:RamTierSpec"]
    (spec,) = stack.tier_specs(config(capacity_blocks=64))
    from ramtier.spec import RamTierOptions, RamTierSpec

    assert isinstance(spec, RamTierSpec) and spec.options == RamTierOptions(64)
    assert spec.medium == Medium("ramtier") and not spec.shared_by_ranks
    assert stack.transfer_routes(config(capacity_blocks=64))[2:] == ((Medium.HOST, Medium("ramtier")),
                                                                      (Medium("ramtier"), Medium.HOST))


def test_both_halves_are_built_from_the_spec(ramtier_installed: Path) -> None:
    ctx = context()
    index = stack.build_index(config(capacity_blocks=16), ctx)
    assert isinstance(index, TieredIndex) and index.lower_indexes[0].medium == Medium("ramtier")
    assert index.usage()[1].capacity_blocks == 16
    pool = HostPool(8, max(ctx.entry_bytes))
    ((routes, handler),) = stack.build_handlers(config(capacity_blocks=16), ctx, pool)
    from ramtier.handler import RamHandler

    assert isinstance(handler, RamHandler) and routes == ((Medium.HOST, Medium("ramtier")),
                                                          (Medium("ramtier"), Medium.HOST))
    handler.shutdown()


def test_an_unknown_tier_name_is_a_config_error_naming_it(ramtier_installed: Path) -> None:
    raw = {"host_bytes": 1 << 20, "extra_tiers": {"nosuchtier": {}}}
    with pytest.raises(ConfigError, match=r"extra_tiers\.nosuchtier: .*\(installed: ramtier\)"):
        stack.tier_specs(OffloadConfig.from_dict(raw))


@pytest.mark.parametrize(("options", "named"), [
    ({}, "capacity_blocks"),
    ({"capacity_blocks": 0}, "capacity_blocks"),
    ({"capacity_blocks": "many"}, "capacity_blocks"),
    ({"capacity_blocks": True}, "capacity_blocks"),
    ({"capacity_blocks": 8, "corrupt_loads": "yes"}, "corrupt_loads"),
    ({"capacity_blocks": 8, "capacity": 8}, "'capacity'"),
])
def test_a_bad_option_is_a_config_error_naming_the_tier_and_option(options: dict[str, Any], named: str,
                                                                   ramtier_installed: Path) -> None:
    with pytest.raises(ConfigError, match=r"extra_tiers\.ramtier: ") as raised:
        stack.tier_specs(config(**options))
    assert named in str(raised.value)


def test_a_factory_that_cannot_be_loaded_is_a_config_error_naming_the_tier(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.tiers.plugin.conftest import write_distribution

    write_distribution(tmp_path, "ramtier = ramtier.nosuchmodule:Spec")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"extra_tiers\.ramtier: cannot load ramtier\.nosuchmodule:Spec"):
        stack.tier_specs(config(capacity_blocks=8))
