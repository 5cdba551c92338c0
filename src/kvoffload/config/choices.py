"""The configuration's named choices: each key whose value is one of a few names parses to one of these enums.

``kvoffload.config`` re-exports them; import them from there.
"""

from __future__ import annotations

import enum


class EvictionPolicy(enum.Enum):
    """Which resident block a tier gives up first (index/policies/; docs/configuration.md compares them)."""

    LRU = "lru"
    ARC = "arc"
    S3FIFO = "s3fifo"
    """S3-FIFO: blocks used once leave through a small FIFO; scan- and loop-resistant."""
    TINYLFU = "tinylfu"
    """W-TinyLFU: a block leaving a small LRU window enters the main LRU only if used more often than its victim."""
    ADAPTIVE = "adaptive"
    """One of the four above at a time, whichever shadow tiers of each show the recent traffic rewards (with its
    store admission; index/admission.py)."""


class StoreAdmission(enum.Enum):
    """Which full blocks the connector stores (index/admission.py)."""

    ALL = "all"
    """Every full block."""
    SECOND_SIGHTING = "second-sighting"
    """A block the second time its key is offered for storing, within a bounded memory of recent keys."""
    ADAPTIVE = "adaptive"
    """Every block or second sightings, whichever shadow tiers of both show the recent traffic rewards."""


class LoadPolicy(enum.Enum):
    """When blocks that only a tier below host holds are loaded (connector/load_cost.py)."""

    AUTO = "auto"
    """When the tier's recent speed says loading beats recomputing their tokens."""
    ALWAYS = "always"
    NEVER = "never"
    """Lower tiers are written, never read back (e.g. to warm a shared tier for other engines)."""


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"
    """Every block stored to host is also written to disk."""
    ON_EVICT = "on_evict"
    """Only blocks evicted from host are written to disk."""


class HostScope(enum.Enum):
    """Whose host pool a block lands in (docs/node.md)."""

    PRIVATE = "private"
    """Each engine's own pool, in its workers' memory."""
    NODE = "node"
    """One pool in shared memory that every engine of the same namespace on this machine uses (tiers/node/)."""


class TenantBy(enum.Enum):
    """Who a request's tenant is, for tenants' shares of the host tier (docs/tenants.md)."""

    NONE = "none"
    """No tenants: one pool, as before tenants existed."""
    CACHE_SALT = "cache_salt"
    """The request's cache salt; requests without one are the shared tenant."""
    LORA = "lora"
    """The request's LoRA adapter name; requests without one are the shared tenant."""
