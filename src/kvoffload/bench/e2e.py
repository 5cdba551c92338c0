"""``kvoffload bench e2e``: the vLLM demo's time-to-first-token figures, with and without kvoffload, as a bench.

The demo (``kvoffload.integrations.vllm.demo``) runs real vLLM (CPU) twice over the same multi-turn chat, with and
without kvoffload, in one process. This module only runs it and prints its rows the way the other benches do
(machine facts, table, ``--json``, ``--plot``). The contract it relies on: the demo module exposes
``add_arguments(parser)`` (its own options) and ``measure(args) -> list[dict]``, one dict per turn or summary row
with at least ``label``, ``ttft_ms_baseline`` and ``ttft_ms_kvoffload``; any further keys are shown as they are.

When vLLM or the demo is missing (or does not offer ``measure`` yet) it says so and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from types import ModuleType
from typing import Any

from kvoffload.bench.common import Report, add_common_arguments, bar_plot, emit, format_table

DEMO_MODULE = "kvoffload.integrations.vllm.demo"
REQUIRED = ("label", "ttft_ms_baseline", "ttft_ms_kvoffload")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, runs=1, warmup=0)
    parser.add_argument("--demo-args", default="",
                        help="options passed to the demo, in one quoted string (see `kvoffload demo --help`)")


def load_demo() -> ModuleType | str:
    """The demo module, or why it cannot be used (vLLM or the demo missing, or no ``measure``)."""
    try:
        demo = importlib.import_module(DEMO_MODULE)
    except ImportError as e:
        return f"demo not available ({e})"
    if not callable(getattr(demo, "measure", None)) or not callable(getattr(demo, "add_arguments", None)):
        return f"demo not available ({DEMO_MODULE} has no measure(args) / add_arguments(parser) yet)"
    return demo


def demo_args(demo: ModuleType, text: str) -> argparse.Namespace:
    """The demo's own options: its defaults, overridden by ``--demo-args``."""
    parser = argparse.ArgumentParser(prog="kvoffload demo")
    demo.add_arguments(parser)
    return parser.parse_args(shlex.split(text))


def run(args: argparse.Namespace) -> int:
    demo = load_demo()
    if isinstance(demo, str):
        print(f"kvoffload bench e2e: {demo}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = [dict(r) for r in demo.measure(demo_args(demo, args.demo_args))]
    bad = [r for r in rows if any(k not in r for k in REQUIRED)]
    if bad:
        print(f"kvoffload bench e2e: demo rows lack {REQUIRED}: {bad[0]}", file=sys.stderr)
        return 2
    for r in rows:
        base, ours = float(r["ttft_ms_baseline"]), float(r["ttft_ms_kvoffload"])
        r.setdefault("speedup", base / ours if ours else None)
    emit(report(rows, args), args, plot=lambda path: _plot(path, rows))
    return 0


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> Report:
    headers = list(dict.fromkeys(k for r in rows for k in r))
    table = format_table(headers, [[r.get(h) for h in headers] for r in rows])
    notes = ("TTFT in ms; baseline = vLLM without kvoffload, same prompts, same process",)
    return Report("e2e", rows, table, notes, {"demo_args": args.demo_args})


def _plot(path: str, rows: list[dict[str, Any]]) -> None:
    bar_plot(path, "time to first token", [str(r["label"]) for r in rows],
             {"vLLM": [float(r["ttft_ms_baseline"]) for r in rows],
              "vLLM + kvoffload": [float(r["ttft_ms_kvoffload"]) for r in rows]}, "ms")
