"""``kvoffload bench serve``: its summary and verdict, the server's clean-up, and one small run on real vLLM.

The summary tests feed hand-made client results (the shape of ``vllm.benchmarks.serve.main``'s) to check what the
bench concludes from them, a wrong output included; the last test starts real vLLM servers. None of these tests
time anything.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvoffload.tools.bench import serve
from kvoffload.tools.bench.serve_server import Server, mapped_segments, parse_metrics, session_pids
from kvoffload.tools.replay import read_trace, replay
from kvoffload.tools.vllm.cpu_binding import BindingMismatch, EngineBinding, resolve


def _client(texts: list[str], throughput: float, median_ttft: float) -> dict[str, Any]:
    return {"completed": len(texts), "failed": 0, "request_throughput": throughput, "output_throughput": 10.0,
            "mean_ttft_ms": median_ttft, "median_ttft_ms": median_ttft, "p99_ttft_ms": 2 * median_ttft,
            "generated_texts": texts, "ttfts": [median_ttft / 1000] * len(texts)}


def _run(plain_texts: list[str], ours_texts: list[str], hits: float = 4096.0) -> dict[str, dict[str, Any]]:
    before = {'vllm:kvoffload_hit_tokens_total{engine="0"}': 0.0}
    after = {'vllm:kvoffload_hit_tokens_total{engine="0"}': hits,
             'vllm:kvoffload_transfer_bytes_total{direction="host_to_device",engine="0"}': hits * 64}
    return {"plain": {"client": _client(plain_texts, 1.0, 600.0), "metrics_before": {}, "metrics_after": {}},
            "kvoffload": {"client": _client(ours_texts, 2.0, 200.0), "metrics_before": before,
                          "metrics_after": after}}


def test_equal_outputs_and_large_gains_meet_the_targets() -> None:
    texts = ["a b", "c d", "e f"]
    summary = serve.summarize([_run(texts, list(texts))])
    assert summary["throughput_ratio"] == 2.0 and summary["median_ttft_ratio"] == pytest.approx(1 / 3)
    assert summary["outputs_equal"] and summary["comparison_trusted"] and summary["targets_met"]
    ours = summary["rows"][1]
    assert ours["hit_tokens"] == 4096 and ours["bytes_host_to_device"] == 4096 * 64


def test_one_wrong_output_fails_the_verdict() -> None:
    summary = serve.summarize([_run(["a b", "c d", "e f"], ["a b", "c X", "e f"])])
    assert summary["rows"][1]["outputs_equal"] == 2
    assert not summary["outputs_equal"] and not summary["targets_met"]


def test_outputs_that_ignore_their_prompt_prove_nothing() -> None:
    summary = serve.summarize([_run(["same"] * 3, ["same"] * 3)])
    assert summary["outputs_equal"] and not summary["comparison_trusted"] and not summary["targets_met"]


def test_ratios_are_medians_over_repeats_of_each_repeat_s_ratio() -> None:
    texts = ["a", "b"]
    runs = [_run(texts, texts) for _ in range(3)]
    runs[1]["kvoffload"]["client"]["request_throughput"] = 1.2  # one slow repeat: 1.2x
    assert serve.summarize(runs)["throughput_ratio"] == 2.0
    runs[2]["kvoffload"]["client"]["request_throughput"] = 1.2
    assert serve.summarize(runs)["throughput_ratio"] == 1.2


def test_rows_record_the_binding_each_server_logged() -> None:
    run = _run(["a", "b"], ["a", "b"])
    for side in serve.SIDES:
        run[side]["binding"] = EngineBinding("0-1", 2)
    rows = serve.summarize([run])["rows"]
    assert [(r["side"], r["cpu_bind"], r["omp_threads"]) for r in rows] == [("plain", "0-1", 2),
                                                                           ("kvoffload", "0-1", 2)]


def test_servers_bound_differently_are_not_compared() -> None:
    # What vLLM's default binding does on 2 cores: 1 thread without a KV connector, 2 with one.
    runs = [_run(["a", "b"], ["a", "b"]) for _ in range(2)]
    for run in runs:
        run["plain"]["binding"], run["kvoffload"]["binding"] = EngineBinding("0-1", 2), EngineBinding("0-1", 2)
    runs[1]["plain"]["binding"] = EngineBinding("0", 1)
    with pytest.raises(BindingMismatch, match=r"plain \(repeat 1\) CPUs 0 \(1 OpenMP thread\)"):
        serve.summarize(runs)


def test_a_cpu_bind_that_is_not_a_cpu_list_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm.benchmarks.serve")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(["--cpu-bind", "auto"])) == 2
    assert "--cpu-bind='auto'" in capsys.readouterr().err


def test_metrics_parsing_keeps_the_prefix_s_series_with_their_labels() -> None:
    text = ("# HELP vllm:kvoffload_hit_tokens_total x\n"
            'vllm:kvoffload_hit_tokens_total{engine="0"} 12.0\n'
            'vllm:kvoffload_hit_tokens_created{engine="0"} 1.79e+09\n'
            'vllm:prefix_cache_hits_total{engine="0"} 5.0\n'
            'vllm:kvoffload_host_used_bytes{engine="0"} 3.5e+06\n')
    assert parse_metrics(text, "vllm:kvoffload_") == {'vllm:kvoffload_hit_tokens_total{engine="0"}': 12.0,
                                                      'vllm:kvoffload_host_used_bytes{engine="0"}': 3.5e6}


def test_a_session_s_processes_and_the_segments_they_map_are_found() -> None:
    name = f"kvoffload-test-{uuid.uuid4().hex[:8]}"
    code = ("import sys, time; from multiprocessing import shared_memory as m; "
            f"s = m.SharedMemory(name={name!r}, create=True, size=4096); print('up', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        session = session_pids(child.pid)  # the child and the resource tracker it started
        assert child.pid in session and os.getpid() not in session
        assert Path(f"/dev/shm/{name}") in mapped_segments([child.pid])
        assert Path(f"/dev/shm/{name}") not in mapped_segments([])
    finally:
        child.kill()
        child.wait()
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)


@pytest.mark.e2e
@pytest.mark.usefixtures("startup_environ")  # servers start as from a user's shell, whatever ran before
def test_a_small_run_serves_both_sides_with_hits_and_leaves_nothing_behind(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    # Three prefixes of 8 blocks, a device cache that holds about one: returning prefixes come from kvoffload.
    args = parser.parse_args(["--prefixes", "3", "--prefix-tokens", "256", "--suffix-tokens", "32",
                              "--output-tokens", "4", "--prompts", "9", "--device-blocks", "14",
                              "--model-dir", str(tmp_path / "model"), "--record-trace", str(tmp_path / "trace.jsonl")])
    work = serve.Workload(args.prefixes, args.prefix_tokens, args.suffix_tokens, args.output_tokens, args.prompts,
                          args.concurrency)
    binding = resolve()
    settings = serve.engine_settings(args, work, tmp_path / "model", binding)
    runs: dict[str, dict[str, Any]] = {}
    for side in serve.SIDES:
        with Server(settings[side], tmp_path / f"{side}.log") as server:
            # An explicit binding gives the server with a KV connector the threads of the one without.
            assert server.binding == binding.expected(), side
            runs[side] = {"metrics_before": server.metrics(), "binding": server.binding,
                          "client": serve.run_client(work.client_args(server.base_url, tmp_path / "model"))}
            runs[side]["metrics_after"] = server.metrics()
            assert server.process is not None
            pids = session_pids(server.process.pid)
        assert server.segments, "vLLM's server maps shared-memory segments: none found, the clean-up is untested"
        assert not any(p.exists() for p in server.segments)
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    # The kvoffload side recorded its requests (the plain side has no connector to record them): three prefixes,
    # so a replay through a tier that holds them all hits the full blocks of every returning prefix (all but the
    # last of its 8 blocks, which a token the template adds may push into the suffix).
    trace = read_trace(tmp_path / "trace.jsonl")
    assert len(trace.requests) >= args.prompts
    assert replay(trace, trace.distinct_keys()).hit_blocks >= (args.prompts - 3) * (256 // trace.block_tokens - 1)
    # A fresh server lists every kvoffload series, at 0, before its first request.
    fresh = runs["kvoffload"]["metrics_before"]
    names = {series.partition("{")[0] for series in fresh}
    assert {"vllm:kvoffload_hit_tokens_total", "vllm:kvoffload_failed_load_tokens_total",
            "vllm:kvoffload_transfer_failed_jobs_total", "vllm:kvoffload_host_used_bytes"} <= names
    # Tokens and store counts, per direction, host; and with hints on (the default) three hint outcomes and the
    # host's four retention series (retained bytes, hit, demoted and evicted blocks).
    assert len(fresh) == 8 + 4 * 2 + 1 + 3 + 4 and not any(fresh.values())
    assert {"vllm:kvoffload_retention_hints_total", "vllm:kvoffload_retained_bytes"} <= names
    # kvoffload's lines in the server's log read like vLLM's own: level, time, logger name.
    log = (tmp_path / "kvoffload.log").read_text()
    assert re.search(r"\(\S+ pid=\d+\) INFO \d\d-\d\d [\d:]+ \[kvoffload\.integrations\.vllm\.connector:\d+\] "
                     r"kvoffload scheduler role", log)
    # The connector was named alone (kvoffload's vllm.general_plugins entry point registers it in the server), and
    # the server's /metrics shows blocks moved both ways.
    after = runs["kvoffload"]["metrics_after"]
    for direction in ("device_to_host", "host_to_device"):
        moved = [v for series, v in after.items()
                 if series.startswith("vllm:kvoffload_transfer_bytes_total{") and f'direction="{direction}"' in series]
        assert moved and sum(moved) > 0, direction
    summary = serve.summarize([runs])
    plain, ours = summary["rows"]
    assert plain["completed"] == ours["completed"] == 9 and summary["failed_requests"] == 0
    assert ours["hit_tokens"] > 0 and plain["hit_tokens"] == 0
    assert summary["outputs_equal"] and summary["comparison_trusted"]
