"""Two vLLM engines in separate processes share one redis-server through kvoffload's remote tier.

Engine A serves the workload's first round, storing its prefixes through its small host tier into the remote
tier. Engine B, another process with an empty host tier, then serves the second round on the same prefixes: they
come from the remote tier, and the outputs equal plain vLLM's (the baseline carries its sensitivity control).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from tests.e2e.conftest import BLOCK_SIZE, PREFIX_TOKENS, ROUNDS, Baseline, Result, assert_same_outputs

from kvoffload.testing.redis_server import RedisServer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HIT_TOKENS = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer({"maxmemory": "256mb", "maxmemory-policy": "allkeys-lru"}) as s:
        yield s


def start_engine(model_dir: Path, url: str, rounds: list[tuple[int, ...]], log: IO[str],
                 **spec: Any) -> subprocess.Popen[str]:
    # A host tier of 16 blocks (32 KiB each), smaller than the 24 the first round stores: the remote tier holds all.
    request = {"extra_config": {"host_bytes": 16 * 32 << 10, "remote_url": url}, "rounds": rounds, **spec}
    return subprocess.Popen([sys.executable, "-m", "tests.e2e.tier_engine", str(model_dir), json.dumps(request)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)


def finish(engine: subprocess.Popen[str]) -> dict[str, Any]:
    """The engine's result line, once it exited cleanly."""
    out, _ = engine.communicate(timeout=600)
    assert engine.returncode == 0, f"the engine exited with {engine.returncode} (see its log)"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def results(round_: list[dict[str, Any]]) -> list[Result]:
    return [Result(tuple(r["tokens"]), tuple({int(t): lp for t, lp in p} for p in r["logprobs"]), r["cached"])
            for r in round_]


def test_engine_b_loads_engine_a_prefixes_from_the_remote_tier_with_plain_vllm_outputs(
        model_dir: Path, baseline: Baseline, server: RedisServer, tmp_path: Path) -> None:
    with open(tmp_path / "engines.log", "w") as log:
        a_engine = start_engine(model_dir, server.url, [ROUNDS["first"]], log)
        # B starts beside A (the start-ups overlap) and serves once A is done.
        b_engine = start_engine(model_dir, server.url, [ROUNDS["second"]], log, announce=True, hold=True)
        try:
            a = finish(a_engine)
            assert b_engine.stdin is not None and b_engine.stdout is not None
            assert b_engine.stdout.readline() == "serving\n"
            b_engine.stdin.write("go\n")
            b = finish(b_engine)
        finally:
            a_engine.kill()
            b_engine.kill()  # once it has exited (checked above), a no-op

    assert_same_outputs(results(a["rounds"][0]), baseline["first"])
    assert a["counters"]["host_to_remote"] > 0
    second = results(b["rounds"][0])
    assert_same_outputs(second, baseline["second"])
    assert [r.cached_tokens for r in second] == [HIT_TOKENS] * len(second)  # every prefix came from A
    assert b["counters"]["remote_to_host"] > 0 and b["counters"]["hit_tokens"] == HIT_TOKENS * len(second)
