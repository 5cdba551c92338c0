"""``kvoffload bench pool`` runs end to end and reports every figure (a small pool: this checks, never times)."""

from __future__ import annotations

import json

import pytest

from kvoffload.tools.cli import main


def test_bench_pool_json_reports_a_cold_and_two_warmed_pools(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pool", "--json", "--pool-mib", "8", "--slot-bytes", "64K", "--runs", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["kind"] for r in rows] == ["cold", "warmed", "warmed_waited"]
    for row in rows:
        assert row["pool_bytes"] == 8 << 20 and row["slot_bytes"] == 64 << 10 and row["runs"] == 2
        assert row["first_gbps"] > 0 and row["warm_gbps"] > 0 and row["ratio"] > 0 and row["spread"] >= 0
        assert row["construct_s"] > 0 and row["bytes_equal"] is True
    cold, warmed, waited = rows
    assert cold["populate_s"] == 0 and not cold["background"]
    # 8 MiB is populated within the constructor's budget: nothing left for a thread.
    assert 0 < warmed["populate_s"] <= warmed["construct_s"] and not warmed["background"]
    assert waited["populate_s"] > 0 and not waited["background"]


def test_bench_pool_table_names_the_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pool", "--pool-mib", "4", "--slot-bytes", "1M", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert all(kind in out for kind in ("cold", "warmed", "warmed_waited", "first GB/s", "construct s"))
