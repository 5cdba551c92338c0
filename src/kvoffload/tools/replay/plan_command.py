"""``kvoffload plan``: a capacity sweep of a trace over every policy, beside the optimum and the unbounded maximum,
with what the hits buy (prefill compute skipped) and cost (bytes moved, load time per tier); with ``--tenants``,
tenants' shares of one tier (``plan_tenants.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvoffload.blocks import Medium
from kvoffload.config import EvictionPolicy, HostTierConfig, StoreAdmission
from kvoffload.tools.bench.common import Progress, format_table
from kvoffload.tools.replay.loop import Bound, Strategy
from kvoffload.tools.replay.models import GIB, kv_shape, parse_capacity
from kvoffload.tools.replay.plan_tenants import run_tenants
from kvoffload.tools.replay.report import (
    add_trace_arguments,
    bounds_at,
    fail,
    parse_admission,
    parse_policies,
    result_doc,
)
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.shares import STEP
from kvoffload.tools.replay.sweep import capacity_sweep, load, run_points, sweep_points

DEFAULT_POINTS = 12
MEDIA = [m.value for m in Medium.BUILT_IN if m != Medium.DEVICE]


class Inputs(NamedTuple):
    """The plan's validated options."""

    bpt: int
    capacities: list[int]
    """In blocks."""
    block_tokens: int
    requests: int
    admission: StoreAdmission
    cost_policy: EvictionPolicy
    bandwidths: dict[str, float]
    """GB/s (10^9 bytes per second, as ``kvoffload bench`` prints) per medium."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--model", required=True, help="model preset or config.json (KV bytes per token)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="draw hit rate against capacity into PNG")
    parser.add_argument("--points", type=int, default=DEFAULT_POINTS,
                        help=f"log-spaced capacities from 0.1M to 30M tokens or the trace's footprint "
                             f"(default {DEFAULT_POINTS})")
    parser.add_argument("--capacities", default=None,
                        help="comma-separated capacities instead of the sweep (3M,10M or 24GiB,96GiB)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None,
                        help="the engine's prefill throughput: prints the prefill compute the hits skip")
    parser.add_argument("--bandwidth", action="append", default=[], metavar="MEDIUM=GBPS",
                        help=f"a tier's load bandwidth in GB/s (from kvoffload bench), MEDIUM one of "
                             f"{', '.join(MEDIA)}; repeatable")
    default = HostTierConfig().policy.value
    parser.add_argument("--policy", default=default,
                        help=f"the policy the cost table assumes (default {default}, the tier's default)")
    parser.add_argument("--tenants", action="store_true",
                        help="suggest each tenant's share of a tier of --capacity for a multi-tenant trace, from "
                             "each tenant's hit curve alone (shares in steps of 0.05)")
    parser.add_argument("--capacity", default=None, help="with --tenants: the tier the shares split (3M, 24GiB)")
    parser.add_argument("--floor", type=float, default=STEP,
                        help=f"with --tenants: the least share of any tenant (default {STEP:g})")


def run(args: argparse.Namespace) -> int:
    if args.tenants:
        try:
            return run_tenants(args)
        except ValueError as e:
            return fail("plan", e)
    try:
        inputs = _inputs(args)
    except ValueError as e:
        return fail("plan", e)
    strategies: list[Strategy] = [*EvictionPolicy, Bound.OPTIMUM]
    points = sweep_points(inputs.capacities, strategies, inputs.admission)
    progress = Progress("replaying", len(points), enabled=not args.json and sys.stderr.isatty())
    results = run_points(args.trace, points, args.workers, lambda r: progress.advance(r.strategy))
    progress.close()
    grid = _grid(results, inputs.capacities)
    if args.json:
        print(json.dumps(_doc(args, inputs, results, grid), indent=1))
    else:
        _print(args, inputs, results, grid)
    if args.plot:
        _plot(args, inputs, results, grid)
    return 0


def _inputs(args: argparse.Namespace) -> Inputs:
    bpt = kv_shape(args.model).bytes_per_token
    admission = parse_admission(args.admission)
    cost_policy = parse_policies([args.policy])[0]
    bandwidths = dict(_bandwidth(text) for text in args.bandwidth)
    if args.prefill_tokens_per_s is not None and args.prefill_tokens_per_s <= 0:
        raise ValueError(f"--prefill-tokens-per-s {args.prefill_tokens_per_s} must be positive")
    if args.points <= 0:
        raise ValueError(f"--points {args.points} must be positive")
    trace, _ = load(args.trace, with_future=False)
    if args.capacities:
        tokens = [parse_capacity(text, bpt) for text in args.capacities.split(",")]
        capacities = sorted({max(1, t // trace.block_tokens) for t in tokens})
    else:
        capacities = capacity_sweep(trace, args.points)
    return Inputs(bpt, capacities, trace.block_tokens, len(trace.requests), admission, cost_policy, bandwidths)


def _bandwidth(text: str) -> tuple[str, float]:
    medium, _, value = text.partition("=")
    if medium not in MEDIA:
        raise ValueError(f"--bandwidth {text!r}: expected MEDIUM=GBPS with MEDIUM one of {', '.join(MEDIA)}")
    try:
        gbps = float(value)
    except ValueError:
        raise ValueError(f"--bandwidth {text!r}: {value!r} is not a number of GB/s") from None
    if gbps <= 0:
        raise ValueError(f"--bandwidth {text!r}: the bandwidth must be positive")
    return medium, gbps


Grid = list[dict[str, ReplayResult]]
"""Per capacity (in sweep order), each strategy's result by name."""


def _grid(results: Sequence[ReplayResult], capacities: Sequence[int]) -> Grid:
    by_capacity: dict[int, dict[str, ReplayResult]] = {c: {} for c in capacities}
    for r in results:
        if r.strategy != Bound.UNBOUNDED.value:
            by_capacity[r.capacity_blocks][r.strategy] = r
    return [by_capacity[c] for c in capacities]


def _unbounded(results: Sequence[ReplayResult]) -> ReplayResult:
    return next(r for r in results if r.strategy == Bound.UNBOUNDED.value)


def _cost_row(r: ReplayResult, inputs: Inputs, tps: float | None) -> dict[str, Any]:
    """What the hits of ``r`` buy and cost: prefill seconds skipped, bytes per hit token, load seconds per tier."""
    bpt, hit = inputs.bpt, max(r.hit_tokens, 1)
    row: dict[str, Any] = {
        "capacity_tokens": r.capacity_tokens, "policy": r.strategy, "hit_tokens": r.hit_tokens,
        "loaded_gib": r.loaded_bytes(bpt) / GIB, "stored_gib": r.stored_bytes(bpt) / GIB,
        "loaded_bytes_per_hit_token": r.loaded_bytes(bpt) / hit,
        "stored_bytes_per_hit_token": r.stored_bytes(bpt) / hit}
    if tps is not None:
        row["prefill_saved_s"] = r.hit_tokens / tps
    for medium, gbps in inputs.bandwidths.items():
        row[f"load_s_{medium}"] = r.loaded_bytes(bpt) / (gbps * 1e9)
    return row


def _doc(args: argparse.Namespace, inputs: Inputs, results: Sequence[ReplayResult], grid: Grid) -> dict[str, Any]:
    bpt, unbounded = inputs.bpt, _unbounded(results)
    points = []
    for row in grid:
        bounds = bounds_at(results, next(iter(row.values())).capacity_blocks)
        points.append({"capacity_tokens": bounds.optimum.capacity_tokens,
                       "capacity_gib": bounds.optimum.capacity_tokens * bpt / GIB,
                       "results": {name: result_doc(r, bounds, bpt) for name, r in row.items()}})
    return {"trace": args.trace, "model": args.model, "bytes_per_token": bpt, "block_tokens": inputs.block_tokens,
            "requests": inputs.requests, "admission": inputs.admission.value,
            "unbounded": unbounded.to_dict(bpt), "points": points,
            "costs": [_cost_row(row[inputs.cost_policy.value], inputs, args.prefill_tokens_per_s) for row in grid],
            "per_hit_token": _per_token(inputs, args.prefill_tokens_per_s)}


def _per_token(inputs: Inputs, tps: float | None) -> dict[str, float]:
    """Seconds to load one token's KV from each tier, and to recompute it."""
    times = {f"load_s_{medium}": inputs.bpt / (gbps * 1e9) for medium, gbps in inputs.bandwidths.items()}
    if tps is not None:
        times["recompute_s"] = 1 / tps
    return times


def _print(args: argparse.Namespace, inputs: Inputs, results: Sequence[ReplayResult], grid: Grid) -> None:
    bpt, unbounded = inputs.bpt, _unbounded(results)
    print(f"kvoffload plan: {args.trace}, {inputs.requests} requests, {args.model} ({bpt:,} KV bytes per token), "
          f"admission {inputs.admission.value}")
    names = [p.value for p in EvictionPolicy]
    headers = ["tokens", "GiB", *(h for n in names for h in (n, f"{n}/opt")), "optimum"]
    rows = []
    for row in grid:
        bounds = bounds_at(results, next(iter(row.values())).capacity_blocks)
        cells: list[object] = [bounds.optimum.capacity_tokens, bounds.optimum.capacity_tokens * bpt / GIB]
        for n in names:
            cells += [row[n].token_hit_rate, bounds.fraction(row[n])]
        rows.append([*cells, bounds.optimum.token_hit_rate])
    print(format_table(headers, rows))
    print(f"  unbounded maximum {unbounded.token_hit_rate:.3f} (footprint {unbounded.capacity_tokens:,} tokens, "
          f"{unbounded.capacity_tokens * bpt / GIB:.1f} GiB); hit rate = hit tokens / input tokens")
    _print_costs(args, inputs, grid)


_HEADERS = {"loaded_gib": "loaded GiB", "stored_gib": "stored GiB", "loaded_bytes_per_hit_token": "loaded B/hit token",
            "stored_bytes_per_hit_token": "stored B/hit token"}


def _print_costs(args: argparse.Namespace, inputs: Inputs, grid: Grid) -> None:
    tps = args.prefill_tokens_per_s
    costs = [_cost_row(row[inputs.cost_policy.value], inputs, tps) for row in grid]
    keys = ["capacity_tokens", "hit_tokens", *(["prefill_saved_s"] if tps else []), "loaded_gib", "stored_gib",
            "loaded_bytes_per_hit_token", "stored_bytes_per_hit_token", *(f"load_s_{m}" for m in inputs.bandwidths)]
    print(f"\nwhat the hits buy and cost, policy {inputs.cost_policy.value}:")
    print(format_table([_HEADERS.get(k, k.replace("_", " ")) for k in keys], [[c[k] for k in keys] for c in costs]))
    for name, seconds in _per_token(inputs, tps).items():
        print(f"  per hit token, {name.replace('_s_', ' from ').replace('_s', '')}: {seconds * 1e6:.3g} us")


def _plot(args: argparse.Namespace, inputs: Inputs, results: Sequence[ReplayResult], grid: Grid) -> None:
    from kvoffload.tools.replay.plot import draw_plan

    tokens = [next(iter(row.values())).capacity_tokens for row in grid]
    curves = {p.value: [row[p.value].token_hit_rate for row in grid] for p in EvictionPolicy}
    optimum = [row[Bound.OPTIMUM.value].token_hit_rate for row in grid]
    title = f"{args.trace.rsplit('/', 1)[-1]}: {inputs.requests} requests, admission {inputs.admission.value}"
    try:
        draw_plan(args.plot, title, tokens, curves, optimum, _unbounded(results).token_hit_rate, inputs.bpt)
    except ModuleNotFoundError as e:
        print(f"kvoffload plan: no plot written ({e})", file=sys.stderr)
