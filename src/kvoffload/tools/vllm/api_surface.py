"""The vLLM API the adapter uses, declared as data: what api_check.py compares with a vLLM release's source.

Each entry says where in vLLM a class or module lives and how the adapter uses each member (``Use``). Signatures
are written as api_check renders the source's: ``@classmethod name(cls, a, b=..., *, c, **kwargs)``, with
``=...`` marking a default and no annotations; ``[since 0.33]`` marks a member the adapter needs only from that
vLLM release on (older sources may lack it), ``[until 0.32]`` one it needs only up to that release (compat.py
uses another from the next one on). When the adapter (or the bench that compares it with vLLM,
``tools/bench/overhead_vllm.py``) starts to use something new of vLLM, add it here: tests/tools/vllm/test_api_check.py
fails for an import of vllm in either that the table does not name, and proves the table against the installed
vLLM.

Beyond names and signatures, ``CALL_ORDERS`` records the order in which vLLM's model runners call the connector's
worker hooks, and where vLLM asks the connector a question the adapter answers on purpose: the orders the
simulated engine runs (``testing/sim.HookOrder``). ``AVOIDED`` names vLLM helpers the adapter must not use.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Use(enum.Enum):
    OVERRIDE = "override"
    """The connector implements it and vLLM calls ours: the signature must be vLLM's exactly."""
    CALL = "call"
    """The adapter calls it: vLLM's parameters must start with these, in order; any others need defaults."""
    READ = "read"
    """The adapter reads (or passes when it builds one) this field, property or attribute."""
    INHERIT = "inherit"
    """A hook of vLLM's base class the connector leaves to vLLM's default on purpose."""


Release = tuple[int, int]
"""A vLLM release series, (major, minor)."""


@dataclass(frozen=True)
class Member:
    name: str
    use: Use
    signature: str
    """In api_check's notation; for ``READ`` and ``INHERIT`` just the name."""
    since: Release | None = None
    until: Release | None = None


@dataclass(frozen=True)
class ClassUse:
    module: str
    """Where the adapter finds the class (imports from there are followed to the definition)."""
    name: str
    members: tuple[Member, ...] = ()
    every_hook: bool = False
    """The table lists every method the class defines: a new one, or an abstract one the connector does not
    implement, is drift (a new hook with a default that may be wrong for kvoffload)."""
    constructs: bool = False
    """The adapter builds instances by keyword: a required field it does not pass is drift."""
    since: Release | None = None
    """The first release with the class (older sources may lack it)."""


@dataclass(frozen=True)
class ModuleUse:
    module: str
    names: tuple[str, ...] = ()
    """Names the adapter imports from the module (functions, classes, constants, submodules)."""
    functions: tuple[Member, ...] = ()
    """Module-level functions the adapter calls (``Use.CALL``)."""
    since: Release | None = None
    """The first release with the module (older sources may lack it and every name in it)."""
    until: Release | None = None
    """The last release whose module the adapter reads these names from (newer sources may lack them)."""


@dataclass(frozen=True)
class CallOrder:
    """The connector hooks one vLLM function calls, in the order they appear in its source.

    ``calls`` lists every call in it of a connector hook (a name ``CONNECTOR_BASE`` lists) or of a name in
    ``calls`` itself, whatever the receiver: vLLM's order as the adapter was tested against it. Branches are not
    told apart (``if not defer_finalize: wait_for_save()`` counts as a call), so a hook that moves, appears or
    goes is drift, and so is a new hook call.
    """

    module: str
    function: str
    """``name`` of a module-level function, or ``Class.method``."""
    calls: tuple[str, ...]
    why: str
    """What the adapter relies on in this order (shown with the drift)."""
    since: Release | None = None
    until: Release | None = None
    """The last release with the function (vLLM 0.34 removed Model Runner V1: newer sources may lack it)."""


_ENTRY = re.compile(r"^(?:@\w+ )?(\w+)(?:\(.*\))?$")
_RANGE = re.compile(r"^(.*) \[(since|until) (\d+)\.(\d+)\]$")


def uses(use: Use, *entries: str) -> tuple[Member, ...]:
    """Members from entries in the table's notation, each optionally ending in ``[since X.Y]`` or
    ``[until X.Y]``."""
    members = []
    for entry in entries:
        text, bound, release = entry, None, None
        ranged = _RANGE.match(entry)
        if ranged is not None:
            text, bound = ranged.group(1), ranged.group(2)
            release = (int(ranged.group(3)), int(ranged.group(4)))
        match = _ENTRY.match(text)
        if match is None:
            raise ValueError(f"not an entry of the table's notation: {entry!r}")
        members.append(Member(match.group(1), use, text, since=release if bound == "since" else None,
                              until=release if bound == "until" else None))
    return tuple(members)


_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_SPECS = "vllm.v1.kv_cache_interface"
_UTILS = "vllm.v1.core.kv_cache_utils"
_SCHED_OUTPUT = "vllm.v1.core.sched.output"

CONNECTOR_BASE = ClassUse(_BASE, "KVConnectorBase_V1", every_hook=True, members=uses(
    Use.OVERRIDE,
    "__init__(self, vllm_config, role, kv_cache_config)",
    "@property requires_kv_delivery",
    "register_kv_caches(self, kv_caches)",
    "unregister_kv_caches(self) [since 0.33]",  # 0.34's extensible KV cache calls them outside sleep mode too
    "restore_kv_caches(self) [since 0.33]",
    "handle_preemptions(self, kv_connector_metadata)",
    "start_load_kv(self, forward_context, **kwargs)",
    "wait_for_layer_load(self, layer_name)",
    "save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs)",
    "wait_for_save(self)",
    "get_finished(self, finished_req_ids)",
    "get_transfer_results(self, finished_req_ids)",
    "get_block_ids_with_load_errors(self)",
    "build_connector_worker_meta(self)",
    "shutdown(self)",
    "get_num_new_matched_tokens(self, request, num_computed_tokens)",
    "update_state_after_alloc(self, request, blocks, num_external_tokens)",
    "build_connector_meta(self, scheduler_output)",
    "update_connector_output(self, connector_output)",
    "request_finished(self, request, block_ids)",
    "take_events(self)",
    "reset_cache(self)",
    "get_kv_connector_stats(self)",
    "@classmethod build_kv_connector_stats(cls, data=...)",
    "@classmethod build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
    "@classmethod supports_sleep_mode(cls, kv_transfer_config) [since 0.33]",  # compat.VersionHooks
    "@classmethod supports_lookahead_block_hashes(cls, kv_transfer_config) [since 0.34]",
    "@classmethod kv_cache_access(cls, kv_transfer_config) [since 0.34]",
    "may_load_async(self, request) [since 0.34]",
) + uses(Use.CALL, "_get_connector_metadata(self)") + uses(Use.READ, "_kv_transfer_config") + uses(
    Use.INHERIT,
    "supports_divergent_local_hybrid_hits", "role", "get_mem_pool_context", "bind_connector_metadata",
    "clear_connector_metadata", "has_connector_metadata", "set_host_xfer_buffer_ops", "finish_forward",
    "reset_capture_state", "get_kv_connector_kv_cache_events", "get_handshake_metadata", "bind_kv_cache_manager",
    "bind_gpu_block_pool", "on_new_request", "register_finished_partial_tail", "has_pending_block_frees",
    "has_pending_push_work", "get_required_kvcache_layout", "requires_piecewise_for_cudagraph",
    "get_finished_count", "set_xfer_handshake_metadata", "set_xfer_handshake_metadata_pp_aware",
    # 0.32: the groups a load restores (default: the prefix-cacheable ones, all that kvoffload stores) and the
    # tier a hit came from (default: unspecified).
    "get_loaded_kv_cache_group_ids [since 0.32]", "get_external_cache_hit_sources [since 0.32]",
))

CONNECTOR = (
    ModuleUse(_BASE, names=("KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole",
                            "KVConnectorTransferResults", "KVConnectorWorkerMetadata", "SupportsHMA")),
    CONNECTOR_BASE,
    ClassUse(_BASE, "SupportsHMA", every_hook=True,
             members=uses(Use.OVERRIDE, "request_finished_all_groups(self, request, block_ids)")),
    ClassUse(_BASE, "KVConnectorMetadata", every_hook=True),
    ClassUse(_BASE, "KVConnectorWorkerMetadata", every_hook=True, members=uses(Use.OVERRIDE, "aggregate(self, other)")),
    ClassUse(_BASE, "KVConnectorTransferResults", constructs=True,
             members=uses(Use.READ, "finished_recving", "failed_recving")),
    ClassUse(_BASE, "KVConnectorRole", members=uses(Use.READ, "SCHEDULER")),
    ModuleUse("vllm.config.kv_transfer", names=("KVCacheAccess",), since=(0, 34)),  # compat.VersionHooks
    ClassUse("vllm.config.kv_transfer", "KVCacheAccess", members=uses(Use.READ, "IN_PROCESS"), since=(0, 34)),
    ModuleUse("vllm.distributed.kv_transfer.kv_connector.factory", names=("KVConnectorFactory",)),
    ClassUse("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory",
             members=uses(Use.CALL, "@classmethod register_connector(cls, name, module_path, class_name)")),
    ModuleUse("vllm.distributed.parallel_state", functions=uses(Use.CALL, "get_world_group()")),
    ClassUse("vllm.distributed.parallel_state", "GroupCoordinator", members=uses(Use.READ, "rank_in_group")),
    ModuleUse("vllm", names=("__version__", "LLM", "SamplingParams", "TokensPrompt")),
    ModuleUse("vllm.triton_utils", names=("dispatcher",)),
    # peer_lmcache.guard_kernel_rebind: the module whose namespace scan it guards, by the scan's name in each release
    ModuleUse("vllm.triton_utils.dispatcher", names=("_rebind_kernels",), until=(0, 33)),
    ModuleUse("vllm.triton_utils.dispatcher", names=("_rebind_impls",), since=(0, 34)),
)

METRICS = (
    ModuleUse(_METRICS, names=("KVConnectorPromMetrics", "KVConnectorStats", "PromMetric", "PromMetricT")),
    ClassUse(_METRICS, "KVConnectorStats", constructs=True, members=uses(Use.READ, "data") + uses(
        Use.OVERRIDE, "reset(self)", "aggregate(self, other)", "reduce(self)", "is_empty(self)")),
    ClassUse(_METRICS, "KVConnectorPromMetrics", members=uses(
        Use.CALL, "__init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)") + uses(
        Use.OVERRIDE, "observe(self, transfer_stats_data, engine_idx=...)") + uses(
        Use.READ, "_counter_cls", "_gauge_cls", "per_engine_labelvalues")),
)

EVENTS = (
    ModuleUse("vllm.distributed.kv_events",
              names=("MEDIUM_CPU", "MEDIUM_STORAGE", "BlockRemoved", "BlockStored", "KVCacheEvent")),
    ClassUse("vllm.distributed.kv_events", "BlockStored", constructs=True, members=uses(
        Use.READ, "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality")),
    ClassUse("vllm.distributed.kv_events", "BlockRemoved", constructs=True,
             members=uses(Use.READ, "block_hashes", "medium", "group_idx", "locality")),
    # events.py describes blocks as the device's events do: vLLM's hash conversion (and the variable that picks it)
    # and extra keys.
    ModuleUse("vllm", names=("envs",)),
    ModuleUse("vllm.envs", names=("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",)),
    ModuleUse(_UTILS, functions=uses(
        Use.CALL, "generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)",
        "maybe_convert_block_hash(hash_bytes)", "to_event_extra_keys(extra_keys)")),
    ModuleUse(_SPECS, functions=uses(
        Use.CALL, "get_kv_cache_spec_kind(kv_cache_spec)", "get_kv_cache_spec_sliding_window(kv_cache_spec)")),
    ClassUse("vllm.v1.request", "Request", members=uses(Use.READ, "block_hashes")),
    ClassUse("vllm.lora.request", "LoRARequest", members=uses(Use.READ, "adapter_id", "name")),
)

KV_CACHE_SPECS = (
    ModuleUse("vllm.v1", names=("kv_cache_interface",)),
    ModuleUse(_SPECS, names=("KVCacheSpec", "AttentionSpec", "FullAttentionSpec", "MLAAttentionSpec", "MambaSpec",
                             "UniformTypeKVCacheSpecs", "KVCacheGroupSpec", "KVCacheConfig", "KVCacheTensor")),
    ClassUse(_SPECS, "KVCacheSpec", members=uses(Use.READ, "block_size")),
    ClassUse(_SPECS, "AttentionSpec", members=uses(
        Use.READ, "block_size", "num_kv_heads", "head_size", "dtype", "page_size_padded", "real_page_size_bytes")),
    ClassUse(_SPECS, "MLAAttentionSpec", members=uses(
        Use.READ, "block_size", "num_kv_heads", "head_size", "dtype", "page_size_padded", "real_page_size_bytes",
        "max_tp_shards", "cache_dtype_str")),
    ClassUse(_SPECS, "MambaSpec", members=uses(
        Use.READ, "block_size", "shapes", "dtypes", "page_size_padded", "num_heads", "num_states",
        "real_page_size_bytes", "mamba_cache_mode", "num_speculative_blocks")),
    ClassUse(_SPECS, "UniformTypeKVCacheSpecs", members=uses(Use.READ, "kv_cache_specs")),
    ClassUse(_SPECS, "KVCacheGroupSpec", members=uses(Use.READ, "layer_names", "kv_cache_spec")),
    ClassUse(_SPECS, "KVCacheConfig", members=uses(
        Use.READ, "num_blocks", "kv_cache_tensors", "kv_cache_groups", "kv_cache_layout")),
    ClassUse(_SPECS, "KVCacheTensor", members=uses(Use.READ, "layers", "layer_stride", "block_stride", "offset")),
    ModuleUse("vllm.v1.core.kv_cache_utils",
              functions=uses(Use.CALL, "resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)")),
    ModuleUse("vllm.v1.core.kv_cache_manager", names=("KVCacheBlocks",)),
    ClassUse("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", members=uses(Use.CALL, "get_block_ids(self)")),
)

SCHEDULER_OUTPUT = (
    ModuleUse(_SCHED_OUTPUT, names=("SchedulerOutput",)),
    ClassUse(_SCHED_OUTPUT, "SchedulerOutput", members=uses(
        Use.READ, "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
        "scheduled_spec_decode_tokens", "preempted_req_ids")),
    ClassUse(_SCHED_OUTPUT, "NewRequestData", members=uses(Use.READ, "req_id", "block_ids", "num_computed_tokens")),
    ClassUse(_SCHED_OUTPUT, "CachedRequestData", members=uses(
        Use.READ, "req_ids", "resumed_req_ids [until 0.33]", "new_block_ids", "num_computed_tokens")),
    ModuleUse("vllm.v1.outputs", names=("KVConnectorOutput",)),
    ClassUse("vllm.v1.outputs", "KVConnectorOutput", members=uses(Use.READ, "kv_connector_worker_meta")),
)

REQUESTS = (
    ModuleUse("vllm.v1.request", names=("Request",)),
    ClassUse("vllm.v1.request", "Request", members=uses(
        Use.READ, "request_id", "all_token_ids", "num_prompt_tokens", "lora_request", "cache_salt", "mm_features",
        "prompt_embeds")),
    ClassUse("vllm.lora.request", "LoRARequest", members=uses(Use.READ, "lora_name", "lora_path")),
    ClassUse("vllm.multimodal.inputs", "MultiModalFeatureSpec", members=uses(Use.READ, "identifier", "mm_position")),
    ClassUse("vllm.multimodal.inputs", "PlaceholderRange", members=uses(Use.READ, "offset", "length")),
)

CONFIG = (
    ModuleUse("vllm.config", names=("VllmConfig",)),
    ModuleUse("vllm.forward_context", names=("ForwardContext",)),
    ModuleUse("vllm.v1.attention.backend", names=("AttentionMetadata",)),
    ClassUse("vllm.config", "VllmConfig", members=uses(
        Use.READ, "model_config", "cache_config", "parallel_config", "speculative_config", "kv_transfer_config",
        "kv_events_config")),
    ClassUse("vllm.config", "ModelConfig", members=uses(
        Use.READ, "model", "dtype", "hf_config", "quantization", "revision", "code_revision")),
    ClassUse("vllm.config", "CacheConfig", members=uses(Use.READ, "block_size", "cache_dtype", "kv_cache_layout")),
    ClassUse("vllm.config", "ParallelConfig", members=uses(
        Use.READ, "world_size", "tensor_parallel_size", "decode_context_parallel_size")),
    ClassUse("vllm.config", "KVEventsConfig", members=uses(Use.READ, "enable_kv_cache_events")),
    ClassUse("vllm.config", "KVTransferConfig", members=uses(Use.READ, "kv_connector_extra_config")),
)

_PLANNING = "vllm.v1.core.kv_cache_planning"

KV_CACHE_PLANNING = (
    # compat.get_kv_cache_configs: vLLM 0.33 moved the planner to kv_cache_planning, where it takes the model's
    # groups (get_global_kv_cache_groups) as a fourth parameter.
    ModuleUse(_UTILS, functions=uses(
        Use.CALL, "get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory) [until 0.32]")),
    ModuleUse(_PLANNING, since=(0, 33), functions=uses(
        Use.CALL, "get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups)",
        "get_global_kv_cache_groups(vllm_config, kv_cache_specs)")),
)

BENCH = (
    # tools/bench/overhead_vllm.py builds vLLM's own scheduler and offloading connector beside ours.
    ModuleUse("vllm.config", names=("KVTransferConfig",)),
    ModuleUse("vllm.engine.arg_utils", names=("EngineArgs",)),
    ClassUse("vllm.engine.arg_utils", "EngineArgs", members=uses(
        Use.READ, "model", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype",
        "enable_prefix_caching", "kv_transfer_config") + uses(Use.CALL, "create_engine_config(self)")),
    ModuleUse("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common", names=("OffloadingWorkerMetadata",)),
    ModuleUse("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", names=("OffloadingConnector",)),
    ModuleUse("vllm.v1.outputs", names=("ModelRunnerOutput",)),
    ClassUse("vllm.v1.outputs", "ModelRunnerOutput", constructs=True, members=uses(
        Use.READ, "req_ids", "req_id_to_index [until 0.33]", "sampled_token_ids", "logprobs", "prompt_logprobs_dict",
        "prompt_token_id_logprobs_dict")),
    # tools/bench/manager.py drives vLLM's own CPUOffloadingManager beside ours (0.34 records accesses in lookup
    # and prepare_load and has no touch: the bench leaves that row out there).
    ClassUse("vllm.v1.kv_offload.cpu.manager", "CPUOffloadingManager", members=uses(
        Use.CALL, "lookup(self, key, req_context)", "touch(self, keys, req_context) [until 0.33]",
        "prepare_load(self, keys, req_context)", "complete_load(self, keys, req_context)",
        "prepare_store(self, keys, req_context)", "complete_store(self, keys, req_context, success=...)",
        "take_events(self)")),
    ModuleUse("vllm.sampling_params", names=("SamplingParams",)),
    ModuleUse("vllm.utils.hashing", names=("get_hash_fn_by_name",)),
    ModuleUse(_UTILS, names=("get_request_block_hasher", "init_none_hash")),
    ModuleUse("vllm.v1.core.sched.scheduler", names=("Scheduler",)),
    ModuleUse("vllm.v1.structured_output", names=("StructuredOutputManager",)),
)

SURFACE: tuple[ClassUse | ModuleUse, ...] = (
    CONNECTOR + METRICS + EVENTS + KV_CACHE_SPECS + SCHEDULER_OUTPUT + REQUESTS + CONFIG + KV_CACHE_PLANNING + BENCH)
"""Everything of vLLM that kvoffload.integrations.vllm, kvoffload.tools.vllm and tools/bench/overhead_vllm.py use."""

_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
_MIXIN = "vllm.v1.worker.kv_connector_model_runner_mixin"
_V2_CONNECTOR = "vllm.v1.worker.gpu.kv_connector"
_AFTER_FORWARD = ("wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors", "get_kv_connector_stats",
                  "get_kv_connector_kv_cache_events", "build_connector_worker_meta", "clear_connector_metadata")
_FINALIZE = ("wait_for_save", "clear_connector_metadata")
_REPORT_FIRST = ("with speculative decoding wait_for_save runs after the step's transfer results and worker "
                 "metadata (sim.HookOrder.REPORT_FIRST): stores only queue there, and the next step's "
                 "handle_preemptions submits them, in either order")

CALL_ORDERS: tuple[CallOrder, ...] = (
    CallOrder(_V1_RUNNER, "GPUModelRunner.execute_model",
              ("handle_preemptions", "kv_connector_no_forward", "maybe_get_kv_connector_output"),
              "handle_preemptions (submit last step's deferred stores, fence) comes first, also without a forward",
              until=(0, 33)),
    CallOrder(_MIXIN, "KVConnectorModelRunnerMixin._get_kv_connector_output",
              ("bind_connector_metadata", "start_load_kv", "start_load_kv", *_AFTER_FORWARD),
              "without speculative decoding wait_for_save runs before the step's reports "
              "(sim.HookOrder.SAVE_FIRST); with it, finalize_kv_connector calls it", until=(0, 33)),
    CallOrder(_MIXIN, "KVConnectorModelRunnerMixin.finalize_kv_connector", _FINALIZE, _REPORT_FIRST, until=(0, 33)),
    CallOrder(_V1_RUNNER, "GPUModelRunner.sample_tokens", ("finalize_kv_connector",), _REPORT_FIRST, until=(0, 33)),
    CallOrder(_V2_CONNECTOR, "ActiveKVConnector.pre_forward", ("handle_preemptions", "bind_connector_metadata"),
              "Model Runner V2: handle_preemptions comes first"),
    CallOrder(_V2_CONNECTOR, "ActiveKVConnector.post_forward", _AFTER_FORWARD,
              "Model Runner V2: wait_for_save before the reports, unless finalize_step defers it"),
    CallOrder(_V2_CONNECTOR, "ActiveKVConnector.finalize_step", _FINALIZE, _REPORT_FIRST, since=(0, 33)),
    CallOrder("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens",
              ("post_forward", "post_forward", "finalize_step"), _REPORT_FIRST, since=(0, 33)),
    CallOrder("vllm.v1.worker.cpu.kv_connector", "ActiveKVConnector.pre_forward",
              ("handle_preemptions", "bind_connector_metadata", "_start_load_kv"),
              "the x86 CPU's standalone Model Runner V2: handle_preemptions comes first", since=(0, 34)),
    CallOrder("vllm.v1.worker.cpu.kv_connector", "ActiveKVConnector.post_forward", _AFTER_FORWARD,
              "the x86 CPU's standalone Model Runner V2: wait_for_save before the reports", since=(0, 34)),
    CallOrder("vllm.config.vllm", "VllmConfig._verify_kv_transfer_compat", ("supports_sleep_mode",),
              "vLLM asks before it enables sleep mode (its default says yes); compat.VersionHooks says no",
              since=(0, 33)),
)
"""Where vLLM's model runners and config call the connector, as the adapter was tested against."""

AVOIDED: dict[tuple[str, str], str] = {
    ("vllm.distributed.kv_transfer.kv_connector.utils", "yield_req_data"):
        "its third value meant 'resumed after a preemption' up to vLLM 0.32 and means 'the whole block table' "
        "(new requests too) from 0.33 on; adapters.step_schedule reads resumed_req_ids and preempted_req_ids",
}
"""vLLM names the adapter must not import (module, name) -> why; tests/tools/vllm/test_api_check.py checks."""
