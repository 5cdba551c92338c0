"""Two vLLM engines in separate processes share one S3 bucket (a real Ceph radosgw) through kvoffload's object tier.

Engine A serves the workload's first round with a small host tier over the object tier, which stores every block
write-through into a fresh bucket: the bucket then holds one object per block. Engine B, another process with an
empty host tier and no other tier, serves the second round on the same prefixes: they come from the bucket, and
the outputs equal plain vLLM's (the baseline carries its sensitivity control). Engine C is B with its first load
zeroed (``inject_load_corruption``): exactly that request differs from plain vLLM's, so the comparison of B's
outputs would catch a wrong load from the bucket.

B reaches the server through a ``FaultProxy``, which freezes before B serves the first round's prompts too: its
host tier (12 blocks, half the first round's) keeps only part of the prefixes, so those requests need the frozen
server. vLLM skips them while their lookups wait for it, a search past its deadline is a miss, and every request
finishes with plain vLLM's outputs.

The engines find the server's keys where boto3's chain looks first (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``), and nothing of this machine's own AWS set-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import pytest
from tests.e2e.conftest import (
    BLOCK_SIZE,
    NUM_PREFIXES,
    PREFIX_TOKENS,
    ROUNDS,
    Baseline,
    Result,
    assert_same_outputs,
    resume,
)
from tests.tiers.object.conftest import admin_client, empty_bucket

from kvoffload.testing.ceph_rgw import CephRGW
from kvoffload.testing.fault_proxy import Fault, FaultProxy
from kvoffload.testing.outputs import TOLERANCE, divergence
from kvoffload.tools.vllm.model import TinyShape

pytestmark = [pytest.mark.e2e, pytest.mark.ceph]

ROOT = Path(__file__).resolve().parents[2]
HIT_TOKENS = PREFIX_TOKENS // BLOCK_SIZE * BLOCK_SIZE
PREFIX = "e2e"
STORED_BLOCKS = NUM_PREFIXES * (PREFIX_TOKENS // BLOCK_SIZE)
"""The full blocks of the first round (a prompt's tail and generated tokens do not reach the next block)."""
_SHAPE = TinyShape()
BLOCK_BYTES = 2 * _SHAPE.num_layers * _SHAPE.num_kv_heads * BLOCK_SIZE * _SHAPE.head_dim * 2  # K and V, bf16
HOST_SLOTS = 16
"""Fewer than ``STORED_BLOCKS``: A's host tier cannot keep the first round, the bucket holds it all."""


@pytest.fixture(scope="module")
def bucket(ceph_rgw: CephRGW) -> Iterator[str]:
    s3 = admin_client(ceph_rgw, read_timeout_s=60.0)  # a cluster's first CreateBucket takes seconds
    name = f"kvoffload-e2e-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    yield name
    empty_bucket(s3, name, remove=True)


def engine_environ(server: CephRGW) -> dict[str, str]:
    """This process's environment with the server's keys as the only AWS credentials an engine can find."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key,
               AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true")
    return env


def start_engine(model_dir: Path, server: CephRGW, bucket: str, rounds: list[tuple[int, ...]], log: IO[str],
                 *, faults: dict[str, int] | None = None, host_slots: int = HOST_SLOTS, endpoint: str | None = None,
                 **spec: Any) -> subprocess.Popen[str]:
    extra = {"host_bytes": host_slots * BLOCK_BYTES, "object_url": f"s3://{bucket}/{PREFIX}",
             "object_endpoint": endpoint or server.endpoint, "object_region": server.region, **(faults or {})}
    request = {"extra_config": extra, "rounds": rounds, **spec}
    return subprocess.Popen([sys.executable, "-m", "tests.e2e.tier_engine", str(model_dir), json.dumps(request)],
                            cwd=ROOT, env=engine_environ(server), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True)


def serve(engine: subprocess.Popen[str], before_round_1: Callable[[], None] | None = None) -> dict[str, Any]:
    """Let a held engine serve (calling ``before_round_1`` when it holds before its second round); its result
    line, once it exited cleanly."""
    resume(engine, "serving\n")
    if before_round_1 is not None:
        resume(engine, "round 1\n", before_round_1)
    return finish(engine)


def finish(engine: subprocess.Popen[str]) -> dict[str, Any]:
    """The engine's result line, once it exited cleanly."""
    out, _ = engine.communicate(timeout=600)
    assert engine.returncode == 0, f"the engine exited with {engine.returncode} (see its log)"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def results(round_: list[dict[str, Any]]) -> list[Result]:
    return [Result(tuple(r["tokens"]), tuple({int(t): lp for t, lp in p} for p in r["logprobs"]), r["cached"])
            for r in round_]


def objects(server: CephRGW, bucket: str) -> dict[str, int]:
    """Every object of ``bucket``: name -> size."""
    pages = admin_client(server).get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


@pytest.fixture(scope="module")
def served(model_dir: Path, baseline: Baseline, ceph_rgw: CephRGW, bucket: str,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A serves the first round; then B, then C (the corrupted), the second round. Their results, and the bucket's
    objects as A left them."""
    where = urlsplit(ceph_rgw.endpoint)
    with open(tmp_path_factory.mktemp("object-e2e") / "engines.log", "w") as log, \
            FaultProxy(where.hostname or "127.0.0.1", where.port or 80) as proxy:
        a_engine = start_engine(model_dir, ceph_rgw, bucket, [ROUNDS["first"]], log)
        # B and C start beside A (the start-ups overlap) and serve one after the other once A is done.
        b_engine = start_engine(model_dir, ceph_rgw, bucket, [ROUNDS["second"], ROUNDS["first"]], log,
                                host_slots=12, endpoint=f"http://{proxy.url_host}", announce=True, hold=True,
                                hold_before=[1])
        c_engine = start_engine(model_dir, ceph_rgw, bucket, [ROUNDS["second"]], log,
                                faults={"inject_load_corruption": 1}, announce=True, hold=True)
        try:
            a = finish(a_engine)
            stored = objects(ceph_rgw, bucket)
            b = serve(b_engine, lambda: proxy.set(Fault.FREEZE))
            c = serve(c_engine)
        finally:
            for engine in (a_engine, b_engine, c_engine):
                engine.kill()  # once it has exited (checked above), a no-op
    return {"a": a, "b": b, "c": c, "stored": stored}


def test_engine_a_stores_every_block_of_its_prompts_as_an_object_in_the_bucket(served: dict[str, Any],
                                                                              baseline: Baseline) -> None:
    assert_same_outputs(results(served["a"]["rounds"][0]), baseline["first"])
    counters = served["a"]["counters"]
    # Stores finishing after A's last step reach its metrics with no later step: the bucket is the full count.
    assert 0 < counters["host_to_object"] <= STORED_BLOCKS * BLOCK_BYTES and counters["failed_jobs"] == 0
    stored = served["stored"]
    assert len(stored) == STORED_BLOCKS, sorted(stored)
    assert all(name.startswith(f"{PREFIX}/kvoffload/") and "/r0/" in name for name in stored), sorted(stored)
    (size,) = set(stored.values())
    assert BLOCK_BYTES < size <= BLOCK_BYTES + 4096  # one block and its header


def test_engine_b_loads_engine_a_prefixes_from_the_bucket_with_plain_vllm_outputs(served: dict[str, Any],
                                                                                  baseline: Baseline) -> None:
    second = results(served["b"]["rounds"][0])
    assert_same_outputs(second, baseline["second"])
    assert [r.cached_tokens for r in second] == [HIT_TOKENS] * len(second)  # every prefix came from A
    counters = served["b"]["round_counters"][0]
    assert counters["object_to_host"] == STORED_BLOCKS * BLOCK_BYTES  # each object loaded once
    assert counters["hit_tokens"] == HIT_TOKENS * len(second)
    assert counters["failed_jobs"] == 0


def test_a_frozen_server_costs_engine_b_recomputes_and_every_request_finishes_with_plain_vllm_outputs(
        served: dict[str, Any], baseline: Baseline) -> None:
    frozen = results(served["b"]["rounds"][1])  # every request finished, though the server answered nothing
    assert_same_outputs(frozen, baseline["first"])
    assert min(r.cached_tokens for r in frozen) < HIT_TOKENS  # the host alone could not serve it: the server was asked
    before, after = served["b"]["round_counters"]
    assert after["object_to_host"] == before["object_to_host"]


def test_a_zeroed_block_loaded_from_the_bucket_makes_exactly_its_request_differ_from_plain_vllm(
        served: dict[str, Any], baseline: Baseline) -> None:
    second = results(served["c"]["rounds"][0])
    assert [r.cached_tokens for r in second] == [HIT_TOKENS] * len(second)
    assert served["c"]["counters"]["object_to_host"] > 0 and served["c"]["counters"]["failed_jobs"] == 0
    assert divergence(second[:1], baseline["second"][:1]) > TOLERANCE
    with pytest.raises(AssertionError, match="differ from plain vLLM"):
        assert_same_outputs(second, baseline["second"])
    assert_same_outputs(second[1:], baseline["second"][1:])
