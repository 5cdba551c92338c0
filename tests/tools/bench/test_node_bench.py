"""``kvoffload bench node`` runs end to end with real engine processes and reports every figure (tiny sizes:
this checks, never times)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.tools.cli import main


def test_bench_node_json_reports_loads_lookup_and_engines(node_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "node", "--block-sizes", "64K", "--total-mib", "1", "--runs", "1", "--engines", "2",
                 "--lookup-keys", "64", "--node-path", str(node_path), "--json"])
    assert code == 0
    load, lookup, engines = json.loads(capsys.readouterr().out)["rows"]
    assert load["block_bytes"] == 64 * 1024 and load["blocks"] == 16 and load["bytes_equal"] is True
    assert load["node_load_gbps"] > 0 and load["private_load_gbps"] > 0 and load["ratio"] > 0
    assert lookup["keys"] == 64 and lookup["node_us"] > 0 and lookup["private_us"] > 0
    assert engines["engines"] == 2 and engines["node_load_gbps"] > 0 and engines["private_store_gbps"] > 0
    assert list(node_path.iterdir()) == []  # the bench's pools are removed
