"""The tiers, one folder each, the one place both halves assemble them, and what a tier from another package uses.

- ``spec``: ``TierSpec``, which binds a tier under host: its configuration section -> its index (scheduler side),
  its handler (worker side) and its copy routes; ``HostSpec``, which binds the host tier; ``TierContext``, what a
  tier is made for.
- ``stack``: the host spec and the configured specs, in lookup order, and the assembly of both halves from them.
- ``registry``: tiers from other packages (the ``kvoffload.tiers`` entry point group, key ``extra_tiers``).
- ``sizing``: the host tier's slot count and the layout's entry sizes, which both halves must agree on.
- ``lower/``: what every tier under host shares (block format and codec, breaker, I/O threads, handler skeleton,
  directory trust).
- ``host/`` (private) and ``node/`` (the node pool): the host tier's two specs; ``disk/``, ``remote/``, ``object/``:
  kvoffload's own tiers under host, each with its ``spec``, ``index`` and ``handler``.

A tier from another package imports everything it needs from here, one import (``from kvoffload.tiers import
TierSpec, TierBlocks, ...``): ``PLUGIN_SURFACE`` lists it. Each name loads its module when first asked for, so a
tier's scheduler half that names only scheduler-side types never loads torch (``HostPool`` does).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

PLUGIN_SURFACE: dict[str, str] = {
    # binding the tier
    "TierSpec": "kvoffload.tiers.spec", "TierContext": "kvoffload.tiers.spec", "ConfigError": "kvoffload.config",
    "EvictionPolicy": "kvoffload.config",
    # what jobs move
    "Medium": "kvoffload.blocks", "TierBlocks": "kvoffload.blocks", "HostBlocks": "kvoffload.blocks",
    "BlockSpec": "kvoffload.blocks", "TransferJob": "kvoffload.blocks", "JobId": "kvoffload.blocks",
    "OffloadKey": "kvoffload.keys",
    # the scheduler side: the index
    "LowerIndex": "kvoffload.index.base", "LookupResult": "kvoffload.index.base",
    "PrepareStoreOutput": "kvoffload.index.base", "OffloadEvent": "kvoffload.index.base",
    "EventKind": "kvoffload.index.base", "TierUsage": "kvoffload.index.base", "SlotIndex": "kvoffload.index.slot_index",
    "Policy": "kvoffload.index.policies.base",
    # a store only its server knows the contents of, asked off the engine step
    "ProbedIndex": "kvoffload.tiers.lower.probed_index", "StoreProbe": "kvoffload.tiers.lower.probed_index",
    # the worker side: the handler
    "TransferHandler": "kvoffload.transfer.base", "TransferResult": "kvoffload.transfer.base",
    "HandlerWrapper": "kvoffload.transfer.base", "HostPool": "kvoffload.transfer.host_pool",
}
"""Each name a tier from another package may use -> the module that defines it."""

__all__ = ["BlockSpec", "ConfigError", "EventKind", "EvictionPolicy", "HandlerWrapper", "HostBlocks", "HostPool",
           "JobId", "LookupResult", "LowerIndex", "Medium", "OffloadEvent", "OffloadKey", "Policy",
           "PrepareStoreOutput", "ProbedIndex", "SlotIndex", "StoreProbe", "TierBlocks", "TierContext", "TierSpec",
           "TierUsage", "TransferHandler", "TransferJob", "TransferResult"]  # PLUGIN_SURFACE's names


def __getattr__(name: str) -> Any:
    module = PLUGIN_SURFACE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload.tiers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


if TYPE_CHECKING:
    from kvoffload.blocks import BlockSpec, HostBlocks, JobId, Medium, TierBlocks, TransferJob
    from kvoffload.config import ConfigError, EvictionPolicy
    from kvoffload.index.base import (
        EventKind,
        LookupResult,
        LowerIndex,
        OffloadEvent,
        PrepareStoreOutput,
        TierUsage,
    )
    from kvoffload.index.slot_index import SlotIndex
    from kvoffload.keys import OffloadKey
    from kvoffload.tiers.lower.probed_index import ProbedIndex, StoreProbe
    from kvoffload.tiers.spec import TierContext, TierSpec
    from kvoffload.transfer.base import HandlerWrapper, TransferHandler, TransferResult
    from kvoffload.transfer.host_pool import HostPool
