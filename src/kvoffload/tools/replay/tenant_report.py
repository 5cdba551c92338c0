"""``kvoffload replay --tenants``: its options, and the per-tenant table and JSON of a ``tenants.Comparison``."""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.bench.common import format_table
from kvoffload.tools.replay.models import GIB
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.tenants import Comparison, Quotas, TenantRow, parse_quotas, resident_blocks
from kvoffload.tools.replay.trace import Trace


class TenantOptions(NamedTuple):
    """The validated options of a replay with tenants."""

    quotas: Quotas
    kind: EvictionPolicy


def tenant_options(args: argparse.Namespace, trace: Trace, policies: list[EvictionPolicy],
                   admission: StoreAdmission) -> TenantOptions:
    """``--tenants`` and what it needs of the other options.

    Raises:
        ValueError: a bad ``--tenants``; ``--engines``, an ``--admission`` other than all, or more than one
            ``--policy`` beside it.
    """
    if args.engines is not None:
        raise ValueError("--tenants replays one tier: leave out --engines")
    if admission is not StoreAdmission.ALL:
        raise ValueError("--tenants stores every missed block: leave out --admission")
    if args.policy and len(policies) > 1:
        raise ValueError("--tenants replays one policy (inside each tenant): give at most one --policy")
    kind = policies[0] if args.policy else EvictionPolicy.LRU
    return TenantOptions(parse_quotas(args.tenants, trace), kind)


def _bytes(blocks: int, block_tokens: int, bpt: int | None) -> float | None:
    return blocks * block_tokens * bpt / GIB if bpt is not None else None


def _result_doc(result: ReplayResult, bpt: int | None) -> dict[str, Any]:
    doc = result.to_dict(bpt)
    doc["resident_blocks"] = resident_blocks(result)
    if bpt is not None:
        doc["resident_bytes"] = resident_blocks(result) * result.block_tokens * bpt
    return doc


def tenants_doc(comparison: Comparison, options: TenantOptions, bpt: int | None) -> dict[str, Any]:
    """The comparison as JSON: per tenant its three results and ratios, and the totals."""
    return {
        "policy": options.kind.value, "quotas": options.quotas.spec(),
        "tenants": [{"tenant": row.tenant, "share": row.share, "with_over_alone": row.ratio,
                     "without_over_alone": row.ratio_without,
                     "with_quotas": _result_doc(row.with_quotas, bpt),
                     "without_quotas": _result_doc(row.without_quotas, bpt),
                     "alone": _result_doc(row.alone, bpt)} for row in comparison.rows],
        "total": {"with_quotas": _result_doc(comparison.with_quotas, bpt),
                  "without_quotas": _result_doc(comparison.without_quotas, bpt)}}


def tenants_table(comparison: Comparison, bpt: int | None) -> str:
    """One row per tenant (token hit rates with quotas, without, alone on its share; what it stored, lost and
    holds with quotas), and the total."""
    headers = ["tenant", "share", "requests", "with quotas", "without", "alone", "with/alone", "without/alone",
               "hit tokens", "stored", "evicted", "resident"]
    if bpt is not None:
        headers.append("resident GiB")
    rows = [_row(row, bpt) for row in comparison.rows]
    w, wo = comparison.with_quotas, comparison.without_quotas
    total: list[object] = ["total", None, w.requests, w.token_hit_rate, wo.token_hit_rate, None, None, None,
                           w.hit_tokens, w.stored_blocks, w.evicted_blocks, resident_blocks(w)]
    if bpt is not None:
        total.append(_bytes(resident_blocks(w), w.block_tokens, bpt))
    return format_table(headers, [*rows, total])


def _row(row: TenantRow, bpt: int | None) -> list[object]:
    w = row.with_quotas
    out: list[object] = [row.tenant, row.share, w.requests, w.token_hit_rate, row.without_quotas.token_hit_rate,
                         row.alone.token_hit_rate, row.ratio, row.ratio_without, w.hit_tokens,
                         w.stored_blocks, w.evicted_blocks, resident_blocks(w)]
    if bpt is not None:
        out.append(_bytes(resident_blocks(w), w.block_tokens, bpt))
    return out
