"""``kvoffload demo --json`` end to end, at a tiny size: real vLLM (CPU) without and with kvoffload.

One run proves what three did: the demo bound to one CPU (``--cpu-bind``) from a clean environment, as from a
user's shell, with a remote tier on a redis-server it starts (``--remote-server``) under a host tier of a few blocks,
so later turns load through both tiers. Checks what the demo reports, not how fast it was (speed is the demo's and
the benchmarks' business); the binding's resolution without a flag is tests/tools/vllm/test_cpu_binding.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload.tools.vllm.cpu_binding import resolve

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

TINY = [
    "--conversations", "2", "--turns", "3",
    "--system-tokens", "16", "--first-user-tokens", "96", "--user-tokens", "24", "--reply-tokens", "4",
    "--hidden-size", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
    "--host-gib", "0.0002",
]  # fmt: skip
"""A host tier of 200 KiB: a few blocks, so most of what later turns load comes from the remote tier."""


@pytest.fixture(scope="module")
def one_cpu() -> int:
    return min(resolve().cpus)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, one_cpu: int) -> tuple[dict[str, Any], Path]:
    # In-process vLLM binds nothing itself: only the OpenMP variables the demo sets make the engines take one CPU.
    # Started from a clean environment, as from a user's shell: the in-process engines of earlier tests leave
    # vLLM's own settings in this process's environment (seen: a demo engine then computing with 2 threads).
    out = tmp_path_factory.mktemp("demo")
    clean = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "VLLM_CPU_KVCACHE_SPACE")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.tools.cli", "demo", "--json", "--no-chart", "--out", str(out),
         "--cpu-bind", str(one_cpu), "--remote-server", *TINY],
        capture_output=True, text=True, timeout=600, check=False, env=clean,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout), out  # stdout holds the JSON alone: vLLM's logs went to stderr


def test_summary_has_the_documented_fields(demo: tuple[dict[str, Any], Path]) -> None:
    summary, _ = demo
    for key in ("ttft_ratio_hit_turns", "ttft_ratio_miss_turns", "outputs_match", "control", "hit_turns",
                "miss_turns", "off", "on", "targets", "workload", "model"):  # fmt: skip
        assert key in summary, key
    for run in ("off", "on"):
        for key in ("ttft_median_s", "offload_hit_rate", "device_hit_rate", "bytes_loaded", "bytes_stored"):
            assert key in summary[run], (run, key)


def test_kvoffload_serves_later_turns_and_outputs_match(demo: tuple[dict[str, Any], Path]) -> None:
    summary, _ = demo
    # The control: a token changed inside a loaded run moved plain vLLM's outputs, so the match below means
    # something (outputs_match is None otherwise).
    assert summary["control"]["holds"] is True
    assert summary["outputs_match"] is True
    assert summary["hit_turns"] > 0
    assert summary["ttft_ratio_hit_turns"] > 0
    assert summary["on"]["offload_hit_rate"] > 0
    assert summary["on"]["bytes_loaded"] > 0
    assert summary["on"]["bytes_stored"] > 0


def test_run_without_kvoffload_moves_nothing(demo: tuple[dict[str, Any], Path]) -> None:
    summary, _ = demo
    assert summary["off"]["offload_hit_rate"] == 0
    assert summary["off"]["bytes_loaded"] == summary["off"]["bytes_stored"] == 0


def test_a_cpu_bind_of_one_cpu_gives_each_in_process_engine_one_thread(demo: tuple[dict[str, Any], Path],
                                                                      one_cpu: int) -> None:
    summary, _ = demo
    binding = resolve(str(one_cpu))
    assert summary["cpu_binding"] == binding.as_json()
    assert summary["cpu_binding"]["source"] == "--cpu-bind"
    for run in ("off", "on"):
        assert (summary[run]["cpu_bind"], summary[run]["omp_threads"]) == (binding.spec, 1), run


def test_details_file_lists_every_turn(demo: tuple[dict[str, Any], Path]) -> None:
    summary, out = demo
    details = json.loads((out / "demo.json").read_text())
    assert len(details["turns"]) == 2 * 3
    assert details["ttft_ratio_hit_turns"] == summary["ttft_ratio_hit_turns"]
    assert all(row["match"] for row in details["turns"])


def test_with_a_remote_tier_under_a_tiny_host_tier_later_turns_still_load_and_match(
        demo: tuple[dict[str, Any], Path]) -> None:
    summary, _ = demo
    assert summary["engine"]["remote_tier"] is True
    assert summary["control"]["holds"] is True and summary["outputs_match"] is True
    assert summary["hit_turns"] > 0 and summary["on"]["bytes_loaded"] > 0
