"""Tenants through vLLM's OpenAI server: requests carry their ``cache_salt``; one tenant's flood of long, new prompts
leaves another tenant's prefix in the host tier, and its return loads it and completes as the first time; the
control, in the same server before the quotas name anyone, is the same flood evicting the prefix. The quotas
change between the two rounds through the quota file, on the running server, and the per-tenant series on
/metrics count the tenant's hits.

One server serves both rounds (a server costs tens of seconds to start on two cores): round one runs with the
quota file naming nobody (every tenant counts in "other": one pool, as without tenants), round two after the file
names the tenants.

The same on the node pool with two engines: the server serves acme, and another engine (``tier_engine``'s flood
mode, in its own process) floods the pool they share; the quota file both read names the tenants between the
rounds, and the server writes the shares into the pool's table.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.conftest import BLOCK_SIZE, DEVICE_BLOCKS, MAX_MODEL_LEN

from kvoffload.tools.bench.serve_server import Server, ServerSettings
from kvoffload.tools.vllm.model import TinyShape

pytestmark = pytest.mark.e2e

_SHAPE = TinyShape()
BLOCK_BYTES = 2 * _SHAPE.num_layers * _SHAPE.num_kv_heads * BLOCK_SIZE * _SHAPE.head_dim * 2  # K and V, bf16
HOST_BLOCKS = 16
PREFIX_TOKENS = 6 * BLOCK_SIZE  # acme's prompt: 6 blocks, within its share of the host tier (8 of 16)
FLOOD_TOKENS = 7 * BLOCK_SIZE
FLOODS = 6  # 42 new blocks: the host tier over twice, the device cache (15 blocks) many times
ROOT = Path(__file__).resolve().parents[2]
HIT_TOKENS = PREFIX_TOKENS - BLOCK_SIZE  # vLLM computes at least the last token: the last full block is not loaded
NOBODY = {"default": 1.0}
QUOTAS = {"default": 0.1, "acme": 0.5, "flood": 0.4}


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("tenants")
    quota = tmp / "quota.json"
    quota.write_text(json.dumps(NOBODY))
    extra = {"host_bytes": HOST_BLOCKS * BLOCK_BYTES, "tenant_by": "cache_salt", "tenant_quota_file": str(quota)}
    settings = ServerSettings(model_dir, BLOCK_SIZE, DEVICE_BLOCKS, MAX_MODEL_LEN, "bfloat16", extra)
    with Server(settings, tmp / "server.log") as running:
        yield running, quota


def complete(server: Server, prompt: list[int], salt: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
            "cache_salt": salt}
    request = urllib.request.Request(f"{server.base_url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        choice: dict[str, Any] = json.loads(r.read())["choices"][0]
    return choice


def series(server: Server, name: str, **labels: str) -> float:
    """The sum of ``vllm:kvoffload_<name>`` over the series whose labels include ``labels``."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(value for key, value in server.metrics().items()
               if key.startswith(f"vllm:kvoffload_{name}{{") and all(w in key for w in wanted))


def flood_round(server: Server, seed: int, flood: Any = None) -> tuple[dict[str, Any], dict[str, Any], float]:
    """acme's prompt, the flood, acme's prompt again: both completions and the tokens the return loaded.
    ``flood``: floods from another engine instead of this server (which then serves a third tenant's prompts, so
    that acme's blocks leave its own device cache)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)]
    first = complete(server, prefix, "acme")
    if flood is None:
        for _ in range(FLOODS):
            complete(server, [rng.randrange(10, 1000) for _ in range(FLOOD_TOKENS)], "flood")
    else:
        flood(seed)
        for _ in range(3):
            complete(server, [rng.randrange(10, 1000) for _ in range(FLOOD_TOKENS)], "zed")
    before = series(server, "hit_tokens_total")
    again = complete(server, prefix, "acme")
    return first, again, series(server, "hit_tokens_total") - before


def name_the_tenants(running: Server, quota: Path) -> None:
    """The quotas change on the running server: the engine reads the file within a second of a step."""
    quota.write_text(json.dumps(QUOTAS))
    os.utime(quota, ns=(time.time_ns(), time.time_ns()))
    time.sleep(1.2)
    complete(running, [1, 2, 3], "warm-up")  # a step that reads the new quotas


def assert_same_completion(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Loaded KV completes as computed KV did: the same tokens and the same top log-probabilities."""
    assert got["text"] == want["text"]
    for mine, theirs in zip(got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"], strict=True):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[k] - theirs[k]) < 0.05 for k in mine)


def test_a_flood_evicts_the_prefix_until_the_quota_file_names_the_tenants_then_it_hits(
        server: tuple[Server, Path]) -> None:
    running, quota = server
    # Round one, nobody named: the flood's blocks push acme's out of the host tier (the control).
    first, again, loaded = flood_round(running, seed=1)
    assert loaded == 0
    assert again["text"] == first["text"]  # computed again, the same tokens
    name_the_tenants(running, quota)
    acme_hits = series(running, "tenant_hit_tokens_total", tenant="acme")
    first, again, loaded = flood_round(running, seed=2)
    assert loaded >= HIT_TOKENS  # acme's prefix survived the flood in the host tier, and was loaded
    assert series(running, "tenant_hit_tokens_total", tenant="acme") - acme_hits >= HIT_TOKENS
    assert_same_completion(again, first)
    # The figures an operator reads: acme's resident bytes in the host tier, the flood's evictions of its own.
    assert series(running, "tenant_used_bytes", tenant="acme", tier="host") >= 6 * BLOCK_BYTES
    assert series(running, "tenant_evicted_blocks_total", tenant="flood", tier="host") > 0
    assert series(running, "tenant_evicted_blocks_total", tenant="acme", tier="host") == 0


def read_line(engine: subprocess.Popen[str], timeout_s: float = 300.0) -> str:
    """The engine's next line; a test failure (not a hang) when none comes in time or it exited."""
    assert engine.stdout is not None
    ready, _, _ = select.select([engine.stdout], [], [], timeout_s)
    assert ready, f"no line from the engine in {timeout_s:.0f} s (see its log)"
    line = engine.stdout.readline()
    assert line, f"the engine exited with {engine.wait()} (see its log)"
    return line


def test_on_a_node_pool_another_engines_flood_evicts_the_prefix_until_the_tenants_are_named(
        model_dir: Path, node_path: Path, tmp_path: Path) -> None:
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps(NOBODY))
    extra = {"host_bytes": HOST_BLOCKS * BLOCK_BYTES, "host_scope": "node", "node_path": str(node_path),
             "tenant_by": "cache_salt", "tenant_quota_file": str(quota)}
    spec = {"extra_config": extra, "rounds": [], "announce": True, "flood": {"salt": "flood", "prompts": FLOODS,
                                                           "tokens": FLOOD_TOKENS}}
    with open(tmp_path / "flooder.log", "w") as log:
        flooder = subprocess.Popen([sys.executable, "-m", "tests.e2e.tier_engine", str(model_dir), json.dumps(spec)],
                                   cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert flooder.stdin is not None and flooder.stdout is not None

            def flood(seed: int) -> None:
                flooder.stdin.write(f"{seed}\n")  # type: ignore[union-attr]
                flooder.stdin.flush()  # type: ignore[union-attr]
                assert read_line(flooder) == "flooded\n"

            settings = ServerSettings(model_dir, BLOCK_SIZE, DEVICE_BLOCKS, MAX_MODEL_LEN, "bfloat16", extra)
            with Server(settings, tmp_path / "server.log") as running:  # starts beside the flooder
                assert read_line(flooder) == "serving\n"
                first, again, loaded = flood_round(running, seed=3, flood=flood)
                assert loaded == 0  # the control: the other engine's flood evicted acme's blocks from the pool
                assert again["text"] == first["text"]
                name_the_tenants(running, quota)
                first, again, loaded = flood_round(running, seed=4, flood=flood)
                assert loaded >= HIT_TOKENS  # acme's prefix survived the other engine's flood, and was loaded
                assert_same_completion(again, first)
        finally:
            if flooder.stdin is not None:
                flooder.stdin.close()
            flooder.wait(timeout=120)
    assert flooder.returncode == 0
