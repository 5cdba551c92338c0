"""Sizing tenants' shares (``kvoffload plan --tenants``): each tenant's hit curve alone, and a split of the tier that
maximises the hit tokens of all tenants together, every tenant at or above a floor.

Each tenant's requests are replayed alone on pools of ``k * step`` of the tier (k = 1..1/step; its curve: hit
tokens against share). The split hands out the tier ``step`` by ``step``: every tenant starts at the floor, one step
is kept as the default share (tenants the trace never saw; ``tenant_quota`` needs it), and each further run of steps
goes to the tenant whose curve gains the most hit tokens per step over its best next run (a run, not one step: a
curve may be flat for a while and then climb, as a loop fits or does not). Steps no tenant gains from go to the
default share (unused share is lent anyway). With concave curves this greedy split is the best one; in any case
it never gives a step that buys nothing. Hit tokens, not rates, so a tenant with more traffic weighs more.

A flooding tenant's curve is flat at zero: it stays at the floor. The curves are of each tenant alone: with quotas a
tenant also borrows what others leave unused, so the replay with these shares does at least as well, give or take
the rule's rounding (``kvoffload replay --tenants`` measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvoffload.config import EvictionPolicy
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.tenants import Quotas, alone_capacity, replay_tenants, tenant_name
from kvoffload.tools.replay.trace import Trace

STEP = 0.05
"""The grain of shares: 20 points per curve."""


class Curve(NamedTuple):
    """One tenant's replays alone, at ``k * step`` of the tier for k = 1..len(results)."""

    tenant: str
    results: list[ReplayResult]

    def hit_tokens(self, steps: int) -> int:
        """Hit tokens on a pool of ``steps`` steps (0 steps: nothing)."""
        return self.results[steps - 1].hit_tokens if steps else 0


class Suggestion(NamedTuple):
    """The suggested shares, and each tenant's curve."""

    quotas: Quotas
    curves: list[Curve]
    step: float


def tenant_curves(trace: Trace, capacity_blocks: int, kind: EvictionPolicy = EvictionPolicy.LRU,
                  step: float = STEP) -> list[Curve]:
    """Each tenant of ``trace`` (in order of first arrival) alone on pools of ``k * step`` of ``capacity_blocks``."""
    steps = round(1 / step)
    curves = []
    for tenant in trace.tenants():
        name, part = tenant_name(tenant), trace.of_tenant(tenant)
        results = [replay_tenants(part, alone_capacity(capacity_blocks, k * step), kind).tenants[name]
                   for k in range(1, steps + 1)]
        curves.append(Curve(name, results))
    return curves


def split_steps(curves: Sequence[Curve], steps: int, floor_steps: int) -> tuple[list[int], int]:
    """Steps per curve and for the default share, ``steps`` in all (the module docstring's greedy split).

    Raises:
        ValueError: the floors and the default's step need more than ``steps``.
    """
    if floor_steps < 1 or len(curves) * floor_steps + 1 > steps:
        raise ValueError(f"{len(curves)} tenants at a floor of {floor_steps} steps each, and one step for the "
                         f"default, do not fit in {steps} steps")
    given = [floor_steps] * len(curves)
    left = steps - sum(given) - 1
    while left:
        best: tuple[float, int, int] | None = None  # (gain per step, curve, steps)
        for i, curve in enumerate(curves):
            base = curve.hit_tokens(given[i])
            for run in range(1, left + 1):
                rate = (curve.hit_tokens(given[i] + run) - base) / run
                if rate > 0 and (best is None or rate > best[0]):
                    best = (rate, i, run)
        if best is None:
            break
        _, i, run = best
        given[i] += run
        left -= run
    return given, left + 1


def suggest_shares(trace: Trace, capacity_blocks: int, kind: EvictionPolicy = EvictionPolicy.LRU,
                   floor: float = STEP, step: float = STEP) -> Suggestion:
    """Shares for ``trace``'s tenants on a tier of ``capacity_blocks``: every tenant named, at least ``floor``.

    Raises:
        ValueError: ``floor`` not in (0, 1), or too many tenants for it (as ``split_steps``).
    """
    if not 0 < floor < 1:
        raise ValueError(f"floor {floor} must be in (0, 1)")
    curves = tenant_curves(trace, capacity_blocks, kind, step)
    given, default = split_steps(curves, round(1 / step), max(1, round(floor / step)))
    quotas = Quotas(tuple(c.tenant for c in curves), tuple(round(g * step, 6) for g in given),
                    round(default * step, 6))
    return Suggestion(quotas, curves, step)
