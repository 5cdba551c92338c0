"""``kvoffload bench copy`` runs end to end and reports every figure (tiny sizes: this checks, never times)."""

from __future__ import annotations

import json

import pytest
import torch

from kvoffload.tools import cli
from kvoffload.tools.bench import copy as copy_bench


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


def test_bench_copy_with_layers_moves_every_layer_of_each_block(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "copy", "--json", "--runs", "1", "--page-sizes", "4K", "--layers", "3", "--device", "cpu"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    # 32 MiB worth of blocks of 3 x 4 KiB; CPU rows keep their fields.
    assert [r["blocks_per_job"] for r in rows] == [32 * 1024 // 12] * 2
    assert all("path" not in r for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_bench_copy_on_cuda_without_cuda_says_it_needs_a_cuda_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "copy", "--device", "cuda", "--json"]) == 2
    captured = capsys.readouterr()
    assert "needs a CUDA device: torch.cuda.is_available() is False" in captured.err and captured.out == ""


@pytest.mark.parametrize(("page", "layers", "batched"), [(4096, 8, True), (4096, 1, True), (2 << 20, 2, False)])
def test_bench_copy_names_the_path_the_cuda_copier_takes(page: int, layers: int, batched: bool) -> None:
    # Slots are a permutation of the whole pool: one pool run however the blocks are scattered.
    assert copy_bench._batched(page, 64, True, layers) is batched


def test_bench_copy_table_of_cuda_rows_shows_the_path_and_the_per_copy_figures() -> None:
    row = copy_bench.CudaRow(4096, 8, "device_to_host", 10.0, 20.0, 0.5, 3, 0.1, 0.01, 0.2, 0.05, 0.9,
                             device="cuda", layers=8, path="batched", per_copy_gbps=2.0, per_copy_ratio=0.1)
    header, line, legend = copy_bench._table([row]).splitlines()
    assert header.split()[-3:] == ["path", "per-copy", "ratio"]
    assert line.split()[-3:] == ["batched", "2.00", "0.10"]
    assert "batching off" in legend


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_copy_on_cuda_reports_both_paths_beside_a_pinned_copy(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "copy", "--device", "cuda", "--json", "--runs", "2", "--page-sizes", "4K,2M", "--layers", "2"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["page_bytes"], r["direction"], r["path"]) for r in rows] == [
        (4096, "device_to_host", "batched"), (4096, "host_to_device", "batched"),
        (2 << 20, "device_to_host", "per_copy"), (2 << 20, "host_to_device", "per_copy")]
    for row in rows:
        assert row["device"] == "cuda" and row["layers"] == 2
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0 and row["per_copy_gbps"] > 0 and row["per_copy_ratio"] > 0
