"""``kvoffload replay``: one trace at one capacity through every chosen policy, beside the optimum and the
unbounded maximum."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvoffload.tools.bench.common import format_table
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
from kvoffload.tools.replay.sweep import Point, load, run_points

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


def run(args: argparse.Namespace) -> int:
    try:
        bpt = bytes_per_token(args.model)
        capacity_tokens = parse_capacity(args.capacity, bpt)
        policies = parse_policies(args.policy)
        admission = parse_admission(args.admission)
        trace, _ = load(args.trace, with_future=False)
    except ValueError as e:
        return fail("replay", e)
    blocks = max(1, capacity_tokens // trace.block_tokens)
    strategies: list[Strategy] = [*policies, Bound.OPTIMUM, Bound.UNBOUNDED]
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
