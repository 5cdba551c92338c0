"""``kvoffload demo``: real vLLM (CPU backend) on a multi-turn chat, once without kvoffload and once with it.

Data flow: write a random-weight Llama (``model.write_tiny_llama``) -> build the workload
(``demo_report.user_turns``) -> for each of the two engines: build an in-process ``LLM``, warm it up, serve the
conversations round-robin turn by turn, recording TTFT (vLLM's own first-token latency of the request) and the
per-request deltas of vLLM's metrics (device prefix-cache hits, kvoffload hit tokens and bytes copied) ->
``demo_report.summarize`` -> table, JSON, PNG chart.

The device cache (``num_gpu_blocks_override``) holds about one conversation, so without kvoffload every later
turn recomputes its whole history; with it, the history is loaded from the host tier.

vLLM is imported only inside functions: ``kvoffload --help`` imports this module to build its parser.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvoffload.integrations.vllm.demo_report import (
    RunResult,
    TurnResult,
    Workload,
    format_report,
    format_turn,
    summarize,
    user_turns,
    write_chart,
)
from kvoffload.integrations.vllm.model import TinyLlamaShape, write_tiny_llama

CONNECTOR = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.integrations.vllm",
             "kv_role": "kv_both"}
# vLLM metric names (Prometheus) whose per-request deltas make up a TurnResult.
DEVICE_HITS = "vllm:prefix_cache_hits"
OFFLOAD_HITS = "vllm:kvoffload_hit_tokens"
BYTES = "vllm:kvoffload_transfer_bytes"
LOADED, STORED = "host_to_device", "device_to_host"

Counters = dict[str, float]
Progress = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags: output, workload size, model size, engine knobs."""
    w, m = Workload(), TinyLlamaShape(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=64)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    parser.add_argument("--out", type=Path, default=Path("out"), help="directory for demo.json and the chart")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    g = parser.add_argument_group("workload")
    g.add_argument("--conversations", type=int, default=w.conversations)
    g.add_argument("--turns", type=int, default=w.turns)
    g.add_argument("--system-tokens", type=int, default=w.system_tokens, help="shared system prompt")
    g.add_argument("--first-user-tokens", type=int, default=w.first_user_tokens, help="opening message")
    g.add_argument("--user-tokens", type=int, default=w.user_tokens, help="each later user message")
    g.add_argument("--reply-tokens", type=int, default=w.reply_tokens, help="generated per turn")
    g.add_argument("--seed", type=int, default=w.seed)
    g = parser.add_argument_group("model (random weights)")
    g.add_argument("--hidden-size", type=int, default=m.hidden_size)
    g.add_argument("--layers", type=int, default=m.num_layers)
    g.add_argument("--heads", type=int, default=m.num_heads)
    g.add_argument("--kv-heads", type=int, default=m.num_kv_heads)
    g.add_argument("--head-dim", type=int, default=m.head_dim)
    g.add_argument("--model-dir", type=Path, default=None, help="where to write the model (default: a temp dir)")
    g = parser.add_argument_group("engine")
    # float32: CPUs without bf16 instructions run bf16 matmuls many times slower.
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--block-size", type=int, default=32, help="vLLM block size (a multiple of 32 on CPU)")
    g.add_argument("--device-blocks", type=int, default=None,
                   help="device KV cache size in blocks (default: one conversation and a little)")
    g.add_argument("--host-gib", type=float, default=1.0, help="kvoffload host tier capacity")


def run(args: argparse.Namespace) -> int:
    """Run both engines, print the report (or JSON), write out/demo.json and the chart. Returns 0."""
    workload = Workload(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                        first_user_tokens=args.first_user_tokens, user_tokens=args.user_tokens,
                        reply_tokens=args.reply_tokens, seed=args.seed)
    progress = _stderr_progress
    with contextlib.ExitStack() as stack:
        model_dir = args.model_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-")))
        write_tiny_llama(model_dir, hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.head_dim)
        # vLLM logs to stdout; keep stdout for the report / JSON alone.
        stack.enter_context(_stdout_to_stderr())
        off = serve(model_dir, workload, args, with_kvoffload=False, progress=progress)
        on = serve(model_dir, workload, args, with_kvoffload=True, progress=progress)
    summary = summarize(off, on, extra=_settings(workload, args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.no_chart:
        chart = args.out / "demo_ttft.png"
        summary["chart"] = str(chart) if write_chart(summary, chart) else None
        if summary["chart"] is None:
            progress("matplotlib is not installed: no chart (pip install matplotlib)")
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "turns"}, indent=2))
    else:
        print(format_report(summary))
        print(f"details: {args.out / 'demo.json'}" + (f", chart: {summary['chart']}" if summary.get("chart") else ""))
    return 0


def serve(model_dir: Path, workload: Workload, args: argparse.Namespace, *, with_kvoffload: bool,
          progress: Progress) -> RunResult:
    """Serve the whole workload on a fresh in-process engine; conversations round-robin, turn by turn."""
    name = "on" if with_kvoffload else "off"
    progress(f"[{name:>3}] starting vLLM ({'with' if with_kvoffload else 'without'} kvoffload)")
    llm = _build_llm(model_dir, workload, args, with_kvoffload)
    try:
        _warm_up(llm, workload)
        start = time.perf_counter()
        results = []
        histories = [[] for _ in range(workload.conversations)]  # type: list[list[int]]
        messages = user_turns(workload, _vocab_size(model_dir))
        for turn in range(workload.turns):
            for conv, history in enumerate(histories):
                history += messages[conv][turn]
                result = _serve_turn(llm, conv, turn, history, workload.reply_tokens)
                history += result.output_ids
                results.append(result)
                progress(format_turn(name, result))
        return RunResult(name=name, turns=tuple(results), wall_s=time.perf_counter() - start)
    finally:
        del llm
        _release_engine()


def _serve_turn(llm: Any, conv: int, turn: int, prompt: list[int], reply_tokens: int) -> TurnResult:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True)
    before = _counters(llm)
    output = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)[0]
    delta = _delta(before, _counters(llm))
    return TurnResult(
        conversation=conv,
        turn=turn,
        prompt_tokens=len(prompt),
        ttft_s=float(output.metrics.first_token_latency),
        device_hit_tokens=int(delta.get(DEVICE_HITS, 0)),
        offload_hit_tokens=int(delta.get(OFFLOAD_HITS, 0)),
        bytes_loaded=int(delta.get(f"{BYTES}/{LOADED}", 0)),
        bytes_stored=int(delta.get(f"{BYTES}/{STORED}", 0)),
        output_ids=tuple(output.outputs[0].token_ids),
    )


def _build_llm(model_dir: Path, workload: Workload, args: argparse.Namespace, with_kvoffload: bool) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both connector halves in this process, metrics here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    block = args.block_size
    max_len = -(-workload.max_conversation_tokens() // block) * block
    kwargs: dict[str, Any] = {}
    if with_kvoffload:
        kwargs["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": {"host_gib": args.host_gib}}
    return LLM(model=str(model_dir), load_format="dummy", seed=args.seed, dtype=args.dtype, block_size=block,
               max_model_len=max_len, num_gpu_blocks_override=args.device_blocks or max_len // block + 2,
               enable_prefix_caching=True, disable_log_stats=False, **kwargs)


def _warm_up(llm: Any, workload: Workload) -> None:
    """One long prompt, then it again with a short tail: first-call costs (kernel set-up) stay out of TTFT."""
    from vllm import SamplingParams, TokensPrompt

    warm = Workload(conversations=1, turns=2, system_tokens=1, first_user_tokens=workload.first_user_tokens,
                    user_tokens=workload.user_tokens, reply_tokens=workload.reply_tokens, seed=workload.seed + 1)
    first, tail = user_turns(warm, vocab_size=256)[0]
    params = SamplingParams(max_tokens=workload.reply_tokens, temperature=0.0, ignore_eos=True)
    for prompt in (first, first + tail):
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)


def _counters(llm: Any) -> Counters:
    """vLLM's counters of interest, summed over labels; transfer bytes keyed ``name/direction``."""
    totals: Counters = {}
    for metric in llm.get_metrics():
        if metric.name in (DEVICE_HITS, OFFLOAD_HITS):
            totals[metric.name] = totals.get(metric.name, 0.0) + metric.value
        elif metric.name == BYTES:
            key = f"{BYTES}/{metric.labels.get('direction', '')}"
            totals[key] = totals.get(key, 0.0) + metric.value
    return totals


def _delta(before: Counters, after: Counters) -> Counters:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _release_engine() -> None:
    """Free the engine so the next one starts clean in this process (vLLM keeps process-wide state)."""
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _settings(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "workload": {k: v for k, v in vars(workload).items()},
        "model": {"hidden_size": args.hidden_size, "layers": args.layers, "heads": args.heads,
                  "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype},
        "engine": {"block_size": args.block_size, "device_blocks": args.device_blocks, "host_gib": args.host_gib},
    }


def _stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr for the duration (catches prints from vLLM and its C++ code too)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
