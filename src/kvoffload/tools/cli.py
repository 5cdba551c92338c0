"""The ``kvoffload`` command: ``simulate``, ``demo``, ``replay``, ``plan``, ``node`` and the ``bench`` suite.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file only
wires them, importing a module when its subcommand runs (so ``kvoffload bench copy`` never imports vLLM).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("kvoffload.tools.simulate", "run a multi-turn chat workload through the simulated engine"),
    "demo": ("kvoffload.tools.vllm.demo", "real vLLM (CPU) with and without kvoffload, TTFT per turn"),
    "replay": ("kvoffload.tools.replay.replay_command",
               "a request trace through every policy, beside the offline optimum"),
    "plan": ("kvoffload.tools.replay.plan_command", "size a tier: hit rate against capacity for a trace and a model"),
    "node": ("kvoffload.tools.node", "the node pools on this machine: status, and remove one no engine uses"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "copy": ("kvoffload.tools.bench.copy", "device<->host copy GB/s beside memcpy of the same bytes"),
    "disk": ("kvoffload.tools.bench.disk", "host<->disk GB/s beside raw sequential I/O, index rebuild time"),
    "node": ("kvoffload.tools.bench.node", "loads from the node pool engines share beside a private host pool"),
    "pool": ("kvoffload.tools.bench.pool", "a fresh host pool's first stores, cold and warmed, beside warm ones"),
    "remote": ("kvoffload.tools.bench.remote", "host<->Redis GB/s beside raw redis-py pipelines of the same bytes"),
    "object": ("kvoffload.tools.bench.object", "host<->S3 GB/s beside boto3's own PUT/GET, lookup round trips"),
    "faults": ("kvoffload.tools.bench.faults", "longest engine step under store faults, lookups off vs on the step"),
    "manager": ("kvoffload.tools.bench.manager", "scheduler-side operations per second beside vLLM's manager"),
    "overhead": ("kvoffload.tools.bench.overhead", "connector time per engine step on the miss path"),
    "e2e": ("kvoffload.tools.bench.e2e", "the vLLM demo's TTFT figures"),
    "peer": ("kvoffload.tools.bench.peer", "the demo beside vLLM + LMCache: TTFT, tier hits, bytes, outputs"),
    "serve": ("kvoffload.tools.bench.serve",
              "vLLM's OpenAI server without and with kvoffload, driven by vLLM's own client"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(module=module)
    try:
        importlib.import_module(module).add_arguments(p)
    except ModuleNotFoundError as e:
        # A subcommand whose optional dependency (vLLM, matplotlib) is missing still shows in --help and fails
        # with a clear message when run.
        p.set_defaults(missing=str(e))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description="KV-cache offloading for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHES.items():
        _add(bench_sub, name, module, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "missing", None):
        print(f"kvoffload {args.command}: unavailable ({args.missing})", file=sys.stderr)
        return 2
    result: int = importlib.import_module(args.module).run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
