"""``kvoffload bench disk`` runs end to end and reports every figure (tiny sizes: this checks, never times)."""

from __future__ import annotations

import json

import pytest

from kvoffload.tools.cli import main


def test_bench_disk_json_reports_both_directions_baselines_and_rebuild(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "disk", "--block-sizes", "64K", "--total-mib", "1", "--rounds", "1",
                 "--rebuild-blocks", "20", "--no-drop-caches", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["block_bytes"] == 64 * 1024 and row["blocks"] == 16
    for field in ("write_gbps", "raw_write_gbps", "read_gbps", "raw_read_gbps", "checksum_gbps"):
        assert row[field] > 0
    assert report["rebuild_blocks"] == 20 and report["rebuild_seconds"] >= 0
    assert report["page_cache_dropped"] is False


def test_bench_disk_table_says_whether_reads_hit_the_page_cache(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "disk", "--block-sizes", "64K", "--total-mib", "1", "--rounds", "1",
                 "--rebuild-blocks", "0", "--no-drop-caches"]) == 0
    out = capsys.readouterr().out
    assert "page cache NOT dropped" in out and "64K" in out


def test_bench_disk_with_a_tier_secret_reports_sealed_rows_beside_the_plain_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "disk", "--block-sizes", "64K", "--total-mib", "1", "--rounds", "2", "--rebuild-blocks", "0",
            "--no-drop-caches", "--json"]
    assert main(args) == 0
    (plain,) = json.loads(capsys.readouterr().out)["rows"]
    assert plain["sealed_write_gbps"] is None and plain["sealed_write_ratio"] is None  # only when asked for
    assert main([*args, "--tier-secret"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["sealed_write_gbps"] > 0 and row["sealed_read_gbps"] > 0 and row["seal_gbps"] > 0
    assert row["sealed_write_ratio"] == pytest.approx(row["sealed_write_gbps"] / row["write_gbps"])
    assert row["sealed_read_ratio"] == pytest.approx(row["sealed_read_gbps"] / row["read_gbps"])
