"""``kvoffload replay``: one trace at one capacity through every chosen policy, beside the optimum and the
unbounded maximum; with ``--engines N``, N private tiers of C/N beside one node pool of C (``engines.py``); with
``--tenants SPEC``, each tenant with quotas, without, and alone on its share (``tenants.py``); with ``--sessions``,
session turns and one-off prompts apart, without and with retention hints (``session_report.py``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.bench.common import format_table
from kvoffload.tools.replay.engines import (
    Comparison,
    Engines,
    Router,
    Setup,
    compare,
    jobs,
    parse_engines,
    private_capacity,
    run_jobs,
)
from kvoffload.tools.replay.loop import Bound, Strategy
from kvoffload.tools.replay.models import GIB, parse_capacity
from kvoffload.tools.replay.report import (
    Bounds,
    add_trace_arguments,
    bounds_at,
    bytes_per_token,
    fail,
    gib,
    parse_admission,
    parse_policies,
    result_doc,
)
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.session_report import (
    add_session_arguments,
    check_session_options,
    session_rows,
    session_summary,
    sessions_doc,
    sessions_table,
)
from kvoffload.tools.replay.sweep import Point, load, run_points
from kvoffload.tools.replay.tenant_report import TenantOptions, tenant_options, tenants_doc, tenants_table
from kvoffload.tools.replay.tenants import EQUAL, compare_tenants
from kvoffload.tools.replay.trace import Trace, write_trace

DEFAULT_CAPACITY = "3M"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--capacity", default=DEFAULT_CAPACITY,
                        help=f"tier capacity in tokens (3000000, 3M) or bytes of KV (24GiB; needs --model); "
                             f"default {DEFAULT_CAPACITY}")
    parser.add_argument("--policy", action="append", default=None,
                        help="eviction policy to replay (repeatable; default every policy)")
    parser.add_argument("--model", default=None,
                        help="model preset or config.json, for bytes loaded and stored (and GiB capacities)")
    parser.add_argument("--engines", type=int, default=None,
                        help="engines on the node: replay N private tiers of capacity/N beside one node pool")
    parser.add_argument("--router", default=None,
                        help=f"how requests reach the engines: {', '.join(r.value for r in Router)} "
                             f"(default {Router.ROUND_ROBIN.value}; needs --engines)")
    parser.add_argument("--seed", type=int, default=None, help="the random router's seed (default 0)")
    parser.add_argument("--tenants", default=None, metavar="SPEC",
                        help='tenants\' shares of the tier, as tenant_quota: \'{"default": 0.2, "t0": 0.4, ...}\', '
                             f'or {EQUAL} (every tenant of the trace, equal shares): each tenant\'s hit rate with '
                             'quotas, without, and alone on a pool of its share (one --policy, default lru)')
    add_session_arguments(parser)
    parser.add_argument("--save-trace", default=None, metavar="PATH",
                        help="also write the trace replayed to PATH (JSONL; a synthetic or agentic one as a file)")


def run(args: argparse.Namespace) -> int:
    try:
        bpt = bytes_per_token(args.model)
        capacity_tokens = parse_capacity(args.capacity, bpt)
        policies = parse_policies(args.policy)
        admission = parse_admission(args.admission)
        engines = parse_engines(args.engines, args.router, args.seed)
        trace, _ = load(args.trace, with_future=False)
        tenants = tenant_options(args, trace, policies, admission) if args.tenants is not None else None
        if args.sessions:
            check_session_options(args)
        if args.save_trace is not None:
            write_trace(trace, args.save_trace)
    except ValueError as e:
        return fail("replay", e)
    blocks = max(1, capacity_tokens // trace.block_tokens)
    if args.sessions:
        return _run_sessions(args, trace, policies if args.policy else None, blocks, bpt)
    if tenants is not None:
        return _run_tenants(args, trace, tenants, blocks, bpt)
    strategies: list[Strategy] = [*policies, Bound.OPTIMUM, Bound.UNBOUNDED]
    if engines is not None:
        return _run_engines(args, trace, engines, strategies, blocks, admission, bpt)
    results = run_points(args.trace, [Point(s, blocks, admission) for s in strategies], args.workers)
    bounds = bounds_at(results, blocks)
    if args.json:
        doc: dict[str, Any] = {
            "trace": args.trace, "requests": len(trace.requests), "block_tokens": trace.block_tokens,
            "capacity_tokens": blocks * trace.block_tokens, "bytes_per_token": bpt, "admission": admission.value,
            "results": [result_doc(r, bounds, bpt) for r in results]}
        print(json.dumps(doc, indent=1))
    else:
        print(_summary(args.trace, len(trace.requests), blocks * trace.block_tokens, bpt))
        print(_table(results, bounds, bpt))
    return 0


def _run_tenants(args: argparse.Namespace, trace: Trace, options: TenantOptions, blocks: int,
                 bpt: int | None) -> int:
    comparison = compare_tenants(trace, blocks, options.quotas, options.kind)
    if args.json:
        doc: dict[str, Any] = {
            "trace": args.trace, "requests": len(trace.requests), "block_tokens": trace.block_tokens,
            "capacity_tokens": blocks * trace.block_tokens, "bytes_per_token": bpt,
            **tenants_doc(comparison, options, bpt)}
        print(json.dumps(doc, indent=1))
    else:
        print(_summary(args.trace, len(trace.requests), blocks * trace.block_tokens, bpt))
        print(f"policy {options.kind.value} in each tenant; quotas {json.dumps(options.quotas.spec())}; token hit "
              f"rates with quotas, without (one pool), and alone on a pool of the tenant's share")
        print(tenants_table(comparison, bpt))
    return 0


def _run_sessions(args: argparse.Namespace, trace: Trace, policies: list[EvictionPolicy] | None, blocks: int,
                  bpt: int | None) -> int:
    rows = session_rows(trace, blocks, policies, args.retain_share, args.max_retain_s)
    if args.json:
        doc: dict[str, Any] = {
            "trace": args.trace, "requests": len(trace.requests), "block_tokens": trace.block_tokens,
            "capacity_tokens": blocks * trace.block_tokens, "retain_share": args.retain_share,
            "max_retain_s": args.max_retain_s, **sessions_doc(rows)}
        print(json.dumps(doc, indent=1))
    else:
        print(_summary(args.trace, len(trace.requests), blocks * trace.block_tokens, bpt))
        print(session_summary(trace, args))
        print(sessions_table(rows))
    return 0


def _summary(path: str, requests: int, capacity_tokens: int, bpt: int | None) -> str:
    size = f" ({gib(capacity_tokens, bpt):.3g} GiB of KV)" if bpt is not None else ""
    return f"kvoffload replay: {path}, {requests} requests, capacity {capacity_tokens:,} tokens{size}"


def _table(results: list[ReplayResult], bounds: Bounds, bpt: int | None) -> str:
    headers = ["strategy", "admission", "token hit", "of optimum", "block hit", "stored", "evicted unread",
               "declined", "seconds"]
    if bpt is not None:
        headers[6:6] = ["loaded GiB", "stored GiB"]
    rows = []
    for r in results:
        row: list[object] = [r.strategy, r.admission, r.token_hit_rate, bounds.fraction(r), r.block_hit_rate,
                             r.stored_blocks, r.wasted_blocks, r.declined_blocks, round(r.seconds, 2)]
        if bpt is not None:
            row[6:6] = [r.loaded_bytes(bpt) / GIB, r.stored_bytes(bpt) / GIB]
        rows.append(row)
    return format_table(headers, rows)


def _run_engines(args: argparse.Namespace, trace: Trace, engines: Engines, strategies: list[Strategy], blocks: int,
                 admission: StoreAdmission, bpt: int | None) -> int:
    """Every strategy in both setups; the node rows are the one-tier replay's ``results``."""
    todo = jobs(strategies, blocks, admission, engines)
    pairs = compare(run_jobs(args.trace, todo, args.workers), todo)
    by_strategy = {p.strategy: p for p in pairs}
    optimum, unbounded = by_strategy[Bound.OPTIMUM.value], by_strategy[Bound.UNBOUNDED.value]
    private_bounds = Bounds(optimum.private, unbounded.private)
    node_bounds = Bounds(optimum.node, unbounded.node)
    per_engine = private_capacity(blocks, engines.count) * trace.block_tokens
    if args.json:
        doc: dict[str, Any] = {
            "trace": args.trace, "requests": len(trace.requests), "block_tokens": trace.block_tokens,
            "capacity_tokens": blocks * trace.block_tokens, "bytes_per_token": bpt, "admission": admission.value,
            "engines": {"count": engines.count, "router": engines.router.value, "seed": engines.seed,
                        "private_capacity_tokens": per_engine},
            "results": [result_doc(p.node, node_bounds, bpt) for p in pairs],
            Setup.PRIVATE.value: [result_doc(p.private, private_bounds, bpt) for p in pairs],
            "comparison": [{"strategy": p.strategy, "private_token_hit_rate": p.private.token_hit_rate,
                            "node_token_hit_rate": p.node.token_hit_rate, "gain": p.gain, "ratio": p.ratio}
                           for p in pairs]}
        print(json.dumps(doc, indent=1))
    else:
        print(_summary(args.trace, len(trace.requests), blocks * trace.block_tokens, bpt))
        seed = f" (seed {engines.seed})" if engines.router is Router.RANDOM else ""
        print(f"{engines.count} engines, router {engines.router.value}{seed}: private tiers of {per_engine:,} "
              f"tokens each, or one node pool of {blocks * trace.block_tokens:,} tokens")
        print(_engines_table(pairs))
    return 0


def _engines_table(pairs: list[Comparison]) -> str:
    headers = ["strategy", "admission", "private hit", "node hit", "node - private", "node / private",
               "private stored", "node stored"]
    rows = [[p.strategy, p.node.admission, p.private.token_hit_rate, p.node.token_hit_rate, p.gain, p.ratio,
             p.private.stored_blocks, p.node.stored_blocks] for p in pairs]
    return format_table(headers, rows)
