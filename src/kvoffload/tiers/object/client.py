"""The object tier's connection and object names, shared by both halves (no torch here).

Both the scheduler's ``ObjectIndex`` (existence searches, deletes of its own objects) and every worker's
``ObjectHandler`` (the objects themselves) make their client with ``connect(config)``: boto3's low-level S3 client,
which is thread-safe, so one client serves every request thread of a process. Why boto3: it is the reference
client of the API (every S3-compatible server is tested against it), it takes credentials from the standard chain
(environment, shared files, SSO, instance and pod roles) and refreshes expiring ones, and on this machine it runs
1 MiB and 4 MiB objects at the server's speed from a thread pool (docs/object.md has the figures). Its retries are
off: a failed request is a failed job (a recompute, or a skipped store), never seconds of backoff on a step.

Objects are named ``<prefix>/kvoffload/<world>/r<rank>/<name>``: ``world`` and ``name`` are
``BlockFormat.world_name`` / ``BlockFormat.name`` (the chain root and the key, or keyed by the tier secret, so that
nobody without the secret can tell which prompt an object belongs to), and a replicated namespace's one copy is
under ``rep`` instead of ``r<rank>``. One bucket safely holds several models and deployments.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from kvoffload.config import ConfigError, ObjectTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.block_format import BlockFormat

PREFIX = "kvoffload"
NAME_CACHE = 1 << 15
"""Keys whose object names are remembered: a secret's keyed names cost about 8 us per key to compute."""


def require_boto3() -> None:
    """Refuse at start-up, by name, what would otherwise fail in the first request."""
    if importlib.util.find_spec("boto3") is None:
        raise ConfigError('object_url needs boto3: pip install "kvoffload[s3]"')


def connect(config: ObjectTierConfig, pool_size: int | None = None) -> Any:
    """A boto3 S3 client for ``config``: retries off, the configured timeouts, ``pool_size`` connections (default:
    ``io_threads``). It makes no request; credentials are looked up by boto3's chain when the first one is signed.

    Raises:
        ConfigError: boto3 is not installed.
    """
    require_boto3()
    import boto3
    from botocore.config import Config

    path_style = config.path_style if config.path_style is not None else config.endpoint is not None
    settings = Config(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=pool_size or config.io_threads,
        s3={"addressing_style": "path" if path_style else "virtual"},
        # Checksums only where the API requires them (DeleteObjects): every object carries its own CRC or tag.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = boto3.session.Session()
    region = config.region or session.region_name or "us-east-1"
    return session.client("s3", endpoint_url=config.endpoint, region_name=region, config=settings)


def rank_prefix(config: ObjectTierConfig, namespace: Namespace, fmt: BlockFormat) -> str:
    """The names of this rank's objects start with this (a replicated namespace's one copy: ``rep``)."""
    base = f"{config.prefix}/{PREFIX}" if config.prefix else PREFIX
    rank = "rep" if namespace.replicated else f"r{namespace.rank}"
    return f"{base}/{fmt.world_name(namespace.chain_root())}/{rank}/"


class ObjectNames:
    """Every rank's object name of a key (one name for a replicated namespace), remembered for recent keys."""

    def __init__(self, config: ObjectTierConfig, namespace: Namespace, fmt: BlockFormat) -> None:
        self._prefixes = tuple(rank_prefix(config, replace(namespace, rank=r), fmt) for r in namespace.copy_ranks)
        self._fmt = fmt
        self._names: dict[OffloadKey, str] = {}

    @property
    def copies(self) -> int:
        """Objects per key: one per rank, or one for a replicated namespace."""
        return len(self._prefixes)

    def of(self, key: OffloadKey) -> list[str]:
        """The names of ``key``'s objects, one per rank."""
        names = self._names
        name = names.get(key)
        if name is None:
            if len(names) >= NAME_CACHE:
                del names[next(iter(names))]  # the oldest: a prompt's keys are asked together
            name = names[key] = self._fmt.name(key)
        return [prefix + name for prefix in self._prefixes]
