"""What ``kvoffload replay`` and ``kvoffload plan`` share: trace and model options, the bounds beside each result,
and the error path for bad input (a message naming the culprit, exit code 2)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvoffload.config import EvictionPolicy, StoreAdmission
from kvoffload.tools.replay.loop import Bound
from kvoffload.tools.replay.models import GIB, kv_shape
from kvoffload.tools.replay.result import ReplayResult

USAGE_ERROR = 2


class Bounds(NamedTuple):
    """The optimum at one capacity and the unbounded maximum of the trace."""

    optimum: ReplayResult
    unbounded: ReplayResult

    def fraction(self, result: ReplayResult) -> float:
        """``result``'s token hit rate as a fraction of the optimum's (1.0 when the optimum hits nothing)."""
        best = self.optimum.token_hit_rate
        return result.token_hit_rate / best if best else 1.0


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trace``, ``--admission``, ``--json`` and ``--workers``."""
    parser.add_argument("--trace", required=True,
                        help="trace JSONL (the Mooncake format, or one kvoffload recorded), synthetic:NAME[:TIER], "
                             "tenants:N[+flood]:PATH or agentic[:FIELD=VALUE,...]")
    names, default = [a.value for a in StoreAdmission], StoreAdmission.ALL.value
    parser.add_argument("--admission", default=default,
                        help=f"store admission rule for the policies: {', '.join(names)} (default {default})")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes replaying points in parallel (default: one per core; 1: in this process)")


def parse_policies(names: Sequence[str] | None) -> list[EvictionPolicy]:
    """The ``--policy`` values (every policy when none is given).

    Raises:
        ValueError: a name that is no ``EvictionPolicy`` value.
    """
    if not names:
        return list(EvictionPolicy)
    known = [p.value for p in EvictionPolicy]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown policy {bad[0]!r}; known: {', '.join(known)}")
    return [EvictionPolicy(n) for n in dict.fromkeys(names)]


def parse_admission(name: str) -> StoreAdmission:
    """The ``--admission`` value.

    Raises:
        ValueError: a name that is no ``StoreAdmission`` value.
    """
    try:
        return StoreAdmission(name)
    except ValueError:
        known = ", ".join(a.value for a in StoreAdmission)
        raise ValueError(f"unknown store admission {name!r}; known: {known}") from None


def bytes_per_token(model: str | None) -> int | None:
    """The model's KV bytes per token, None without ``--model``.

    Raises:
        ModelError: as ``kv_shape``.
    """
    return kv_shape(model).bytes_per_token if model else None


def fail(command: str, error: Exception) -> int:
    """Report bad input on stderr; the exit code for it."""
    print(f"kvoffload {command}: error: {error}", file=sys.stderr)
    return USAGE_ERROR


def bounds_at(results: Sequence[ReplayResult], capacity_blocks: int) -> Bounds:
    """The optimum at ``capacity_blocks`` and the unbounded result among ``results``."""
    optimum = next(r for r in results if r.strategy == Bound.OPTIMUM.value and r.capacity_blocks == capacity_blocks)
    unbounded = next(r for r in results if r.strategy == Bound.UNBOUNDED.value)
    return Bounds(optimum, unbounded)


def result_doc(result: ReplayResult, bounds: Bounds, bpt: int | None) -> dict[str, Any]:
    """A result as JSON, with its fraction of the optimum and of the unbounded maximum."""
    doc = result.to_dict(bpt)
    doc["fraction_of_optimum"] = bounds.fraction(result)
    unbounded = bounds.unbounded.token_hit_rate
    doc["fraction_of_unbounded"] = result.token_hit_rate / unbounded if unbounded else 1.0
    if bpt is not None:
        doc["capacity_bytes"] = result.capacity_tokens * bpt
    return doc


def gib(tokens: int, bpt: int | None) -> float | None:
    """``tokens`` of KV in GiB, None without a model."""
    return tokens * bpt / GIB if bpt is not None else None
