"""``kvoffload bench e2e``: the vLLM demo's time-to-first-token figures, with and without kvoffload, as a bench.

The demo (``kvoffload.tools.vllm.demo``) serves one multi-turn chat on two real vLLM (CPU) engines side by
side, one without and one with kvoffload (each in a child process, taking turns per request so both see the same
machine load), and writes its summary to ``demo.json``. This module runs it ``--runs`` times
through its own entry point (``run(args)``, with ``--json --no-chart --out <temp dir>``), reads each ``demo.json``
and prints the suite's way (machine facts, table, ``--json``, ``--plot``): per run, the median TTFT of the turns
kvoffload served from its tier (hit turns) and of the others (miss turns), each beside the same turns without
kvoffload, and the CPUs and OpenMP threads each engine reported (the demo binds both alike and refuses engines that
differ: ``tools/vllm/cpu_binding.py``). Per-turn rows of the last run come out in ``--json``.

When vLLM or the demo is missing it says "demo not available" and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from kvoffload.tools.bench.common import Progress, Report, add_common_arguments, bar_plot, emit, format_table
from kvoffload.tools.vllm.cpu_binding import FLAG, FLAG_HELP

DEMO_MODULE = "kvoffload.tools.vllm.demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, runs=1, warmup=0)
    parser.add_argument("--demo-args", default="",
                        help="options passed to the demo, in one quoted string (see `kvoffload demo --help`)")
    parser.add_argument(FLAG, metavar="CPUS", default=None, help=FLAG_HELP)


def load_demo() -> ModuleType | str:
    """The demo module, or why it cannot be used (vLLM or the demo missing)."""
    try:
        import vllm  # noqa: F401 (the demo imports vLLM only when it runs; fail here, clearly)

        demo = importlib.import_module(DEMO_MODULE)
    except ImportError as e:
        return f"demo not available ({e})"
    if not callable(getattr(demo, "run", None)) or not callable(getattr(demo, "add_arguments", None)):
        return f"demo not available ({DEMO_MODULE} has no run(args) / add_arguments(parser))"
    return demo


def demo_args(demo: ModuleType, text: str, out: Path, cpu_bind: str | None = None) -> argparse.Namespace:
    """The demo's options: its defaults, ``--demo-args``, ``--cpu-bind`` when given, and JSON into ``out`` without a
    chart."""
    parser = argparse.ArgumentParser(prog="kvoffload demo")
    demo.add_arguments(parser)
    bind = [FLAG, cpu_bind] if cpu_bind is not None else []
    return parser.parse_args([*shlex.split(text), *bind, "--json", "--no-chart", "--out", str(out)])


def run_demo(demo: ModuleType, text: str, cpu_bind: str | None = None) -> dict[str, Any]:
    """One run of the demo; its ``demo.json`` summary."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-e2e-") as tmp:
        with contextlib.redirect_stdout(io.StringIO()):  # the demo prints its own JSON; ours replaces it
            status = demo.run(demo_args(demo, text, Path(tmp), cpu_bind))
        if status != 0:
            raise RuntimeError(f"kvoffload bench e2e: the demo exited with {status}")
        summary: dict[str, Any] = json.loads((Path(tmp) / "demo.json").read_text())
    return summary


def summary_row(run: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Median TTFT (ms) of hit and miss turns, with and without kvoffload, from one demo summary."""
    turns = summary["turns"]
    control = summary.get("control") or {}
    row: dict[str, Any] = {"run": run, "outputs_match": summary.get("outputs_match"),
                           "control_shift": "tokens" if control.get("tokens_changed") else control.get(
                               "max_logprob_shift"),
                           "control_holds": control.get("holds")}
    for side in ("off", "on"):
        row.update({f"cpu_bind_{side}": summary[side].get("cpu_bind"),
                    f"omp_threads_{side}": summary[side].get("omp_threads")})
    for kind, hit in (("hit", True), ("miss", False)):
        chosen = [t for t in turns if (t["offload_hit_tokens"] > 0) == hit]
        off = statistics.median(t["ttft_off_s"] * 1e3 for t in chosen) if chosen else None
        on = statistics.median(t["ttft_on_s"] * 1e3 for t in chosen) if chosen else None
        row.update({f"{kind}_turns": len(chosen), f"{kind}_ttft_ms_off": off, f"{kind}_ttft_ms_on": on,
                    f"{kind}_ratio": on / off if on is not None and off else None})
    return row


def run(args: argparse.Namespace) -> int:
    demo = load_demo()
    if isinstance(demo, str):
        print(f"kvoffload bench e2e: {demo}", file=sys.stderr)
        return 2
    progress = Progress("bench e2e", args.runs, enabled=not args.quiet)
    summaries = []
    for _ in range(args.runs):
        summaries.append(run_demo(demo, args.demo_args, args.cpu_bind))
        progress.advance()
    progress.close()
    rows = [summary_row(i, s) for i, s in enumerate(summaries)]
    emit(report(rows, summaries[-1], args), args, plot=lambda path: _plot(path, summaries[-1]))
    return 0


def report(rows: list[dict[str, Any]], last: dict[str, Any], args: argparse.Namespace) -> Report:
    headers = ("run", "hit turns", "TTFT off ms", "TTFT on ms", "ratio", "miss turns", "TTFT off ms", "TTFT on ms",
               "ratio", "control shift", "outputs match", "CPUs", "threads")
    keys = ("run", "hit_turns", "hit_ttft_ms_off", "hit_ttft_ms_on", "hit_ratio", "miss_turns", "miss_ttft_ms_off",
            "miss_ttft_ms_on", "miss_ratio", "control_shift", "outputs_match", "cpu_bind_on", "omp_threads_on")
    table = format_table(headers, [[r[k] for k in keys] for r in rows])
    notes = ("median TTFT per run over hit turns (kvoffload loaded tokens) and miss turns; off = vLLM alone, "
             "on = vLLM + kvoffload, same prompts, two engines side by side taking turns per request",
             "control shift: how far one prompt token changed inside a loaded run moved plain vLLM's top-20 "
             "logprobs ('tokens': the generated tokens changed); outputs match is None unless it is >= 0.1",
             "CPUs, threads: what both engines computed with (OpenMP threads bound to those CPUs); the demo refuses "
             "to compare engines that report different ones",
             f"demo options: {args.demo_args or '(defaults)'}")
    settings = {"runs": args.runs, "demo_args": args.demo_args, "cpu_binding": last.get("cpu_binding"),
                "demo_turns_last_run": last.get("turns", [])}
    return Report("e2e", rows, table, notes, settings)


def _plot(path: str, summary: dict[str, Any]) -> None:
    turns = summary["turns"]
    bar_plot(path, "time to first token per turn", [f"c{t['conversation']} t{t['turn']}" for t in turns],
             {"vLLM": [t["ttft_off_s"] * 1e3 for t in turns],
              "vLLM + kvoffload": [t["ttft_on_s"] * 1e3 for t in turns]}, "ms")
