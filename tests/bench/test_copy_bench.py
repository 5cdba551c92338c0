"""``kvoffload bench copy`` runs end to end and reports every figure (tiny sizes: this checks, never times)."""

from __future__ import annotations

import json

import pytest

from kvoffload import cli


def test_bench_copy_prints_one_json_row_per_page_size_and_direction(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "copy", "--json", "--runs", "2", "--page-sizes", "4K,8K", "--blocks-per-job", "3"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["page_bytes"], r["direction"]) for r in rows] == [
        (4096, "device_to_host"), (4096, "host_to_device"), (8192, "device_to_host"), (8192, "host_to_device")]
    for row in rows:
        assert set(row) == {"page_bytes", "blocks_per_job", "direction", "gbps", "memcpy_gbps", "ratio", "runs",
                            "spread", "plan_ms", "copy_ms", "plan_share", "copy_share"}
        assert row["blocks_per_job"] == 3 and row["runs"] == 2
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0 and row["ratio"] > 0 and row["spread"] >= 0
        assert row["plan_ms"] > 0 and row["copy_ms"] > 0
        # Planning and copying are parts of the handler's time, neither all of it.
        assert 0 < row["plan_share"] < 1 and 0 < row["copy_share"] < 1


def test_bench_copy_table_shows_the_planning_and_copying_shares(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "copy", "--runs", "1", "--page-sizes", "4K", "--blocks-per-job", "2"]) == 0
    header, store, load, legend = capsys.readouterr().out.splitlines()
    assert header.split() == ["page", "blocks", "direction", "GB/s", "memcpy", "ratio", "spread", "plan", "copy"]
    for line in (store, load):
        plan, copy = line.split()[-2:]
        assert plan.endswith("%") and copy.endswith("%")
    assert "planning" in legend


def test_bench_copy_rejects_a_page_size_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "copy", "--page-sizes", "4M"])
    assert "outside 4K..2M" in capsys.readouterr().err
