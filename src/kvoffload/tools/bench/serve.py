"""``kvoffload bench serve``: vLLM's OpenAI server without and with kvoffload, driven by vLLM's own client.

What an operator would run: a real-weight demo model (``model.write_tiny_model``) served by vLLM's OpenAI server
(``serve_server.Server``, loopback only), loaded by vLLM's benchmark client (``vllm.benchmarks.serve``, its
argument builder and ``main``, called in this process) on its ``prefix_repetition`` dataset: a few long prefixes,
each followed by short distinct suffixes, shuffled. The device cache holds about two of the prefixes, so plain vLLM
recomputes the others whenever they come back; kvoffload's host tier holds them all. Each repeat serves the same
dataset (same seed) on both servers, one after the other, the order reversed every repeat so that neither side
always runs first; servers are started fresh for every run.

Per side and repeat: request throughput, output tokens/s, mean / median / p99 TTFT, failed requests; for
kvoffload, its /metrics series before and after the run (hit tokens, bytes per direction). Outputs are compared
request by request with plain vLLM's (greedy, ``ignore_eos``), and the comparison is only trusted when the plain
outputs are not all alike (a model whose outputs ignore their prompt would match whatever the KV held).

Both servers' OpenMP threads are bound to the same CPUs (``--cpu-bind``; ``tools/vllm/cpu_binding.py``):
left to itself vLLM reserves a core more for a server with a KV connector, which on 2 cores gives plain vLLM 1
thread and kvoffload 2. Each row records what its server logged it bound; sides bound differently are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.tools.bench.common import Progress, Report, emit, format_table, positive_int
from kvoffload.tools.bench.serve_server import Server, ServerSettings
from kvoffload.tools.vllm.cpu_binding import (
    FLAG,
    FLAG_HELP,
    BindingError,
    BindingMismatch,
    CpuBinding,
    EngineBinding,
    require_same,
    resolve,
)

SIDES = ("plain", "kvoffload")
TARGET_THROUGHPUT_RATIO = 1.5
TARGET_TTFT_RATIO = 0.5


@dataclass(frozen=True)
class Workload:
    """The dataset and load of one run (vLLM's ``prefix_repetition`` options)."""

    prefixes: int = 6
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    output_tokens: int = 16
    prompts: int = 36
    concurrency: int = 2
    seed: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens

    def client_args(self, base_url: str, model_dir: Path) -> list[str]:
        return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
                "--model", str(model_dir), "--served-model-name", "tiny", "--tokenizer", str(model_dir),
                "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(self.prefix_tokens),
                "--prefix-repetition-suffix-len", str(self.suffix_tokens),
                "--prefix-repetition-num-prefixes", str(self.prefixes),
                "--prefix-repetition-output-len", str(self.output_tokens),
                "--num-prompts", str(self.prompts), "--max-concurrency", str(self.concurrency),
                "--request-rate", "inf", "--temperature", "0", "--ignore-eos", "--seed", str(self.seed),
                "--disable-tqdm", "--save-detailed", "--percentile-metrics", "ttft,tpot,e2el",
                "--metric-percentiles", "50,99"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = Workload()
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs per side (default 2)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw TTFT and throughput (matplotlib)")
    parser.add_argument("--dashboard", metavar="PNG", default=None,
                        help="also draw docs/grafana/kvoffload.json's panels from the kvoffload server's /metrics, "
                             "sampled each second of the last repeat (matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    g = parser.add_argument_group("workload (vLLM's prefix_repetition dataset)")
    g.add_argument("--prefixes", type=positive_int, default=w.prefixes)
    g.add_argument("--prefix-tokens", type=positive_int, default=w.prefix_tokens)
    g.add_argument("--suffix-tokens", type=positive_int, default=w.suffix_tokens)
    g.add_argument("--output-tokens", type=positive_int, default=w.output_tokens)
    g.add_argument("--prompts", type=positive_int, default=w.prompts)
    g.add_argument("--concurrency", type=positive_int, default=w.concurrency)
    g = parser.add_argument_group("engine")
    g.add_argument("--device-blocks", type=positive_int, default=None,
                   help="device KV cache in blocks (default: about two prefixes and the running requests)")
    g.add_argument("--block-size", type=positive_int, default=32, help="vLLM block size (a multiple of 32 on CPU)")
    g.add_argument("--host-gib", type=float, default=1.0, help="kvoffload host tier capacity")
    g.add_argument("--model-dir", type=Path, default=None, help="where to write the model (default: a temp dir)")
    g.add_argument("--record-trace", type=Path, default=None, metavar="PATH",
                   help="the kvoffload server appends each finished request to this JSONL trace (record_trace), for "
                        "kvoffload replay; every repeat appends, each from a cold tier (use --repeats 1); one "
                        "line per request is a little work the plain side does not do")
    g.add_argument(FLAG, metavar="CPUS", default=None, help=FLAG_HELP)


def run(args: argparse.Namespace) -> int:
    try:
        from vllm.benchmarks import serve as _client  # noqa: F401 (checked here: the error names what is missing)
    except ImportError as e:
        print(f"kvoffload bench serve: needs vLLM (make setup-vllm): {e}", file=sys.stderr)
        return 2
    try:
        binding = resolve(args.cpu_bind)
    except BindingError as e:
        print(f"kvoffload bench serve: {e}", file=sys.stderr)
        return 2
    work = Workload(args.prefixes, args.prefix_tokens, args.suffix_tokens, args.output_tokens, args.prompts,
                    args.concurrency)
    progress = Progress("bench serve", 2 * args.repeats, enabled=not args.quiet)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-serve-")))
        model_dir = args.model_dir or tmp / "model"
        settings = engine_settings(args, work, model_dir, binding)
        runs = [serve_repeat(i, settings, work, tmp, progress) for i in range(args.repeats)]
    progress.close()
    try:
        summary = summarize(runs)
    except BindingMismatch as e:
        print(f"kvoffload bench serve: {e}", file=sys.stderr)
        return 1
    emit(report(runs, summary, args, settings["plain"]), args, plot=lambda path: plot(path, runs))
    if args.dashboard:
        from kvoffload.tools.bench.serve_dashboard import draw

        draw(args.dashboard, runs[-1]["kvoffload"]["samples"])
    return 0


def engine_settings(args: argparse.Namespace, work: Workload, model_dir: Path,
                    binding: CpuBinding | None = None) -> dict[str, ServerSettings]:
    from kvoffload.tools.vllm.demo import DEMO_SHAPE
    from kvoffload.tools.vllm.model import ModelFamily, write_tiny_model

    if not (model_dir / "config.json").exists():
        write_tiny_model(model_dir, ModelFamily.LLAMA, DEMO_SHAPE, seed=work.seed)
    # Two prefixes, plus the blocks of the running requests past their prefix (and one spare each).
    own_blocks = -(-(work.suffix_tokens + work.output_tokens) // args.block_size) + 1
    device_blocks = args.device_blocks or (2 * -(-work.prefix_tokens // args.block_size)
                                           + work.concurrency * own_blocks)
    max_len = work.prompt_tokens + work.output_tokens + args.block_size
    host: dict[str, object] = {"host_bytes": int(args.host_gib * (1 << 30))}
    if args.record_trace is not None:
        host["record_trace"] = str(args.record_trace)
    return {side: ServerSettings(model_dir, args.block_size, device_blocks, max_len, "float32",
                                 host if side == "kvoffload" else None, work.seed, binding) for side in SIDES}


def serve_repeat(index: int, settings: dict[str, ServerSettings], work: Workload, tmp: Path,
                 progress: Progress) -> dict[str, dict[str, Any]]:
    """One repeat: both sides on the same dataset, plain first on even repeats."""
    order = SIDES if index % 2 == 0 else SIDES[::-1]
    results = {}
    for side in order:
        results[side] = serve_once(settings[side], work, tmp / f"{side}-{index}.log")
        progress.advance(side)
    return results


def serve_once(settings: ServerSettings, work: Workload, log: Path) -> dict[str, Any]:
    """A fresh server, vLLM's client against it, its kvoffload metrics before, during (each second) and after."""
    from kvoffload.tools.bench.serve_dashboard import Sampler

    with Server(settings, log) as server:
        before = server.metrics()
        sampler = Sampler(server.metrics)
        sampler.start()
        try:
            result = run_client(work.client_args(server.base_url, settings.model_dir))
        finally:
            sampler.stop()
        after = server.metrics()
    return {"client": result, "metrics_before": before, "metrics_after": after, "samples": sampler.samples,
            "binding": server.binding}


def run_client(argv: list[str]) -> dict[str, Any]:
    """vLLM's benchmark client (``vllm bench serve``), its printout sent to stderr."""
    from vllm.benchmarks import serve as client
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    client.add_cli_args(parser)
    with contextlib.redirect_stdout(sys.stderr):
        result: dict[str, Any] = client.main(parser.parse_args(argv))
    return result


def side_row(index: int, side: str, measured: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    r = measured["client"]
    texts, plain_texts = r["generated_texts"], plain["client"]["generated_texts"]
    row = {"repeat": index, "side": side, "completed": r["completed"], "failed": r["failed"],
           "request_throughput": r["request_throughput"], "output_throughput": r["output_throughput"],
           "mean_ttft_ms": r["mean_ttft_ms"], "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
           "outputs_equal": sum(a == b for a, b in zip(texts, plain_texts, strict=True)),
           "distinct_plain_outputs": len(set(plain_texts))}
    binding: EngineBinding | None = measured.get("binding")
    row.update(binding.as_json() if binding else {"cpu_bind": None, "omp_threads": None})
    row.update(metric_deltas(measured["metrics_before"], measured["metrics_after"]))
    return row


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """kvoffload's counters over the run: hit and miss tokens, bytes each way, failed loads."""
    def delta(series: str) -> float:
        return after.get(series, 0.0) - before.get(series, 0.0)

    def total(name: str, direction: str | None = None) -> float:
        wanted = [s for s in after if s.startswith(f"vllm:kvoffload_{name}_total")
                  and (direction is None or f'direction="{direction}"' in s)]
        return sum(map(delta, wanted))

    return {"hit_tokens": total("hit_tokens"), "miss_tokens": total("miss_tokens"),
            "failed_load_tokens": total("failed_load_tokens"),
            "bytes_host_to_device": total("transfer_bytes", "host_to_device"),
            "bytes_device_to_host": total("transfer_bytes", "device_to_host"),
            "series_before": len(before)}


def summarize(runs: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over repeats of the per-repeat ratios kvoffload / plain, and whether the targets were met.

    Raises:
        BindingMismatch: a server of any repeat computed with other CPUs or threads than the others.
    """
    require_same({f"{side} (repeat {i})": run[side].get("binding") for i, run in enumerate(runs) for side in SIDES})
    rows = [side_row(i, side, run[side], run["plain"]) for i, run in enumerate(runs) for side in SIDES]
    ours = [r for r in rows if r["side"] == "kvoffload"]
    plain = [r for r in rows if r["side"] == "plain"]

    def ratio(field: str) -> float:
        return statistics.median(o[field] / p[field] for o, p in zip(ours, plain, strict=True))

    summary = {"rows": rows, "throughput_ratio": ratio("request_throughput"),
               "output_throughput_ratio": ratio("output_throughput"),
               "median_ttft_ratio": ratio("median_ttft_ms"), "mean_ttft_ratio": ratio("mean_ttft_ms"),
               "p99_ttft_ratio": ratio("p99_ttft_ms"),
               "outputs_equal": all(r["outputs_equal"] == r["completed"] + r["failed"] for r in ours),
               "comparison_trusted": all(r["distinct_plain_outputs"] > 1 for r in ours),
               "failed_requests": sum(r["failed"] for r in rows)}
    summary["targets_met"] = (summary["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO
                              and summary["median_ttft_ratio"] <= TARGET_TTFT_RATIO
                              and summary["outputs_equal"] and summary["comparison_trusted"]
                              and summary["failed_requests"] == 0)
    return summary


def report(runs: Sequence[dict[str, Any]], summary: dict[str, Any], args: argparse.Namespace,
           settings: ServerSettings) -> Report:
    headers = ("repeat", "side", "req/s", "out tok/s", "TTFT mean ms", "median", "p99", "failed", "outputs = plain",
               "hit tokens", "MiB host->device", "series at start", "CPUs", "threads")
    rows = summary["rows"]
    table = format_table(headers, [[r["repeat"], r["side"], round(r["request_throughput"], 3),
                                    round(r["output_throughput"], 1), round(r["mean_ttft_ms"], 1),
                                    round(r["median_ttft_ms"], 1), round(r["p99_ttft_ms"], 1), r["failed"],
                                    f"{r['outputs_equal']}/{r['completed'] + r['failed']}", int(r["hit_tokens"]),
                                    round(r["bytes_host_to_device"] / 2**20, 2), r["series_before"],
                                    r["cpu_bind"], r["omp_threads"]]
                                   for r in rows])
    verdict = "met" if summary["targets_met"] else "NOT met"
    notes = (
        f"kvoffload / plain (median over repeats): request throughput {summary['throughput_ratio']:.2f}x, "
        f"median TTFT {summary['median_ttft_ratio']:.2f}x, mean TTFT {summary['mean_ttft_ratio']:.2f}x, "
        f"p99 TTFT {summary['p99_ttft_ratio']:.2f}x",
        f"targets (throughput >= {TARGET_THROUGHPUT_RATIO}x, median TTFT <= {TARGET_TTFT_RATIO}x, outputs equal, "
        f"no failed request): {verdict}",
        "outputs = plain: greedy completions equal to plain vLLM's for the same prompt; trusted only when plain "
        f"vLLM's outputs differ between prompts ({'yes' if summary['comparison_trusted'] else 'NO'})",
        f"device cache {settings.device_blocks} blocks of {settings.block_size} tokens; workload: "
        f"{args.prefixes} prefixes of {args.prefix_tokens} tokens, {args.suffix_tokens}-token suffixes, "
        f"{args.prompts} prompts, concurrency {args.concurrency}, {args.output_tokens} output tokens",
        f"CPUs, threads: what each server logged it bound its worker's OpenMP threads to; asked: "
        f"{_asked(settings.binding)}",
    )
    doc = {k: v for k, v in summary.items() if k != "rows"}
    return Report("serve", rows, table, notes, {"summary": doc, "repeats": len(runs),
                                                "device_blocks": settings.device_blocks,
                                                "block_size": settings.block_size,
                                                "cpu_binding": settings.binding.as_json() if settings.binding
                                                else None})


def _asked(binding: CpuBinding | None) -> str:
    if binding is None:
        return "nothing (vLLM's own binding)"
    return f"CPUs {binding.spec} for both sides ({binding.threads} OpenMP threads; from {binding.source})"


def plot(path: str, runs: Sequence[dict[str, Any]]) -> None:
    """Per-request TTFT of the last repeat, both sides, in request order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.0))
    for side in SIDES:
        ttfts = [t * 1000 for t in runs[-1][side]["client"]["ttfts"]]
        ax.plot(range(len(ttfts)), ttfts, marker="o", linestyle="", label=side)
    ax.set_xlabel("request (dataset order)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("vLLM OpenAI server, prefix_repetition: TTFT per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
