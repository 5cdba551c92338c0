"""``kvoffload bench peer``: its LMCache set-up (server command, connector config, the import overlay, segment
clean-up, the curated requirements the Makefile installs), its per-side rows and report, and its refusals.

Without LMCache's venv (``make setup-lmcache``) the tests that start LMCache skip, saying so; everything else runs
without it. None of these tests time anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload.tools.bench import peer
from kvoffload.tools.bench.e2e import demo_args
from kvoffload.tools.cli import build_parser, main
from kvoffload.tools.vllm import demo
from kvoffload.tools.vllm.demo_engine import EngineSettings
from kvoffload.tools.vllm.demo_report import Workload
from kvoffload.tools.vllm.peer_lmcache import (
    DEFAULT_VENV,
    VERSION,
    LMCacheServer,
    LMCacheSide,
    build_overlay,
    connector_config,
    kv_bytes_per_token,
    leftover_segments,
    remove_segments,
    server_command,
    venv_problem,
)

ROOT = Path(__file__).resolve().parents[3]
REQUIREMENTS = ROOT / "requirements-lmcache.txt"
LMCACHE_VENV = ROOT / DEFAULT_VENV
needs_lmcache = pytest.mark.skipif(venv_problem(LMCACHE_VENV) is not None,
                                   reason=f"LMCache is not set up: {venv_problem(LMCACHE_VENV)}")


def requirement_lines() -> list[str]:
    return [line.strip() for line in REQUIREMENTS.read_text().splitlines() if line.strip() and line[0] != "#"]


def test_the_requirements_pin_every_package_with_cpu_torch_and_no_cuda_package() -> None:
    lines = requirement_lines()
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line) for line in lines), lines
    names = {line.split("==")[0].lower(): line.split("==")[1] for line in lines}
    assert names["lmcache"] == VERSION
    assert names["torch"].endswith("+cpu")
    assert not [n for n in names if n.startswith(("nvidia", "cupy", "cuda", "cufile"))]


def test_make_setup_lmcache_installs_the_requirements_without_their_dependencies() -> None:
    dry = subprocess.run(["make", "-n", "-B", "setup-lmcache", "PYTHON=python3"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    installs = [line for line in dry.splitlines() if "pip install" in line]
    assert installs and all("--no-deps" in line and "-r requirements-lmcache.txt" in line for line in installs)
    assert "http_server --help" in dry
    assert ".venv-lmcache/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_server_command_listens_on_loopback_in_chunks_of_the_block_size() -> None:
    cmd = server_command(Path("/v/bin/python"), 5555, 5556, 1.5, 32)
    assert cmd[:3] == ["/v/bin/python", "-m", "lmcache.v1.multiprocess.http_server"]
    options = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert options["--host"] == options["--http-host"] == "127.0.0.1"
    assert (options["--port"], options["--http-port"]) == ("5555", "5556")
    assert (options["--chunk-size"], options["--l1-size-gb"]) == ("32", "1.5")
    assert "--disable-metrics" in cmd


def test_the_connector_config_points_vllm_at_the_server_port() -> None:
    config = connector_config(LMCacheSide(port=6123, overlay=Path("/x")))
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_extra_config"]["lmcache.mp.port"] == 6123
    assert config["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://127.0.0.1"


def test_the_overlay_links_lmcache_and_only_modules_this_venv_lacks(tmp_path: Path) -> None:
    site = tmp_path / "site"
    for package in ("lmcache", "torch", "numpy", "nvtx", "pip"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
    (site / "caio.py").write_text("")
    (site / "torch-2.13.0.dist-info").mkdir()
    linked = build_overlay(site, tmp_path / "overlay", have={"torch", "numpy", "lmcache"})
    assert linked == ["caio", "lmcache", "nvtx"]
    assert (tmp_path / "overlay" / "lmcache").resolve() == (site / "lmcache").resolve()
    assert sorted(p.name for p in (tmp_path / "overlay").iterdir()) == ["caio.py", "lmcache", "nvtx"]


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "num_attention_heads": 8,
                                                      "num_key_value_heads": 2, "hidden_size": 512,
                                                      "head_dim": 64}))
    assert kv_bytes_per_token(tmp_path, "float32") == 6 * 2 * 2 * 64 * 4
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 6 * 2 * 2 * 64 * 2


def test_only_segments_of_exited_processes_are_removed(tmp_path: Path) -> None:
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                            text=True, check=True)
    dead, alive = int(exited.stdout), os.getpid()
    for pid in (dead, alive, 1):
        (tmp_path / f"lmcache_kv_{pid}_0").write_bytes(b"x")
    assert list(leftover_segments([dead, alive], tmp_path)) == [tmp_path / f"lmcache_kv_{dead}_0"]
    assert remove_segments([dead, alive], tmp_path) == [tmp_path / f"lmcache_kv_{dead}_0"]
    assert {p.name for p in tmp_path.iterdir()} == {"lmcache_kv_1_0", f"lmcache_kv_{alive}_0"}  # any pid digits


def test_engine_settings_name_the_three_engine_kinds() -> None:
    base: dict[str, Any] = dict(model_dir=Path("/m"), workload=Workload(), dtype="float32", block_size=32,
                                device_blocks=None, host_gib=1.0)
    side = LMCacheSide(port=1, overlay=Path("/o"))
    names = [EngineSettings(with_kvoffload=False, **base).name, EngineSettings(with_kvoffload=True, **base).name,
             EngineSettings(with_kvoffload=False, lmcache=side, **base).name]
    assert names == ["off", "on", "lmc"]


BOUND = {"cpu_bind": "0-1", "omp_threads": 2}


def _summary(hit_tokens: list[int], bytes_loaded: int, bytes_stored: int) -> dict[str, Any]:
    turns = [{"offload_hit_tokens": n} for n in hit_tokens]
    return {"hit_turns": sum(1 for n in hit_tokens if n), "miss_turns": sum(1 for n in hit_tokens if not n),
            "ttft_ratio_hit_turns": 0.5, "ttft_ratio_miss_turns": 1.0, "outputs_match": True,
            "control": {"holds": True}, "turns": turns, "off": {"ttft_median_s": 0.2, **BOUND},
            "on": {"offload_hit_rate": 0.4, "bytes_loaded": bytes_loaded, "bytes_stored": bytes_stored,
                   "ttft_median_s": 0.1, **BOUND}}


def _measured() -> dict[str, Any]:
    return {"on": _summary([0, 64, 96], 1000, 3000), "lmc": _summary([0, 64, 32], 900, 0),
            "server": {"cpu_s": 1.25, "l1_stored_bytes": 2500, "chunk_size": 32, "l1_gib": 1.0,
                       "overlay": ["lmcache"]},
            "settings": {"workload": {}}}


def test_side_rows_take_lmcache_stores_and_cpu_from_its_server_and_give_kvoffload_no_helper() -> None:
    on, lmc = peer.side_rows(0, _measured())
    assert (on["side"], on["tokens_from_tier"], on["bytes_stored"], on["helper_cpu_s"]) == (
        "vLLM + kvoffload", 160, 3000, None)
    assert (lmc["side"], lmc["tokens_from_tier"], lmc["bytes_loaded"], lmc["bytes_stored"], lmc["helper_cpu_s"]) == (
        "vLLM + LMCache", 96, 900, 2500, 1.25)
    assert (lmc["hit_turns"], lmc["miss_turns"], lmc["outputs_match"]) == (2, 1, True)


def test_side_rows_record_the_binding_of_the_side_and_of_plain_vllm() -> None:
    for row in peer.side_rows(0, _measured()):
        assert (row["cpu_bind"], row["omp_threads"], row["plain_cpu_bind"], row["plain_omp_threads"]) == (
            "0-1", 2, "0-1", 2)


def test_the_cpu_bind_flag_reaches_the_demo_s_options(tmp_path: Path) -> None:
    assert demo_args(demo, "--turns 2", tmp_path, "1").cpu_bind == "1"
    assert demo_args(demo, "--cpu-bind 0", tmp_path).cpu_bind == "0"
    assert build_parser().parse_args(["bench", "peer", "--cpu-bind", "0-1"]).cpu_bind == "0-1"


def test_the_report_has_a_row_per_side_and_states_the_chunk_size_and_capacity() -> None:
    args = build_parser().parse_args(["bench", "peer", "--demo-args", "--turns 2"])
    measured = _measured()
    measured["on"]["turns"] = measured["lmc"]["turns"] = []
    report = peer.report(peer.side_rows(0, _measured()), measured, args)
    lines = report.table.splitlines()
    assert len(lines) == 4 and "vLLM + kvoffload" in lines[2] and "vLLM + LMCache" in lines[3]
    assert any("--chunk-size 32 = vLLM block size" in note and "1.0 GiB" in note for note in report.notes)
    assert report.settings["demo_args"] == "--turns 2"


def test_without_the_lmcache_venv_the_bench_says_so_and_exits_2(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "peer", "--lmcache-venv", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "not available" in err and ("make setup-lmcache" in err or "vllm" in err.lower())


@needs_lmcache
def test_the_lmcache_server_starts_healthy_with_the_chunk_size_and_stops(tmp_path: Path) -> None:
    with LMCacheServer(LMCACHE_VENV, 0.25, 32, tmp_path / "server.log") as server:
        status = server.status()
        assert status["is_healthy"] and status["chunk_size"] == 32
        assert server.l1_used_bytes() == 0
        assert server.cpu_seconds() > 0
        process = server.process
    assert process is not None and process.poll() is not None


@needs_lmcache
@pytest.mark.e2e
def test_bench_peer_serves_hits_from_both_tiers_with_plain_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    small = ("--conversations 2 --turns 2 --first-user-tokens 512 --user-tokens 32 --reply-tokens 16 "
             "--hidden-size 128 --layers 2 --heads 4 --kv-heads 2 --head-dim 32")
    assert main(["bench", "peer", "--quiet", "--json", "--demo-args", small]) == 0
    report = json.loads(capsys.readouterr().out)
    on, lmc = report["rows"]
    for row in (on, lmc):
        assert row["hit_turns"] == 2 and row["tokens_from_tier"] > 0
        assert row["outputs_match"] is True
    assert lmc["tokens_from_tier"] == on["tokens_from_tier"]  # equal granularity: the same whole blocks
    assert lmc["bytes_stored"] > 0 and lmc["helper_cpu_s"] > 0
    assert "lmcache" in report["settings"]["lmcache_overlay_modules"]
