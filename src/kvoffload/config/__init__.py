"""kvoffload's configuration: the one typed tree, and the only code that reads untyped configuration.

Import what you need from here (``from kvoffload.config import OffloadConfig``); the modules, in reading order:

- ``offload.py``: ``OffloadConfig``, the tree's root, and ``OffloadConfig.from_dict``, which validates the engine's
  flat ``{key: value}`` dict and raises one ``ConfigError`` naming every problem; ``KEYS`` (each key's parser and
  help, the source of docs/configuration.md's table) and ``FAULT_KEYS``;
- ``tiers.py``: the tree's typed sections, one per tier (``HostTierConfig`` with its ``NodeTierConfig``,
  ``DiskTierConfig``, ``RemoteTierConfig``, ``ObjectTierConfig``, ``PluginTierConfig``) and ``TenantConfig``;
- ``choices.py``: the named choices (``EvictionPolicy``, ``WritePolicy``, ``LoadPolicy``, ``StoreAdmission``,
  ``HostScope``, ``TenantBy``);
- ``values.py``: the parsers of single values (ranges, sizes, paths, URLs, groups) that ``KEYS`` names;
- ``secrets.py``: the parsers of the tier secret and the remote tier's password (files, environment variables).

Inside this package the modules import each other directly, never through this file.
"""

from kvoffload.config.choices import EvictionPolicy, HostScope, LoadPolicy, StoreAdmission, TenantBy, WritePolicy
from kvoffload.config.offload import FAULT_KEYS, KEYS, ConfigError, OffloadConfig
from kvoffload.config.tiers import (
    DEFAULT_NODE_PATH,
    DiskTierConfig,
    HostTierConfig,
    NodeTierConfig,
    ObjectTierConfig,
    PluginTierConfig,
    RemoteTierConfig,
    RetentionConfig,
    TenantConfig,
)
from kvoffload.config.values import GIB, REMOTE_SCHEMES

__all__ = ["DEFAULT_NODE_PATH", "FAULT_KEYS", "GIB", "KEYS", "REMOTE_SCHEMES", "ConfigError", "DiskTierConfig",
           "EvictionPolicy", "HostScope", "HostTierConfig", "LoadPolicy", "NodeTierConfig", "ObjectTierConfig",
           "OffloadConfig", "PluginTierConfig", "RemoteTierConfig", "RetentionConfig", "StoreAdmission", "TenantBy",
           "TenantConfig", "WritePolicy"]
