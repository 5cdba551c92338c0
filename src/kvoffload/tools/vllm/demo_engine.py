"""One vLLM engine of the demo, in a child process, serving one request at a time for the parent.

Data flow: the parent (``demo.py``) starts two of these, one without and one with kvoffload (``kvoffload bench
peer`` adds a third, with LMCache: ``peer_lmcache``), and sends them the same turns alternately, so each pair of
measurements is taken seconds apart under the same machine load (on a shared machine the load drifts far more
over a minute than kvoffload's effect on a miss). Each child runs vLLM in its own process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (both connector halves and vLLM's metrics in one place), answers each prompt
with a ``TurnResult`` built from vLLM's first-token latency and the request's deltas of vLLM's metrics, and its
stdout goes to stderr so the parent's stdout stays clean. Every engine's OpenMP threads are bound alike
(``cpu_binding``: in-process vLLM binds nothing itself), set before torch is imported, and each child reports the
binding it computed with.

Protocol over a ``multiprocessing`` pipe: child sends ``("ready", EngineBinding)`` or ``("error", text)``; parent sends
``(conversation, turn, prompt_ids)`` and gets ``("turn", TurnResult)`` or ``("error", text)``; ``None`` stops.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.testing.outputs import TOP_LOGPROBS
from kvoffload.tools.vllm.cpu_binding import BindingError, CpuBinding, EngineBinding, format_cpus
from kvoffload.tools.vllm.demo_report import TurnResult, Workload, user_turns
from kvoffload.tools.vllm.peer_lmcache import LMCacheSide, connector_config, kv_bytes_per_token, prepare_engine

CONNECTOR = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.integrations.vllm",
             "kv_role": "kv_both"}
# vLLM metric names (Prometheus) whose per-request deltas make up a TurnResult.
DEVICE_HITS = "vllm:prefix_cache_hits"
OFFLOAD_HITS = "vllm:kvoffload_hit_tokens"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
"""Prompt tokens any KV connector loaded (vLLM's own count): LMCache's hits, which it has no metric of its own for."""
BYTES = "vllm:kvoffload_transfer_bytes"
LOADED, STORED = "host_to_device", "device_to_host"

Counters = dict[str, float]


@dataclass(frozen=True)
class EngineSettings:
    """What a child needs to build its engine (picklable)."""

    model_dir: Path
    workload: Workload
    with_kvoffload: bool
    dtype: str
    block_size: int
    device_blocks: int | None
    host_gib: float
    remote_url: str | None = None
    """kvoffload's remote tier (a Redis-protocol server) below its host tier; None: host tier only."""
    lmcache: LMCacheSide | None = None
    """Use LMCache (a running server) instead of kvoffload; ``with_kvoffload`` must then be False."""
    binding: CpuBinding | None = None
    """The CPUs the engine's OpenMP threads are bound to (the same for every engine); None: OpenMP's defaults."""
    record_trace: Path | None = None
    """kvoffload's ``record_trace``: where its engine appends each finished request (None: nothing recorded)."""

    @property
    def name(self) -> str:
        """The engine's short name in reports: ``off`` (plain vLLM), ``on`` (kvoffload), ``lmc`` (LMCache)."""
        return "lmc" if self.lmcache else "on" if self.with_kvoffload else "off"

    def max_model_len(self) -> int:
        """The longest conversation, rounded up to whole blocks."""
        return -(-self.workload.max_conversation_tokens() // self.block_size) * self.block_size


def engine_main(conn: Any, settings: EngineSettings) -> None:
    """Child entry point: build and warm the engine, then serve turns until the parent sends ``None``."""
    os.dup2(2, 1)  # vLLM (and its C++ code) log to stdout
    try:
        if settings.binding is not None:
            bind_threads(settings.binding)
        llm = build_llm(settings)
        warm_up(llm, settings.workload)
        binding = measured_binding()
        if settings.binding is not None and binding != settings.binding.expected():
            raise BindingError(f"the {settings.name} engine computed on CPUs {binding.cpu_bind} with "
                               f"{binding.omp_threads} OpenMP threads, not the CPUs {settings.binding.spec} and "
                               f"{settings.binding.threads} threads it was bound to")
        kv_bytes = kv_bytes_per_token(settings.model_dir, settings.dtype) if settings.lmcache else 0
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", binding))
    while (request := conn.recv()) is not None:
        conv, turn, prompt = request
        try:
            conn.send(("turn", serve_turn(llm, conv, turn, prompt, settings.workload.reply_tokens, kv_bytes)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return


def bind_threads(binding: CpuBinding) -> None:
    """Put the binding's OpenMP variables into this process's environment; OpenMP reads them once, when torch
    loads it, so torch must not be imported yet (a spawned child imports it only in ``build_llm``)."""
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before the CPU binding was set: OpenMP would not see it")
    os.environ.update(binding.environment(in_process=True))


def measured_binding() -> EngineBinding:
    """The CPUs this process's main thread may run on (OpenMP binds it to the first place) and torch's threads."""
    import torch

    return EngineBinding(format_cpus(os.sched_getaffinity(0)), torch.get_num_threads())


def build_llm(settings: EngineSettings) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    max_len = settings.max_model_len()
    # Default device cache: one longest conversation and a block to spare (vLLM reserves one block).
    blocks = settings.device_blocks or max_len // settings.block_size + 2
    kwargs: dict[str, Any] = {"dtype": settings.dtype}
    if settings.with_kvoffload:
        extra: dict[str, Any] = {"host_gib": settings.host_gib}
        if settings.remote_url:
            extra["remote_url"] = settings.remote_url
        if settings.record_trace is not None:
            extra["record_trace"] = str(settings.record_trace)
        kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": extra}
    elif settings.lmcache:
        prepare_engine(settings.lmcache)
        kwargs["kv_transfer_config"] = connector_config(settings.lmcache)
    return LLM(model=str(settings.model_dir), seed=settings.workload.seed,
               block_size=settings.block_size, max_model_len=max_len,
               num_gpu_blocks_override=blocks, enable_prefix_caching=True, disable_log_stats=False, **kwargs)


def warm_up(llm: Any, workload: Workload) -> None:
    """A long prompt, then it again with a short tail: first-call costs (kernel set-up) stay out of TTFT."""
    from vllm import SamplingParams, TokensPrompt

    warm = Workload(conversations=1, turns=2, system_tokens=1, first_user_tokens=workload.first_user_tokens,
                    user_tokens=workload.user_tokens, reply_tokens=workload.reply_tokens, seed=workload.seed + 1)
    first, tail = user_turns(warm, vocab_size=256)[0]
    params = SamplingParams(max_tokens=workload.reply_tokens, temperature=0.0, ignore_eos=True)
    for prompt in (first, first + tail):
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)


def serve_turn(llm: Any, conv: int, turn: int, prompt: list[int], reply_tokens: int,
               external_kv_bytes_per_token: int = 0) -> TurnResult:
    """One greedy request; TTFT is vLLM's first-token latency (arrival to first token, loads included).

    With ``external_kv_bytes_per_token`` (LMCache), the offload hits are vLLM's count of connector-loaded tokens
    and the bytes loaded are those tokens' KV; the bytes stored are left 0 (the server's L1 growth says them).
    """
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    before = counters(llm)
    output = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)[0]
    delta = {k: v - before.get(k, 0.0) for k, v in counters(llm).items()}
    completion = output.outputs[0]
    tokens = tuple(completion.token_ids)
    if external_kv_bytes_per_token:
        hits = int(delta.get(EXTERNAL_HITS, 0))
        delta.update({OFFLOAD_HITS: hits, f"{BYTES}/{LOADED}": hits * external_kv_bytes_per_token})
    return TurnResult(
        conversation=conv,
        turn=turn,
        prompt_tokens=len(prompt),
        ttft_s=float(output.metrics.first_token_latency),
        device_hit_tokens=int(delta.get(DEVICE_HITS, 0)),
        offload_hit_tokens=int(delta.get(OFFLOAD_HITS, 0)),
        bytes_loaded=int(delta.get(f"{BYTES}/{LOADED}", 0)),
        bytes_stored=int(delta.get(f"{BYTES}/{STORED}", 0)),
        tokens=tokens,
        logprobs=tuple({t: lp.logprob for t, lp in position.items()} for position in completion.logprobs or []),
    )


def counters(llm: Any) -> Counters:
    """vLLM's counters of interest, summed over labels; transfer bytes keyed ``name/direction``."""
    totals: Counters = {}
    for metric in llm.get_metrics():
        if metric.name in (DEVICE_HITS, OFFLOAD_HITS, EXTERNAL_HITS):
            totals[metric.name] = totals.get(metric.name, 0.0) + metric.value
        elif metric.name == BYTES:
            key = f"{BYTES}/{metric.labels.get('direction', '')}"
            totals[key] = totals.get(key, 0.0) + metric.value
    return totals
