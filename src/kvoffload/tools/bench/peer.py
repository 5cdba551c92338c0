"""``kvoffload bench peer``: the demo's multi-turn chat through vLLM + LMCache and vLLM + kvoffload, side by side.

LMCache is what most users would pick instead of kvoffload. On the CPU backend only its multiprocess mode runs:
vLLM's ``LMCacheMPConnector`` talking to a separate LMCache server (``tools/vllm/peer_lmcache.py``).
Data flow: write the demo's model -> start the LMCache server from its venv (``make setup-lmcache``), chunk size
equal to the vLLM block size and L1 capacity equal to kvoffload's host tier -> start three demo engines (plain
vLLM, vLLM + kvoffload, vLLM + LMCache) and send them the same turns, each request to all three in an order reversed
every request (``demo.serve_engines``), all three with their OpenMP threads bound to the same CPUs
(``cpu_binding``) -> one output control per side on the plain engine -> per side, the demo's summary against plain
vLLM (``demo_report.summarize``, which refuses engines bound differently) plus the server's L1 growth and CPU time
-> one row per side. The LMCache server is a helper process, not an engine: it is left unbound.

When vLLM, the demo or the LMCache venv is missing it says why and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvoffload.tools.bench.common import Progress, Report, add_common_arguments, emit, format_table
from kvoffload.tools.bench.e2e import demo_args, load_demo
from kvoffload.tools.vllm.cpu_binding import FLAG, FLAG_HELP, BindingError, BindingMismatch

SIDES = {"on": "vLLM + kvoffload", "lmc": "vLLM + LMCache"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, runs=1, warmup=0)
    parser.add_argument("--demo-args", default="",
                        help="workload, model and engine options of the demo, in one quoted string (see `kvoffload "
                             "demo --help`); --block-size is also LMCache's chunk size, --host-gib its L1 size")
    parser.add_argument("--lmcache-venv", type=Path, default=None,
                        help="LMCache's virtualenv (default: .venv-lmcache here; make setup-lmcache)")
    parser.add_argument(FLAG, metavar="CPUS", default=None, help=FLAG_HELP)


def lmcache_venv(args: argparse.Namespace) -> Path:
    from kvoffload.tools.vllm.peer_lmcache import DEFAULT_VENV

    return Path(args.lmcache_venv or DEFAULT_VENV).absolute()


def run(args: argparse.Namespace) -> int:
    demo = load_demo()
    if isinstance(demo, str):
        print(f"kvoffload bench peer: {demo}", file=sys.stderr)
        return 2
    from kvoffload.tools.vllm.peer_lmcache import venv_problem

    venv = lmcache_venv(args)
    if (problem := venv_problem(venv)) is not None:
        print(f"kvoffload bench peer: LMCache not available ({problem})", file=sys.stderr)
        return 2
    progress = Progress("bench peer", args.runs, enabled=not args.quiet)
    rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvoffload-peer-") as tmp:
            try:
                measured = run_once(demo, demo_args(demo, args.demo_args, Path(tmp), args.cpu_bind), venv, Path(tmp))
            except BindingError as e:  # a bad --cpu-bind (2), or engines that reported different bindings (1)
                print(f"kvoffload bench peer: {e}", file=sys.stderr)
                return 1 if isinstance(e, BindingMismatch) else 2
        summaries.append(measured)
        rows += side_rows(i, measured)
        progress.advance()
    progress.close()
    emit(report(rows, summaries[-1], args), args)
    return 0


def run_once(demo: Any, dargs: argparse.Namespace, venv: Path, tmp: Path) -> dict[str, Any]:
    """One pass of the workload on the three engines; per side, the demo's summary against plain vLLM and the
    LMCache server's figures (``"server"``)."""
    from kvoffload.tools.vllm.cpu_binding import resolve
    from kvoffload.tools.vllm.demo_engine import EngineSettings
    from kvoffload.tools.vllm.demo_report import Workload, summarize
    from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model
    from kvoffload.tools.vllm.peer_lmcache import (
        LMCacheServer,
        LMCacheSide,
        build_overlay,
        remove_segments,
        site_packages,
    )

    binding = resolve(dargs.cpu_bind)
    workload = Workload(conversations=dargs.conversations, turns=dargs.turns, system_tokens=dargs.system_tokens,
                        first_user_tokens=dargs.first_user_tokens, user_tokens=dargs.user_tokens,
                        reply_tokens=dargs.reply_tokens, seed=dargs.seed)
    model_dir = dargs.model_dir or tmp / "model"
    shape = TinyShape(hidden_size=dargs.hidden_size, num_layers=dargs.layers, num_heads=dargs.heads,
                      num_kv_heads=dargs.kv_heads, head_dim=dargs.head_dim, intermediate_size=4 * dargs.hidden_size)
    write_tiny_model(model_dir, ModelFamily.LLAMA, shape, seed=dargs.seed)
    site = site_packages(venv)
    assert site is not None  # venv_problem checked it
    linked = build_overlay(site, tmp / "lmcache-overlay")
    pids: list[int] = []
    server_at_ready: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LMCacheServer(venv, dargs.host_gib, dargs.block_size, tmp / "lmcache.log"))
        stack.callback(remove_segments, pids)  # the engines have exited by then: their segments are garbage
        side = LMCacheSide(server.port, tmp / "lmcache-overlay")
        base = dict(model_dir=model_dir, workload=workload, dtype=dargs.dtype, block_size=dargs.block_size,
                    device_blocks=dargs.device_blocks, host_gib=dargs.host_gib, binding=binding)
        settings = [EngineSettings(with_kvoffload=False, **base), EngineSettings(with_kvoffload=True, **base),
                    EngineSettings(with_kvoffload=False, lmcache=side, **base)]

        def ready() -> None:
            server_at_ready.update(cpu_s=server.cpu_seconds(), l1_bytes=server.l1_used_bytes())

        _progress("starting three vLLM engines (plain, kvoffload, LMCache) in child processes")
        runs, controls = demo.serve_engines(settings, _progress, on_start=pids.append, on_ready=ready)
        server_figures = {"cpu_s": server.cpu_seconds() - server_at_ready["cpu_s"],
                          "l1_stored_bytes": server.l1_used_bytes() - server_at_ready["l1_bytes"],
                          "chunk_size": dargs.block_size, "l1_gib": dargs.host_gib, "overlay": linked}
    off, on, lmc = runs
    return {"on": summarize(off, on, controls["on"]), "lmc": summarize(off, lmc, controls["lmc"]),
            "server": server_figures, "settings": demo._settings(workload, dargs, binding)}


def side_rows(run: int, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per side (kvoffload, LMCache) of one run: TTFT ratios against plain vLLM on hit and miss turns,
    prompt tokens served from the offload tier, bytes moved, output equality, the helper process's CPU time."""
    rows = []
    for name, label in SIDES.items():
        summary = measured[name]
        side = summary["on"]  # summarize() names the side compared with plain vLLM "on"
        control = summary.get("control") or {}
        served = sum(t["offload_hit_tokens"] for t in summary["turns"])
        if name == "lmc":
            stored, helper_cpu = measured["server"]["l1_stored_bytes"], measured["server"]["cpu_s"]
        else:
            stored, helper_cpu = side["bytes_stored"], None  # kvoffload runs inside the engine: no helper
        rows.append({
            "run": run, "side": label, "hit_turns": summary["hit_turns"],
            "hit_ttft_ratio": summary["ttft_ratio_hit_turns"], "miss_turns": summary["miss_turns"],
            "miss_ttft_ratio": summary["ttft_ratio_miss_turns"], "tokens_from_tier": served,
            "tier_hit_rate": side["offload_hit_rate"], "bytes_loaded": side["bytes_loaded"],
            "bytes_stored": stored, "outputs_match": summary["outputs_match"],
            "control_holds": control.get("holds"), "helper_cpu_s": helper_cpu,
            "ttft_median_ms": round(side["ttft_median_s"] * 1e3, 1),
            "plain_ttft_median_ms": round(summary["off"]["ttft_median_s"] * 1e3, 1),
            "cpu_bind": side.get("cpu_bind"), "omp_threads": side.get("omp_threads"),
            "plain_cpu_bind": summary["off"].get("cpu_bind"), "plain_omp_threads": summary["off"].get("omp_threads"),
        })
    return rows


def report(rows: list[dict[str, Any]], last: dict[str, Any], args: argparse.Namespace) -> Report:
    headers = ("run", "side", "hit turns", "hit TTFT x plain", "miss turns", "miss TTFT x plain", "tokens from tier",
               "hit rate", "MiB loaded", "MiB stored", "outputs match", "helper CPU s", "CPUs", "threads")
    table = format_table(headers, [[r["run"], r["side"], r["hit_turns"], r["hit_ttft_ratio"], r["miss_turns"],
                                    r["miss_ttft_ratio"], r["tokens_from_tier"], r["tier_hit_rate"],
                                    round(r["bytes_loaded"] / 2**20, 2), round(r["bytes_stored"] / 2**20, 2),
                                    r["outputs_match"], "-" if r["helper_cpu_s"] is None else r["helper_cpu_s"],
                                    r["cpu_bind"], r["omp_threads"]]
                                   for r in rows])
    server = last["server"]
    notes = (
        "TTFT x plain: median TTFT of the side's hit turns (tokens loaded from its tier) or miss turns over the same "
        "turns' median on plain vLLM; the three engines serve each request one after another, order reversed "
        "every request",
        f"equal granularity and capacity: LMCache --chunk-size {server['chunk_size']} = vLLM block size, "
        f"its L1 {server['l1_gib']} GiB = kvoffload's host tier",
        "tokens from tier: prompt tokens loaded instead of computed (kvoffload's counter; for LMCache vLLM's "
        "vllm:external_prefix_cache_hits); LMCache's MiB loaded are those tokens' KV bytes, its MiB stored the "
        "growth of its server's L1 over the workload (its /status)",
        "outputs match: same tokens and top-20 logprobs as plain vLLM on every turn; None unless the side's control "
        "(one prompt token changed inside a loaded run moves plain vLLM's outputs) held",
        "helper CPU s: user+system CPU of the LMCache server process from warm engines to the end (kvoffload has no "
        "helper process: its copies run in the engine)",
        "CPUs, threads: what the side's engine computed with (OpenMP threads bound to those CPUs), the same as plain "
        "vLLM's (engines bound differently are not compared); the LMCache server is not bound",
        f"demo options: {args.demo_args or '(defaults)'}",
    )
    settings = {"runs": args.runs, "demo_args": args.demo_args, "lmcache_venv": str(lmcache_venv(args)),
                "lmcache_overlay_modules": server["overlay"], **last["settings"],
                "turns_last_run": {name: last[name]["turns"] for name in SIDES}}
    return Report("peer", rows, table, notes, settings)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
