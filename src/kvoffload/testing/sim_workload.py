"""The small pieces every test on the simulated engine needs: an engine over a ready-made layout, prompts, and a
run that checks every device block after every step.

A tier's test (ours under tests/tiers/, or a third party's) builds an engine with its tier turned on by config keys
(``make_engine(host_blocks=4, disk_path=..., disk_bytes=...)``), runs prompts of ``tokens`` through it with
``run_checked`` and then asserts what was loaded (``SimRequest.loaded_tokens``) and that nothing loaded was wrong
(``SimEngine.corrupt_blocks``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.testing import layouts
from kvoffload.testing.sim import HookOrder, SimEngine
from kvoffload.testing.sim_values import SimDescriber

LayoutFactory = Callable[..., layouts.Made]
"""A layout of ``testing.layouts`` (or one of the same shape): takes ``num_blocks`` and ``block_size``."""

__all__ = ["LayoutFactory", "close_engine", "make_engine", "pushed_out", "run_checked", "run_timed", "tokens"]


def tokens(n: int, seed: int) -> list[int]:
    """``n`` pseudo-random token ids below 1000, the same for the same ``seed`` (a prompt, or a part of one)."""
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def run_checked(engine: SimEngine, *, ship_write_through: bool = False) -> None:
    """Step ``engine`` until its requests finished and its jobs completed, checking after every step that every
    device block holds the bytes a computation would and that the null block is intact (``SimEngine.check_all``).

    Args:
        engine: the engine, with the requests to run added.
        ship_write_through: then take one more step, which ships the write-through to a lower tier that the last
            store queued (``SimEngine.run`` stops before the index's queue), and run until done again.
    Raises:
        AssertionError: a block's bytes were wrong, or the null block was written.
        RuntimeError: the engine did not finish (``SimEngine.run``).
    """
    engine.run(on_step=lambda e: e.check_all())
    if ship_write_through:
        engine.step()
        engine.run(on_step=lambda e: e.check_all())


def make_engine(layout: LayoutFactory = layouts.attention_layout, *, block_size: int = 4, num_blocks: int = 48,
                host_blocks: int = 16, factor: int = 1, workers: int = 1,
                sliding_windows: Mapping[int, int] | None = None, clock: Callable[[], float] | None = None,
                hook_order: HookOrder = HookOrder.SAVE_FIRST, describe_blocks: bool = False,
                **config: Any) -> SimEngine:
    """A simulated engine over ``layout(num_blocks=num_blocks, block_size=block_size)`` with a host tier of
    ``host_blocks`` offload blocks, each ``factor`` engine blocks.

    Args:
        layout: the layout factory.
        block_size: tokens per engine block.
        num_blocks: the device cache's blocks.
        host_blocks: the host tier's capacity in offload blocks of the largest KV-cache group.
        factor: engine blocks per offload block (``offload_block_tokens`` is ``factor * block_size``).
        workers: worker halves, one per tensor-parallel rank.
        sliding_windows, clock, hook_order: as ``SimEngine`` takes them.
        describe_blocks: publish router events, the blocks described by a ``SimDescriber`` (``SimEngine``'s
            ``describe``).
        **config: further keys of ``OffloadConfig.from_dict`` (a tier's, a policy's), which win over the above.
    Raises:
        ConfigError: a key or value of ``config`` is not valid.
    """
    made, make_kv = layout(num_blocks=num_blocks, block_size=block_size)
    slot = factor * max(made.group_block_bytes(g) for g in range(len(made.groups)))
    raw = {"offload_block_tokens": factor * block_size, "host_bytes": host_blocks * slot, **config}
    describe = SimDescriber(block_size, factor, frozenset(made.state_groups)) if describe_blocks else None
    return SimEngine(made, make_kv, OffloadConfig.from_dict(raw), block_size=block_size, num_workers=workers,
                     sliding_windows=sliding_windows, clock=clock, hook_order=hook_order, describe=describe)


def run_timed(engine: SimEngine, *, checked: bool = True, max_steps: int = 200_000) -> list[float]:
    """Step ``engine`` until its requests finished and its jobs completed, as ``SimEngine.run``; returns each step's
    wall-clock seconds (``engine.step`` alone, not the checks). ``checked``: ``SimEngine.check_all`` after every
    step, as ``run_checked``.

    Raises:
        AssertionError: a block's bytes were wrong, the null block was written, or the requests did not finish in
            ``max_steps`` steps.
    """
    times: list[float] = []
    for _ in range(max_steps):
        quiet = not engine.has_work and engine.scheduler.num_pending_jobs == 0
        started = time.perf_counter()
        idle = engine.step().idle
        times.append(time.perf_counter() - started)
        if checked:
            engine.check_all()
        if quiet and idle:
            return times
    raise AssertionError(f"requests unfinished after {max_steps} steps")


def pushed_out(engine: SimEngine, seed: int, *, host_blocks: int = 4, checked: bool = True) -> list[int]:
    """A 16-token prompt run through ``engine`` (built with ``block_size`` 4 and ``host_blocks``), written through to
    its lower tiers, then pushed out of the host by other prompts and out of the device cache: a prompt only the
    tiers below host hold. Returns the prompt."""
    prompt = tokens(16, seed=seed)
    engine.add_request(f"stored{seed}", prompt)
    run_timed(engine, checked=checked)
    engine.step()  # ships the write-through the last store queued
    run_timed(engine, checked=checked)
    for i in range(host_blocks // 4 + 2):
        engine.add_request(f"filler{seed}.{i}", tokens(16, seed=1000 + 10 * seed + i))
        run_timed(engine, checked=checked)
    engine.pool.drop_cache()
    return prompt


def close_engine(engine: SimEngine) -> None:
    """Stop ``engine`` as an engine stops: its workers' transfers shut down, then its tiers let go of what they hold
    outside it (a disk tier's table thread and engine number, which the next engine on the directory may take).
    Call it once, when done with the engine."""
    for worker in engine.workers:
        worker.shutdown()
    engine.scheduler.close()
