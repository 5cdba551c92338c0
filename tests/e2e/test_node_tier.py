"""Two vLLM engines in separate processes share one node pool (``host_scope`` node) on a tmpfs.

Engine A serves the workload's first round and goes on serving it (loading, pinning, storing) while engine B, a
fresh process, serves the second round on the same prefixes: they load from the pool A filled, and B's outputs
equal plain vLLM's (the baseline carries its sensitivity control). A is killed with SIGKILL as B starts serving:
B finishes with plain vLLM's outputs, and A started again attaches, releases what the dead A held, and hits.

Then B serves the first round's prompts while another process holds the pool's index lock (an engine frozen
holding it): B's pins and stores give up (one wait per outage), its loads fail and are recomputed, and every
request finishes with plain vLLM's outputs.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest
from tests.e2e.conftest import BLOCK_SIZE, PREFIX_TOKENS, ROUNDS, Baseline, Result, assert_same_outputs, resume
from tests.tiers.node.test_lock_wait import hold_lock, release

from kvoffload import _nodeindex
from kvoffload.tiers.disk.tree import Access
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.liveness import EngineLocks

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HIT_TOKENS = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE


def start_engine(model_dir: Path, node_path: Path, log: IO[str], rounds: list[tuple[int, ...]],
                 **spec: Any) -> subprocess.Popen[str]:
    # 64 slots of 32 KiB: every prefix of both rounds fits, so nothing is evicted and every B prefix is a hit.
    extra = {"host_bytes": 64 * 32 << 10, "host_scope": "node", "node_path": str(node_path)}
    request = json.dumps({"extra_config": extra, "rounds": rounds, **spec})
    return subprocess.Popen([sys.executable, "-m", "tests.e2e.tier_engine", str(model_dir), request], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)


def read_result(engine: subprocess.Popen[str]) -> dict[str, Any]:
    assert engine.stdout is not None
    line = engine.stdout.readline()
    assert line, f"the engine exited with {engine.wait()} before its result (see its log)"
    result: dict[str, Any] = json.loads(line)
    return result


def results(round_: list[dict[str, Any]]) -> list[Result]:
    return [Result(tuple(r["tokens"]), tuple({int(t): lp for t, lp in p} for p in r["logprobs"]), r["cached"])
            for r in round_]


def pool_index(node_path: Path) -> mmap.mmap:
    """The shared index the engines used (the only one under ``node_path``)."""
    (index,) = node_path.rglob("index")
    with open(index, "r+b") as f:
        return mmap.mmap(f.fileno(), 0)


def test_engine_b_loads_engine_a_prefixes_from_the_node_pool_and_survives_a_killed(
        model_dir: Path, baseline: Baseline, node_path: Path, tmp_path: Path) -> None:
    with open(tmp_path / "engines.log", "w") as log:
        a = start_engine(model_dir, node_path, log, [ROUNDS["first"]], loop=True)
        # B starts beside A (the start-ups overlap) and serves once A has served its first round.
        b = start_engine(model_dir, node_path, log, [ROUNDS["second"], ROUNDS["first"]], announce=True, hold=True,
                         hold_before=[1])
        try:
            first = results(read_result(a)["rounds"][0])
            assert_same_outputs(first, baseline["first"])

            assert b.stdin is not None and b.stdout is not None and b.stdout.readline() == "serving\n"
            os.kill(a.pid, signal.SIGKILL)  # mid-loop: its pins, stores and attachment are left behind
            a.wait()
            b.stdin.write("go\n")
            b.stdin.flush()
            holders = []
            resume(b, "round 1\n", lambda: holders.append(hold_lock(node_path)))  # the lock held for round 1
            b_result = read_result(b)
            second, locked_out = results(b_result["rounds"][0]), results(b_result["rounds"][1])
            assert b.wait(timeout=300) == 0
        finally:
            a.kill()
            b.kill()  # once it has exited (checked above), a no-op
            for holder in holders:
                release(holder, kill=False)
        assert_same_outputs(second, baseline["second"])
        assert_same_outputs(locked_out, baseline["first"])  # every request finished, under the held lock
        assert sum(r.cached_tokens for r in second) > 0  # B loaded what A stored, in B's fresh process
        assert b_result["counters"]["node_cross_hits"] > 0  # and its /metrics says so

        again = start_engine(model_dir, node_path, log, [ROUNDS["second"]])
        third = results(read_result(again)["rounds"][0])
        assert again.wait(timeout=300) == 0
    assert_same_outputs(third, baseline["second"])
    assert [r.cached_tokens for r in third] == [HIT_TOKENS] * len(third)  # every prefix from the pool

    segment = pool_index(node_path)
    (index_file,) = node_path.rglob("index")
    locks = EngineLocks(index_file.parent, Access(tier="node"))
    assert _nodeindex.check(segment, locks.fd, -1) is None
    survivor = NodeIndex(segment, locks)  # releases the dead
    stats = survivor.pool_counters()
    assert 1 <= stats["reclaimed"] <= 3, stats  # the killed A at least (B and the new A detach at shutdown)
    assert stats["attached"] == 1 and stats["cross_hits"] > 0, stats
    survivor.check_integrity()
