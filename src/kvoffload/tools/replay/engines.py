"""Several engines on one node: a private tier per engine, or one node pool that every engine shares.

A router assigns each request of a trace to one of N engines, in arrival order: ``round-robin`` (request i to engine
i mod N) or ``random`` (a seeded choice per request). It is not prefix-aware: a conversation's turns land on
different engines, which is what a private tier per engine pays for.

- **private**: N tiers of C/N blocks (at least one). The trace is split into one sub-trace per engine, in arrival
  order, and each runs through its own tier (``loop.replay``); their counts add up into one ``ReplayResult``.
- **node**: one tier of C blocks that every request goes through, whatever its engine. Requests are replayed one
  after another, so this is the plain replay of the whole trace (``sweep.run_point``): the router changes nothing,
  and the optimum and unbounded maximum are the plain ones.

Both setups run through the same loop, policies and bounds; nothing here simulates a tier.
"""

from __future__ import annotations

import enum
import os
import random
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from typing import NamedTuple

from kvoffload.config import StoreAdmission
from kvoffload.tools.replay.loop import Bound, Strategy, replay
from kvoffload.tools.replay.result import ReplayResult
from kvoffload.tools.replay.sweep import Point, load, run_point
from kvoffload.tools.replay.trace import Trace


class Router(enum.Enum):
    """How requests are assigned to engines (never by prefix)."""

    ROUND_ROBIN = "round-robin"
    """Request i (in arrival order) goes to engine i mod N."""
    RANDOM = "random"
    """Each request goes to an engine drawn by ``random.Random(seed)``."""


class Setup(enum.Enum):
    """Where the engines' offloaded blocks live."""

    PRIVATE = "private"
    """One tier of C/N blocks per engine; a request sees only its engine's tier."""
    NODE = "node"
    """One tier of C blocks shared by every engine."""


@dataclass(frozen=True)
class Engines:
    """The engines of a node and how requests reach them."""

    count: int
    router: Router
    seed: int = 0
    """The random router's seed (round-robin ignores it)."""


class Comparison(NamedTuple):
    """One strategy in both setups."""

    strategy: str
    private: ReplayResult
    node: ReplayResult

    @property
    def gain(self) -> float:
        """The node pool's token hit rate minus the private tiers'."""
        return self.node.token_hit_rate - self.private.token_hit_rate

    @property
    def ratio(self) -> float | None:
        """The node pool's token hit rate over the private tiers' (None when the private tiers hit nothing)."""
        private = self.private.token_hit_rate
        return self.node.token_hit_rate / private if private else None


def parse_engines(count: int | None, router: str | None, seed: int | None) -> Engines | None:
    """The ``--engines``, ``--router`` and ``--seed`` values; None without ``--engines`` (the one-tier replay).

    Raises:
        ValueError: ``--engines`` below 1, an unknown ``--router``, ``--router`` or ``--seed`` without
            ``--engines``, or ``--seed`` with a router other than ``random``.
    """
    if count is None:
        for flag, value in (("--router", router), ("--seed", seed)):
            if value is not None:
                raise ValueError(f"{flag} needs --engines")
        return None
    if count < 1:
        raise ValueError(f"--engines {count}: a node has at least 1 engine")
    try:
        chosen = Router(router or Router.ROUND_ROBIN.value)
    except ValueError:
        known = ", ".join(r.value for r in Router)
        raise ValueError(f"unknown --router {router!r}; known: {known}") from None
    if seed is not None and chosen is not Router.RANDOM:
        raise ValueError(f"--seed needs --router {Router.RANDOM.value}")
    return Engines(count, chosen, seed or 0)


def assign(requests: int, engines: Engines) -> list[int]:
    """The engine of each of ``requests`` requests, in arrival order.

    Raises:
        ValueError: ``engines.count`` is below 1.
    """
    if engines.count < 1:
        raise ValueError(f"engines: {engines.count} engines; a node has at least 1")
    if engines.router is Router.ROUND_ROBIN:
        return [i % engines.count for i in range(requests)]
    rng = random.Random(engines.seed)
    return [rng.randrange(engines.count) for _ in range(requests)]


def split(trace: Trace, assignment: Sequence[int], count: int) -> list[Trace]:
    """One sub-trace per engine: the requests ``assignment`` gives it, in arrival order."""
    assert len(assignment) == len(trace.requests), "one engine per request"
    parts: list[list[int]] = [[] for _ in range(count)]
    for index, engine in enumerate(assignment):
        parts[engine].append(index)
    return [Trace(tuple(trace.requests[i] for i in part), trace.block_tokens) for part in parts]


def private_capacity(capacity_blocks: int, count: int) -> int:
    """The blocks of one engine's private tier when ``count`` engines split ``capacity_blocks``."""
    return max(1, capacity_blocks // count)


def replay_private(trace: Trace, capacity_blocks: int, strategy: Strategy, admission: StoreAdmission,
                   assignment: Sequence[int], count: int) -> ReplayResult:
    """Replay ``trace`` through ``count`` private tiers that split ``capacity_blocks`` (the node's total).

    Each request is looked up and stored only in the tier of its engine, ``assignment[i]``. The result adds the
    engines' counts; its ``capacity_blocks`` is the sum of the tiers' (for ``Bound.UNBOUNDED``: of each engine's
    footprint).
    """
    per_engine = private_capacity(capacity_blocks, count)
    return merge([replay(part, per_engine, strategy, admission) for part in split(trace, assignment, count)])


def merge(results: Sequence[ReplayResult]) -> ReplayResult:
    """The totals of replays of disjoint parts of one trace, by one strategy, as one result."""
    assert results, "merge needs a result"
    first = results[0]
    kept = {"strategy", "admission", "block_tokens"}
    totals = {f.name: sum(getattr(r, f.name) for r in results) for f in fields(ReplayResult) if f.name not in kept}
    return ReplayResult(strategy=first.strategy, admission=first.admission, block_tokens=first.block_tokens,
                        **totals)


class Job(NamedTuple):
    """One replay of a multi-engine run: a point in one setup."""

    setup: Setup
    point: Point
    engines: Engines


def jobs(strategies: Sequence[Strategy], capacity_blocks: int, admission: StoreAdmission,
         engines: Engines) -> list[Job]:
    """Every strategy in the private setup, then every strategy in the node setup."""
    return [Job(setup, Point(s, capacity_blocks, admission), engines) for setup in Setup for s in strategies]


def run_job(path: str, job: Job) -> ReplayResult:
    """Replay one job of the trace at ``path`` (the function a worker runs)."""
    if job.setup is Setup.NODE:
        return run_point(path, job.point)
    trace, _ = load(path, with_future=False)
    assignment = assign(len(trace.requests), job.engines)
    return replay_private(trace, job.point.capacity_blocks, job.point.strategy, job.point.admission, assignment,
                          job.engines.count)


def run_jobs(path: str, todo: Sequence[Job], workers: int | None = None) -> list[ReplayResult]:
    """Replay every job, in ``workers`` processes (default: one per core; 1 runs them here), in input order."""
    workers = workers or min(len(todo), os.cpu_count() or 1)
    if workers <= 1 or len(todo) <= 1:
        return [run_job(path, job) for job in todo]
    load(path, with_future=any(j.setup is Setup.NODE and j.point.strategy is Bound.OPTIMUM for j in todo))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(run_job, [path] * len(todo), todo))


def compare(results: Sequence[ReplayResult], todo: Sequence[Job]) -> list[Comparison]:
    """Pair each strategy's private and node results (``results`` in the order of ``todo``)."""
    private = {j.point.strategy: r for j, r in zip(todo, results, strict=True) if j.setup is Setup.PRIVATE}
    node = {j.point.strategy: r for j, r in zip(todo, results, strict=True) if j.setup is Setup.NODE}
    return [Comparison(s.value, private[s], node[s]) for s in private]
