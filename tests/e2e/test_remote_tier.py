"""Two vLLM engines in separate processes share one redis-server through kvoffload's remote tier.

Engine A serves the workload's first round, storing its prefixes through its small host tier into the remote
tier. Engine B, another process with an empty host tier, then serves the second round on the same prefixes: they
come from the remote tier, and the outputs equal plain vLLM's (the baseline carries its sensitivity control).

B reaches the server through a ``FaultProxy``, which freezes before B serves the first round's prompts too: its
host tier (12 blocks, half the first round's) keeps only part of the prefixes, so those requests need the frozen
server. vLLM skips them while their lookups wait for it, a search past its deadline is a miss, and every request
finishes with plain vLLM's outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from tests.e2e.conftest import BLOCK_SIZE, PREFIX_TOKENS, ROUNDS, Baseline, Result, assert_same_outputs, resume

from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tools.vllm.model import TinyShape

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HIT_TOKENS = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE
_SHAPE = TinyShape()
BLOCK_BYTES = 2 * _SHAPE.num_layers * _SHAPE.num_kv_heads * BLOCK_SIZE * _SHAPE.head_dim * 2  # K and V, bf16


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer({"maxmemory": "256mb", "maxmemory-policy": "allkeys-lru"}) as s:
        yield s


def start_engine(model_dir: Path, url: str, rounds: list[tuple[int, ...]], log: IO[str], host_blocks: int = 16,
                 **spec: Any) -> subprocess.Popen[str]:
    # A host tier of 16 blocks, smaller than the 24 the first round stores: the remote tier holds all.
    request = {"extra_config": {"host_bytes": host_blocks * BLOCK_BYTES, "remote_url": url}, "rounds": rounds,
               **spec}
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
    with open(tmp_path / "engines.log", "w") as log, FaultProxy("127.0.0.1", server.port) as proxy:
        a_engine = start_engine(model_dir, server.url, [ROUNDS["first"]], log)
        # B starts beside A (the start-ups overlap) and serves once A is done.
        b_engine = start_engine(model_dir, f"redis://{proxy.url_host}", [ROUNDS["second"], ROUNDS["first"]], log,
                                host_blocks=12, announce=True, hold=True, hold_before=[1])
        try:
            a = finish(a_engine)
            resume(b_engine, "serving\n")
            resume(b_engine, "round 1\n", lambda: proxy.set(Fault.FREEZE))
            b = finish(b_engine)
        finally:
            a_engine.kill()
            b_engine.kill()  # once it has exited (checked above), a no-op

    assert_same_outputs(results(a["rounds"][0]), baseline["first"])
    assert a["counters"]["host_to_remote"] > 0
    second = results(b["rounds"][0])
    assert_same_outputs(second, baseline["second"])
    assert [r.cached_tokens for r in second] == [HIT_TOKENS] * len(second)  # every prefix came from A
    served = b["round_counters"][0]
    assert served["remote_to_host"] > 0 and served["hit_tokens"] == HIT_TOKENS * len(second)
    frozen = results(b["rounds"][1])  # every request finished, though the server answered nothing
    assert_same_outputs(frozen, baseline["first"])
    assert min(r.cached_tokens for r in frozen) < HIT_TOKENS  # the host alone could not serve it: the server was asked
    assert b["round_counters"][1]["remote_to_host"] == served["remote_to_host"]
