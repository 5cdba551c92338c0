"""``kvoffload bench remote`` runs end to end against its own redis-server and reports every figure (tiny sizes:
this checks, never times)."""

from __future__ import annotations

import json

import pytest

from kvoffload.tools.cli import main

pytest.importorskip("redis")


def test_bench_remote_json_reports_both_directions_beside_raw_pipelines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "remote", "--block-sizes", "64K", "--total-mib", "1", "--rounds", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["block_bytes"] == 64 * 1024 and row["blocks"] == 16
    for field in ("store_gbps", "raw_set_gbps", "store_ratio", "load_gbps", "raw_get_gbps", "load_ratio",
                  "raw_set_in_place_gbps", "store_ratio_in_place"):
        assert row[field] > 0
    assert row["store_ratio"] == pytest.approx(row["store_gbps"] / row["raw_set_gbps"])
    assert row["store_ratio_in_place"] == pytest.approx(row["store_gbps"] / row["raw_set_in_place_gbps"])
    assert report["parser"] in ("hiredis", "python")
    assert report["lookup_2048_keys_ms"] > 0


def test_bench_remote_with_a_tier_secret_reports_sealed_rows_beside_the_plain_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "remote", "--block-sizes", "64K", "--total-mib", "1", "--rounds", "2", "--json",
                 "--tier-secret"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["sealed_store_gbps"] > 0 and row["sealed_load_gbps"] > 0
    assert row["sealed_store_ratio"] == pytest.approx(row["sealed_store_gbps"] / row["store_gbps"])
    assert row["sealed_load_ratio"] == pytest.approx(row["sealed_load_gbps"] / row["load_gbps"])
    assert main(["bench", "remote", "--block-sizes", "64K", "--total-mib", "1", "--rounds", "1"]) == 0
    assert "tier secret" not in capsys.readouterr().out  # the sealed table only when asked for
