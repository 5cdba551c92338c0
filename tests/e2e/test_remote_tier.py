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
from typing import Any

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


def run_engine(model_dir: Path, url: str, rounds: list[tuple[int, ...]]) -> dict[str, Any]:
    # A host tier of 16 blocks (32 KiB each), smaller than the 24 the first round stores: the remote tier holds all.
    spec = {"extra_config": {"host_bytes": 16 * 32 << 10, "remote_url": url}, "rounds": rounds}
    proc = subprocess.run([sys.executable, "-m", "tests.e2e.tier_engine", str(model_dir), json.dumps(spec)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def results(round_: list[dict[str, Any]]) -> list[Result]:
    return [Result(tuple(r["tokens"]), tuple({int(t): lp for t, lp in p} for p in r["logprobs"]), r["cached"])
            for r in round_]


def test_engine_b_loads_engine_a_prefixes_from_the_remote_tier_with_plain_vllm_outputs(
        model_dir: Path, baseline: Baseline, server: RedisServer) -> None:
    a = run_engine(model_dir, server.url, [ROUNDS["first"]])
    b = run_engine(model_dir, server.url, [ROUNDS["second"]])

    assert_same_outputs(results(a["rounds"][0]), baseline["first"])
    assert a["counters"]["host_to_remote"] > 0
    second = results(b["rounds"][0])
    assert_same_outputs(second, baseline["second"])
    assert [r.cached_tokens for r in second] == [HIT_TOKENS] * len(second)  # every prefix came from A
    assert b["counters"]["remote_to_host"] > 0 and b["counters"]["hit_tokens"] == HIT_TOKENS * len(second)
