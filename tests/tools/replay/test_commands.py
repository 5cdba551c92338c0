"""``kvoffload replay`` and ``kvoffload plan`` through ``kvoffload.tools.cli.main``: JSON, tables, the PNG, and bad
input answered with a message naming the culprit and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.tools.replay.traces import write_jsonl

from kvoffload.config import EvictionPolicy
from kvoffload.tools.cli import main

PROMPTS = [[0, 1, 2], [0, 1, 3], [4, 5], [0, 1, 2], [4, 6], [0, 1, 3], [7], [0, 1, 2, 8]]


@pytest.fixture
def trace_file(tmp_path: Path) -> str:
    return str(write_jsonl(tmp_path / "trace.jsonl", PROMPTS))


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json", "--workers", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_json_puts_the_bounds_beside_every_policy(trace_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "replay", "--trace", trace_file, "--capacity", "1536", "--model", "llama-3.1-8b")
    results = {r["strategy"]: r for r in doc["results"]}
    assert list(results) == [*(p.value for p in EvictionPolicy), "optimum", "unbounded"]
    assert doc["capacity_tokens"] == 1536 and doc["bytes_per_token"] == 131072
    assert results["optimum"]["fraction_of_optimum"] == 1.0
    assert results["unbounded"]["capacity_blocks"] == 9
    lru = results["lru"]
    assert lru["fraction_of_optimum"] == pytest.approx(lru["token_hit_rate"] / results["optimum"]["token_hit_rate"])
    assert lru["loaded_bytes"] == lru["hit_blocks"] * 512 * 131072


def test_replay_prints_a_table_of_the_chosen_policy(trace_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--trace", trace_file, "--capacity", "1536", "--policy", "lru", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "8 requests, capacity 1,536 tokens" in out
    rows = [line.split()[0] for line in out.splitlines()[3:]]
    assert rows == ["lru", "optimum", "unbounded"]


def test_plan_json_sweeps_every_policy_and_prices_the_hits(trace_file: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "plan", "--trace", trace_file, "--model", "qwen2.5-7b", "--capacities", "1024,2048",
                   "--prefill-tokens-per-s", "1000", "--bandwidth", "host=10")
    assert [p["capacity_tokens"] for p in doc["points"]] == [1024, 2048]
    assert set(doc["points"][0]["results"]) == {*(p.value for p in EvictionPolicy), "optimum"}
    assert doc["unbounded"]["strategy"] == "unbounded"
    cost = doc["costs"][1]
    lru = doc["points"][1]["results"]["lru"]
    assert cost["prefill_saved_s"] == lru["hit_tokens"] / 1000
    assert cost["load_s_host"] == lru["loaded_bytes"] / 10e9
    assert doc["per_hit_token"] == {"load_s_host": 57344 / 10e9, "recompute_s": 1 / 1000}


def test_plan_prints_the_table_and_writes_a_png(trace_file: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["plan", "--trace", trace_file, "--model", "llama-3.1-8b", "--points", "3", "--plot", str(png),
                 "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "lru/opt" in out and "unbounded maximum" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["replay", "--capacity", "lots"], "capacity 'lots'"),
    (["replay", "--capacity", "2GiB"], "is in bytes: give --model"),
    (["replay", "--policy", "mru"], "unknown policy 'mru'"),
    (["replay", "--admission", "never"], "unknown store admission 'never'"),
    (["replay", "--model", "llama-9"], "model 'llama-9' is neither a preset"),
    (["plan", "--model", "llama-9"], "model 'llama-9' is neither a preset"),
    (["plan", "--model", "llama-3.1-8b", "--bandwidth", "tape=1"], "--bandwidth 'tape=1'"),
    (["plan", "--model", "llama-3.1-8b", "--bandwidth", "disk=fast"], "'fast' is not a number"),
    (["plan", "--model", "llama-3.1-8b", "--capacities", "1M,x"], "capacity 'x'"),
])
def test_bad_options_exit_2_naming_the_culprit(trace_file: str, capsys: pytest.CaptureFixture[str],
                                               argv: list[str], message: str) -> None:
    assert main([argv[0], "--trace", trace_file, *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert f"kvoffload {argv[0]}: error: " in err and message in err


def test_a_missing_or_malformed_trace_exits_2_naming_file_and_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\nnot json\n')
    assert main(["plan", "--trace", str(bad), "--model", "llama-3.1-8b"]) == 2
    assert f"{bad}, line 2: not JSON" in capsys.readouterr().err


def test_replay_runs_the_policies_behind_the_admission_rule(trace_file: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "replay", "--trace", trace_file, "--capacity", "1536", "--admission", "second-sighting")
    assert doc["admission"] == "second-sighting"
    admissions = {r["strategy"]: r["admission"] for r in doc["results"]}
    assert admissions == {**{p.value: "second-sighting" for p in EvictionPolicy}, "optimum": "all",
                          "unbounded": "all"}
