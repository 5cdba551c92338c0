"""``kvoffload plan --tenants``: suggested shares of a tier of ``--capacity`` for a multi-tenant trace
(``shares.py``), each tenant's hit rate alone on its share and on the whole tier, and the ``--tenants`` value that
replays them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvoffload.tools.bench.common import format_table
from kvoffload.tools.replay.models import GIB, kv_shape, parse_capacity
from kvoffload.tools.replay.report import parse_policies
from kvoffload.tools.replay.shares import STEP, Suggestion, suggest_shares
from kvoffload.tools.replay.sweep import load


def run_tenants(args: argparse.Namespace) -> int:
    """Print the suggestion. Raises ValueError on bad input (the caller reports it)."""
    bpt = kv_shape(args.model).bytes_per_token
    if args.capacity is None:
        raise ValueError("--tenants needs --capacity, the tier the shares split")
    kind = parse_policies([args.policy])[0]
    trace, _ = load(args.trace, with_future=False)
    blocks = max(1, parse_capacity(args.capacity, bpt) // trace.block_tokens)
    suggestion = suggest_shares(trace, blocks, kind, args.floor)
    spec = json.dumps(suggestion.quotas.spec())
    if args.json:
        print(json.dumps(_doc(args, suggestion, blocks * trace.block_tokens, bpt), indent=1))
        return 0
    print(f"kvoffload plan --tenants: {args.trace}, {len(trace.requests)} requests, tier of "
          f"{blocks * trace.block_tokens:,} tokens ({blocks * trace.block_tokens * bpt / GIB:.3g} GiB), policy "
          f"{kind.value}, shares in steps of {STEP:g}, floor {args.floor:g}")
    print(_table(suggestion, blocks * trace.block_tokens, bpt))
    print(f"  default (tenants not in the trace, and steps no tenant gains from): {suggestion.quotas.default:g}")
    print(f"  replay them: kvoffload replay --trace {args.trace} --capacity {args.capacity} --tenants '{spec}'")
    return 0


def _table(suggestion: Suggestion, capacity_tokens: int, bpt: int) -> str:
    headers = ["tenant", "requests", "share", "share GiB", "alone on share", "alone on whole tier"]
    rows = []
    for curve, share in zip(suggestion.curves, suggestion.quotas.shares, strict=True):
        steps = round(share / suggestion.step)
        rows.append([curve.tenant, curve.results[0].requests, share, share * capacity_tokens * bpt / GIB,
                     curve.results[steps - 1].token_hit_rate, curve.results[-1].token_hit_rate])
    return format_table(headers, rows)


def _doc(args: argparse.Namespace, suggestion: Suggestion, capacity_tokens: int, bpt: int) -> dict[str, Any]:
    tenants = []
    for curve, share in zip(suggestion.curves, suggestion.quotas.shares, strict=True):
        tenants.append({"tenant": curve.tenant, "share": share, "requests": curve.results[0].requests,
                        "curve": [{"share": round((k + 1) * suggestion.step, 6), "token_hit_rate": r.token_hit_rate,
                                   "hit_tokens": r.hit_tokens} for k, r in enumerate(curve.results)]})
    return {"trace": args.trace, "model": args.model, "bytes_per_token": bpt, "capacity_tokens": capacity_tokens,
            "policy": args.policy, "step": suggestion.step, "floor": args.floor,
            "quotas": suggestion.quotas.spec(), "tenants": tenants}
