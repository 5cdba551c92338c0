"""``kvoffload bench overhead``: microseconds the connector halves add to each engine step, on the miss path.

The simulated engine (``kvoffload.testing.sim.SimEngine``) runs ``--requests`` requests with distinct prompts (no
kvoffload hits), one worker. Every connector call the engine makes is timed around the real call:

- scheduler half: ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
  ``update_connector_output``, ``request_finished``;
- worker half: ``handle_preemptions``, ``start_kv_transfers``, ``prepare_store_kv``, ``get_finished``.

Steps are sorted by what the engine did in them: ``admission`` (requests were waiting: prompts looked up, allocated,
their blocks stored), ``decode`` (every request running, each decoding one token; stores of blocks that became full
included) and ``finish`` (requests finished). Each row gives the connector's microseconds per step (median and
spread over steps) beside the whole step's, so the share is visible. The engine's own work (forward pass writing
pages, block pool) is outside the connector figure. Background copies run on the handler's threads meanwhile.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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

SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished")
WORKER_CALLS = ("handle_preemptions", "start_kv_transfers", "prepare_store_kv", "get_finished")
TARGET_US = 100.0
ADMISSION_MARGIN = 6


@dataclass
class CallTimer:
    """Accumulates perf_counter time around wrapped methods; a call made inside another timed call counts once."""

    seconds: float = 0.0
    by_call: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _depth: int = 0

    def wrap(self, obj: object, name: str) -> None:
        """Replace ``obj.name`` by a timed version (an instance attribute shadowing the method)."""
        fn: Callable[..., Any] = getattr(obj, name)
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth = 1
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                self._depth = 0
                self.seconds += elapsed
                self.by_call[name] += elapsed

        setattr(obj, name, timed)

    def take(self) -> tuple[float, dict[str, float]]:
        seconds, by_call = self.seconds, dict(self.by_call)
        self.seconds, self.by_call = 0.0, defaultdict(float)
        return seconds, by_call


@dataclass(frozen=True)
class StepSample:
    kind: str
    connector_s: float
    step_s: float
    by_call: dict[str, float]


def build_engine(requests: int, prompt_tokens: int, block_size: int, decode_steps: int,
                 events: bool | None = None, hints: bool = True) -> tuple[Any, CallTimer]:
    """A SimEngine sized for ``requests`` running at once, its connector calls wrapped by a ``CallTimer``.

    ``events``: None, the engine asks for no KV events (the figures before router events existed); False, it asks
    for the tiers' events each step and publishes none (vLLM without ``--kv-events-config``); True, it publishes
    them, each block described (``connector.announce``). ``hints``: retention hints on (the default config) or off
    (``max_retain_s`` 0: no retention book, no wrapper around the tiers' policies)."""
    from kvoffload.config import OffloadConfig
    from kvoffload.testing.layouts import attention_layout
    from kvoffload.testing.sim import SimEngine
    from kvoffload.testing.sim_values import SimDescriber

    blocks_per_request = -(-(prompt_tokens + decode_steps + 2) // block_size)
    num_blocks = requests * blocks_per_request + 16
    layout, make_kv = attention_layout(2, num_blocks=num_blocks, block_size=block_size)
    slot_bytes = layout.group_block_bytes(0)
    config = OffloadConfig.from_dict({"host_bytes": 2 * num_blocks * slot_bytes, "copy_threads": 1,
                                      **({} if hints else {"max_retain_s": 0})})
    # An admission step takes a quarter of the requests, so admission is spread over several steps.
    engine = SimEngine(layout, make_kv, config, block_size=block_size,
                       max_batch_tokens=max(prompt_tokens, requests * prompt_tokens // 4),
                       describe=SimDescriber(block_size, 1) if events else None)
    timer = CallTimer()
    calls = SCHEDULER_CALLS + (() if events is None else ("take_announcements",) if events else ("take_events",))
    for name in calls:
        timer.wrap(engine.scheduler, name)
    for worker in engine.workers:
        for name in WORKER_CALLS:
            timer.wrap(worker, name)
    return engine, timer


@dataclass(frozen=True)
class Side:
    """What one engine of a run does: ``events`` as ``build_engine``'s; ``hints`` None, hints off; False, on and no
    request hinted (the default); True, on and every other request hinted (``HINT``)."""

    events: bool | None = None
    hints: bool | None = False


HINT = {"kvoffload": {"retain_s": 600}}
"""The hinted requests' ``kv_transfer_params``: far longer than a run, so that their blocks stay retained."""


class SideRun:
    """One side's engine, its requests added, stepped one step at a time; ``samples`` one per step."""

    def __init__(self, side: Side, requests: int, prompt_tokens: int, block_size: int, decode_steps: int,
                 seed: int) -> None:
        self.side = side
        self.engine, self.timer = build_engine(requests, prompt_tokens, block_size, decode_steps, side.events,
                                               hints=side.hints is not None)
        self.samples: list[StepSample] = []
        self._limit = 10 * (requests + decode_steps)
        rng = random.Random(seed)
        describe = self.engine.scheduler.announcer.describe if self.engine.scheduler.announcer is not None else None
        for i in range(requests):
            request = self.engine.add_request(f"r{i}", [rng.randrange(1000) for _ in range(prompt_tokens)],
                                              max_new_tokens=decode_steps + 1)
            if side.hints and i % 2 == 0:
                request.kv_transfer_params = HINT
            if describe is not None:
                # The engine hashes its blocks whether or not it publishes events (vLLM: as tokens arrive, for its
                # prefix cache): not kvoffload's cost, so not in the timed calls.
                describe.engine_hashes(request, prompt_tokens // block_size)

    def step(self) -> str:
        """One engine step, sampled; returns its kind."""
        engine = self.engine
        kind = "admission" if engine.waiting else "decode"
        start = time.perf_counter()
        report = engine.step()
        if self.side.events is False:
            engine.scheduler.take_events()  # vLLM asks every step, whether or not it publishes
        step_s = time.perf_counter() - start
        connector_s, by_call = self.timer.take()
        self.samples.append(StepSample("finish" if report.finished else kind, connector_s, step_s, by_call))
        if len(self.samples) > self._limit:
            raise RuntimeError("bench overhead: the simulated engine did not finish")
        return kind

    def check_misses(self) -> None:
        hits = sum(r.loaded_tokens for r in self.engine.requests.values())
        if hits:
            raise RuntimeError(f"bench overhead: {hits} tokens were loaded; the miss path must have no hits")

    def shutdown(self) -> None:
        for worker in self.engine.workers:
            worker.shutdown()


def run_sides(sides: list[Side], requests: int, prompt_tokens: int, block_size: int, decode_steps: int,
              seed: int = 0, progress: Progress | None = None) -> list[list[StepSample]]:
    """Admit ``requests`` distinct prompts, decode ``decode_steps`` tokens each, finish, on one engine per side,
    the engines stepped in turn (the first to step rotating), so that every side sees the same machine load; one
    sample per step per side."""
    runs: list[SideRun] = []
    try:
        for side in sides:
            runs.append(SideRun(side, requests, prompt_tokens, block_size, decode_steps, seed))
        turn = 0
        while any(r.engine.has_work for r in runs):
            for i in range(len(runs)):
                run = runs[(turn + i) % len(runs)]
                if run.engine.has_work:
                    kind = run.step()
                    if progress is not None:
                        progress.advance(kind)
            turn += 1
        for run in runs:
            run.check_misses()
    finally:
        for run in runs:
            run.shutdown()
    return [run.samples for run in runs]


def run_steps(requests: int, prompt_tokens: int, block_size: int, decode_steps: int, seed: int = 0,
              progress: Progress | None = None, events: bool | None = None) -> list[StepSample]:
    """Admit ``requests`` distinct prompts, decode ``decode_steps`` tokens each, finish; one sample per step
    (``events``: as ``build_engine``)."""
    return run_sides([Side(events)], requests, prompt_tokens, block_size, decode_steps, seed, progress)[0]


def summarize_steps(samples: list[StepSample], warmup: int) -> list[dict[str, Any]]:
    """One row per step kind: connector and whole-step microseconds; the first ``warmup`` decode steps left out."""
    decode_seen = 0
    kept: dict[str, list[StepSample]] = defaultdict(list)
    for s in samples:
        if s.kind == "decode":
            decode_seen += 1
            if decode_seen <= warmup:
                continue
        kept[s.kind].append(s)
    rows = []
    for kind in ("admission", "decode", "finish"):
        steps = kept.get(kind, [])
        if not steps:
            continue
        connector = summarize([s.connector_s * 1e6 for s in steps], "us/step")
        step = summarize([s.step_s * 1e6 for s in steps], "us/step")
        calls: dict[str, float] = defaultdict(float)
        for s in steps:
            for name, sec in s.by_call.items():
                calls[name] += sec * 1e6 / len(steps)
        rows.append({"step_kind": kind, "steps": len(steps), "connector": connector, "step": step,
                     "share": connector.median / step.median if step.median else 0.0,
                     "mean_us_by_call": dict(sorted(calls.items(), key=lambda kv: -kv[1]))})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, runs=64, warmup=4)
    parser.add_argument("--requests", type=positive_int, default=256, help="requests running at once (256)")
    parser.add_argument("--vs-vllm", action="store_true",
                        help="instead: our scheduler half beside vLLM's OffloadingConnector, both on vLLM's own "
                             "scheduler outputs, at 64 and --requests requests (tools/bench/overhead_vllm.py)")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="--vs-vllm: rounds of admission, decode and finish per request count (default 5)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="prompt length (default 128)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="engine block size (default 16)")
    parser.add_argument("--hints", action="store_true",
                        help="three sides in one run: retention hints off (max_retain_s 0), on with no request "
                             "hinted, on with every other request hinted; each row's connector time / hints off's")
    parser.add_argument("--events", action="store_true",
                        help="three sides in one run: no KV events asked for, events asked for and none published "
                             "(vLLM without --kv-events-config), router events published (each block described); "
                             "and the bytes each announced block keeps")


def run(args: argparse.Namespace) -> int:
    if args.vs_vllm:
        from kvoffload.tools.bench import overhead_vllm

        return overhead_vllm.run(args)
    # --runs is the number of timed decode steps; --warmup the decode steps left out before them. Requests admitted
    # early decode during the later admission steps, and finish early: ADMISSION_MARGIN keeps enough pure decode.
    decode_steps = args.runs + args.warmup + ADMISSION_MARGIN
    sides = [Side(events, hints) for events in ((None, False, True) if args.events else (None,))
             for hints in ((None, False, True) if args.hints else (False,))]
    progress = Progress("bench overhead", len(sides) * _expected_steps(args, decode_steps), enabled=not args.quiet)
    rows = []
    for side, samples in zip(sides, run_sides(sides, args.requests, args.prompt_tokens, args.block_size,
                                              decode_steps, progress=progress), strict=True):
        for row in summarize_steps(samples, args.warmup):
            rows.append({"events": EVENT_SIDES[side.events], "hints": HINT_SIDES[side.hints], **row})
    progress.close()
    if args.hints:
        _compare_with_hints_off(rows)
    extra = [] if not args.events else [announced_block_bytes(args.requests, args.prompt_tokens, args.block_size)]
    emit(report(rows, args, extra), args, plot=lambda path: _plot(path, rows))
    return 0


def _compare_with_hints_off(rows: list[dict[str, Any]]) -> None:
    """Each row's ``vs_off``: its connector median over that of the same step kind and events with hints off."""
    off = {(r["events"], r["step_kind"]): r["connector"].median for r in rows if r["hints"] == HINT_SIDES[None]}
    for r in rows:
        base = off.get((r["events"], r["step_kind"]))
        r["vs_off"] = r["connector"].median / base if base else None


EVENT_SIDES = {None: "not asked", False: "asked, off", True: "published"}
"""``--events``' sides: what the engine does with the tiers' events each step."""
HINT_SIDES = {None: "off", False: "on, none", True: "on, half"}
"""``--hints``' sides: retention hints off, on with no request hinted, on with every other request hinted."""


def announced_block_bytes(requests: int, prompt_tokens: int, block_size: int) -> str:
    """The memory each announced block keeps (``Announcer``'s table), after ``requests`` prompts were stored:
    every object it holds for the block (deep ``sys.getsizeof``, each object once, small ints too) and its share of
    the table's slots."""
    engine, _ = build_engine(requests, prompt_tokens, block_size, 1, events=True)
    rng = random.Random(1)
    for i in range(requests):
        engine.add_request(f"m{i}", [rng.randrange(1000, 150_000) for _ in range(prompt_tokens)], max_new_tokens=2)
    try:
        engine.run()
    finally:
        for worker in engine.workers:
            worker.shutdown()
    announcer = engine.scheduler.announcer
    table = announcer._announced
    seen: set[int] = set()
    total = sys.getsizeof(table)
    for key, kept in table.items():
        total += _deep_size(key, seen) + _deep_size(kept, seen)
    blocks = len(table)
    return (f"announced blocks keep {total / blocks:.0f} bytes each ({blocks} blocks of {block_size} tokens, "
            f"one engine block each, token ids 1,000-150,000)")


def _deep_size(obj: Any, seen: set[int]) -> int:
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, (tuple, list)):
        size += sum(_deep_size(item, seen) for item in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(_deep_size(getattr(obj, name), seen) for name in _slots(type(obj)) if hasattr(obj, name))
    return size


def _slots(cls: type) -> list[str]:
    return [name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())]


def _expected_steps(args: argparse.Namespace, decode_steps: int) -> int:
    return decode_steps + ADMISSION_MARGIN


def report(rows: list[dict[str, Any]], args: argparse.Namespace, extra: list[str] | None = None) -> Report:
    hints = getattr(args, "hints", False)
    table = format_table(
        ("events", *(("hints",) if hints else ()), "steps", "kind", "connector us/step", "min", "max",
         *(("vs off",) if hints else ()), "whole step us", "share", "top calls (mean us)"),
        [(r["events"], *((r["hints"],) if hints else ()), r["steps"], r["step_kind"], r["connector"].median,
          r["connector"].min, r["connector"].max, *((_ratio(r["vs_off"]),) if hints else ()), r["step"].median,
          f"{r['share']:.0%}", _top(r["mean_us_by_call"])) for r in rows])
    decode = next((r for r in rows if r["step_kind"] == "decode"), None)
    verdict = "" if decode is None else (
        f"decode target < {TARGET_US:.0f} us/step: {'met' if decode['connector'].median < TARGET_US else 'missed'}"
        f" ({decode['connector'].median:.0f} us)")
    notes = (f"{args.requests} requests, {args.prompt_tokens}-token distinct prompts (no hits), block size "
             f"{args.block_size}; medians over steps; {args.warmup} decode steps of warm-up left out", verdict,
             *(("hints: off = max_retain_s 0 (no retention book or wrapper); on, none = the default config, no "
                "request hinted; on, half = every other request hinted (retain_s 600); vs off = connector median "
                "/ hints off's, sides stepped in turn",) if hints else ()),
             *(extra or ()))
    settings = {k: getattr(args, k, False) for k in ("runs", "warmup", "requests", "prompt_tokens", "block_size",
                                                     "events", "hints")}
    return Report("overhead", rows, table, notes, settings)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _top(calls: dict[str, float], n: int = 3) -> str:
    return ", ".join(f"{name} {us:.0f}" for name, us in list(calls.items())[:n])


def _plot(path: str, rows: list[dict[str, Any]]) -> None:
    labels = [f"{r['step_kind']} ({r['events']}, hints {r['hints']})" for r in rows]
    bar_plot(path, "connector time per engine step", labels,
             {"connector": [r["connector"].median for r in rows], "whole step": [r["step"].median for r in rows]},
             "us/step")

