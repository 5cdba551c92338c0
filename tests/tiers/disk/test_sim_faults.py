"""A randomized state machine (hypothesis) over the simulated engine with a small host tier on a disk tier, with
faults injected at random: blocks corrupt, zeroed (never written whole), overwritten by another key's block, cut
off by a file cut short, or behind a directory that took their slot file's place; slow reads, EIO, a file system
turned read-only (no write, not even the emptying of a bad block's entry). A directory or a symbolic link that
takes a slot file's place stays for the rest of the run.

After every rule: every running request's device bytes are right, every loaded block was bit-exact, the null block
is intact and every manager's bookkeeping holds. At the end of each run: every request finishes within a bounded
number of steps, no job is left and no pin leaked (the tiers empty on reset). Over all runs the engine takes at
least ``MIN_TOTAL_STEPS`` steps.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvoffload.testing.sim import Status
from kvoffload.testing.sim_workload import close_engine, make_engine, tokens
from kvoffload.testing.slot_files import slot_files, stored_blocks
from kvoffload.tiers.disk.file_io import FileOps
from kvoffload.tiers.disk.handler import DiskHandler

BLOCK = 4
PREFIXES = [tokens(16, seed=p) for p in range(3)]
DRAIN_STEPS = 200
"""Every request must be done this many steps after the last rule, whatever faults stand."""
MIN_TOTAL_STEPS = 10_000
READ_DEADLINE_MS = 20
STEPS = {"total": 0, "loaded_tokens": 0, "disk_errors": 0}
"""Across all runs: engine steps, tokens loaded instead of computed, disk errors the breakers heard of."""


class FaultyOps(FileOps):
    """The OS, with faults the machine switches on: the next reads fail with EIO or are slower than the
    deadline, and a read-only mode in which every write (blocks, their entries, the emptying of an entry) and every
    creation fails with EROFS."""

    def __init__(self) -> None:
        self.eio_reads = 0
        self.slow_reads = 0
        self.read_only = False

    def open(self, path: str, create: bool = False) -> int:
        if create:
            self._refuse_if_read_only()
        return super().open(path, create)

    def pread_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if self.eio_reads > 0:
            self.eio_reads -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if self.slow_reads > 0:
            self.slow_reads -= 1
            time.sleep(2 * READ_DEADLINE_MS / 1000)
        return super().pread_into(fd, buffers, offset)

    def pwrite(self, fd: int, buffers: list[memoryview | bytes], offset: int) -> None:
        self._refuse_if_read_only()
        super().pwrite(fd, buffers, offset)

    def _refuse_if_read_only(self) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))


class FaultyDisk(RuleBasedStateMachine):
    extra_config: dict[str, Any] = {}

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvoffload-faults-"))
        config = {"disk_path": str(self.root / "disk"), "disk_bytes": 1 << 22,
                  "disk_read_deadline_ms": READ_DEADLINE_MS, "disk_breaker_cooldown_s": 0.05, **self.extra_config}
        self.engine = make_engine(block_size=BLOCK, host_blocks=4, **config)
        self.ops = FaultyOps()
        for worker in self.engine.workers:
            for handler in worker.transfers.handlers:
                if isinstance(handler, DiskHandler):
                    handler._ops = self.ops  # the system-call seam of the worker's disk tier
        self.rng = random.Random(0)
        self.count = 0

    # ---- the workload ------------------------------------------------------------------------------------------

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), tail=st.lists(st.integers(0, 999), max_size=6),
          new_tokens=st.integers(1, 3))
    def add_request(self, prefix: int, tail: list[int], new_tokens: int) -> None:
        self.count += 1
        self.engine.add_request(f"r{self.count}", PREFIXES[prefix] + tail, max_new_tokens=new_tokens)

    @rule(steps=st.integers(1, 40), settle=st.booleans())
    def run_steps(self, steps: int, settle: bool) -> None:
        for _ in range(steps):
            self._step(settle)

    # No precondition reads the engine: what it holds after a step depends on when background disk reads end, and
    # a precondition that does makes hypothesis draw differently for the same choices ("Inconsistent data
    # generation", seen under load). Each rule applies whatever the engine holds.

    @rule()
    def lose_the_device_cache(self) -> None:
        """Once every request has finished (the engine runs until then), the device cache forgets everything."""
        self.engine.run(max_steps=DRAIN_STEPS, on_step=lambda _: self._after_step(settle=True))
        self.engine.pool.drop_cache()

    @rule(which=st.integers(0, 1 << 16))
    def abort_a_request(self, which: int) -> None:
        live = [r for r in self.engine.running + self.engine.waiting]
        if live:
            self.engine.abort(live[which % len(live)].request_id)

    # ---- faults ------------------------------------------------------------------------------------------------

    @rule(which=st.integers(0, 1 << 16),
          fault=st.sampled_from(["corrupt", "zeroed", "other-key", "cut-short", "not-a-file", "a-link"]))
    def damage_a_block(self, which: int, fault: str) -> None:
        blocks = [b for p in slot_files(self.root) for b in stored_blocks(p)]
        if not blocks:
            return
        block = blocks[which % len(blocks)]
        if fault in ("not-a-file", "a-link"):  # not loadable, no entry emptied: never followed nor read
            moved = block.path.with_name(f"moved{self.count}")
            block.path.rename(moved)
            if fault == "a-link":  # even to the very file: a link is never followed
                block.path.symlink_to(moved)
            else:
                block.path.mkdir()
            return
        with open(block.path, "r+b") as f:
            if fault == "cut-short":
                f.truncate(block.offset + block.nbytes // 2)
                return
            f.seek(block.offset)
            raw = bytearray(f.read(block.nbytes))
            if fault == "corrupt":
                raw[len(raw) // 2] ^= 0xFF
            elif fault == "zeroed":  # a write that never reached the disk
                raw[:] = bytes(len(raw))
            else:  # a whole block of another key: what a slot given to another block holds
                other = next((b for b in blocks if b.path == block.path and b.slot != block.slot), None)
                if other is None:
                    return
                f.seek(other.offset)
                raw[:] = f.read(other.nbytes)
            f.seek(block.offset)
            f.write(raw)

    @rule(eio=st.integers(0, 4), slow=st.integers(0, 2))
    def fail_the_next_reads(self, eio: int, slow: int) -> None:
        self.ops.eio_reads, self.ops.slow_reads = eio, slow

    @rule(read_only=st.booleans())
    def turn_read_only(self, read_only: bool) -> None:
        self.ops.read_only = read_only

    # ---- what must hold ----------------------------------------------------------------------------------------

    @invariant()
    def every_loaded_block_was_right_and_the_books_balance(self) -> None:
        self.engine.check_all()
        assert self.engine.corrupt_blocks == [], f"wrong loaded blocks: {self.engine.corrupt_blocks}"

    def teardown(self) -> None:
        try:
            # Raises if requests, jobs or tier transfers are still going after DRAIN_STEPS steps.
            self.engine.run(max_steps=DRAIN_STEPS, on_step=lambda _: self._after_step(settle=True))
            assert all(r.status is Status.FINISHED for r in self.engine.requests.values()), "a request stalled"
            assert self.engine.scheduler.num_pending_jobs == 0
            self.engine.scheduler.reset()  # a leaked pin would keep its block
            assert all(u.used_blocks == 0 for u in self.engine.scheduler.usage())
            STEPS["loaded_tokens"] += sum(r.loaded_tokens for r in self.engine.requests.values())
            STEPS["disk_errors"] += sum(h.breaker.errors for w in self.engine.workers for h in w.transfers.handlers
                                        if isinstance(h, DiskHandler))
        finally:
            close_engine(self.engine)
            shutil.rmtree(self.root, ignore_errors=True)

    def _step(self, settle: bool) -> None:
        self.engine.step()
        self._after_step(settle)

    def _after_step(self, settle: bool) -> None:
        STEPS["total"] += 1
        self.engine.check_all()
        if settle:  # otherwise background jobs overlap the next step, as they do in an engine
            for worker in self.engine.workers:
                worker.wait_all()


def test_random_faults_never_give_a_wrong_block_a_stalled_request_or_a_leaked_pin() -> None:
    STEPS.update(dict.fromkeys(STEPS, 0))
    config: Any = settings(max_examples=120, stateful_step_count=50, deadline=None, derandomize=True,
                           suppress_health_check=list(HealthCheck))
    run_state_machine_as_test(FaultyDisk, settings=config)
    assert STEPS["total"] >= MIN_TOTAL_STEPS
    assert STEPS["loaded_tokens"] > 0 and STEPS["disk_errors"] > 0  # it served hits, and faults were met


class CorruptingDisk(FaultyDisk):
    """The same machine with a load that succeeds with a zeroed block: the invariants must catch it. Whether an
    example loads must not depend on time (a load that came in one run and not in hypothesis's replay of it made
    the control flaky): it waits for the background jobs after every step, and no read deadline, breaker or measured
    tier speed turns a load away (under load, a 20 ms deadline or a 50 ms cool-down did, now and then)."""

    extra_config: dict[str, Any] = {"inject_load_corruption": 1, "disk_read_deadline_ms": 1e9,
                                    "disk_breaker_errors": 1_000_000, "load_policy": "always"}

    def _after_step(self, settle: bool) -> None:
        super()._after_step(settle=True)


def test_the_machine_catches_a_wrong_loaded_block() -> None:
    config: Any = settings(max_examples=30, stateful_step_count=30, deadline=None, derandomize=True,
                           suppress_health_check=list(HealthCheck), phases=[Phase.generate])  # no shrinking
    with pytest.raises(AssertionError, match=r"wrong loaded blocks|wrong device bytes"):
        run_state_machine_as_test(CorruptingDisk, settings=config)
