"""Tiers from other packages: the ``kvoffload.tiers`` entry point group.

A package adds a tier by naming a factory in its metadata::

    [project.entry-points."kvoffload.tiers"]
    mytier = "my_package.tier:MyTierSpec"

and a user turns it on with ``extra_tiers: {"mytier": {...options...}}``. The factory is called with the options
as a dict and returns a ``TierSpec`` (a spec class whose ``__init__`` takes the options does); it raises
``ValueError`` (or ``ConfigError``) naming a bad option. The conformance suites in ``kvoffload.testing`` are for
its author (tests/tiers/plugin/ runs them on a tier registered this way).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.config import ConfigError, PluginTierConfig
from kvoffload.tiers.spec import TierSpec

GROUP = "kvoffload.tiers"

TierFactory = Callable[[Mapping[str, Any]], TierSpec]


def installed_tiers() -> dict[str, importlib.metadata.EntryPoint]:
    """The tiers other packages registered, by name (the first of two of one name)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=GROUP):
        found.setdefault(entry.name, entry)
    return found


def plugin_spec(config: PluginTierConfig) -> TierSpec:
    """The spec of one ``extra_tiers`` entry.

    Raises:
        ConfigError: no installed package registers the tier, its factory cannot be loaded, it refuses the
            options, or it returns no ``TierSpec``; the message names the tier.
    """
    where = f"extra_tiers.{config.name}"
    entries = installed_tiers()
    entry = entries.get(config.name)
    if entry is None:
        known = ", ".join(sorted(entries)) or "none"
        raise ConfigError(f"{where}: no installed package registers a tier of that name in the {GROUP!r} entry "
                          f"point group (installed: {known})")
    try:
        factory: TierFactory = entry.load()
    except Exception as e:  # a broken plug-in must name itself, not fail the engine with its traceback
        raise ConfigError(f"{where}: cannot load {entry.value}: {type(e).__name__}: {e}") from e
    try:
        spec = factory(config.option_map())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from e
    if not isinstance(spec, TierSpec):
        raise ConfigError(f"{where}: {entry.value} returned {type(spec).__name__}, not a TierSpec")
    return spec
