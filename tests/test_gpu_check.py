"""scripts/gpu_check.py (``make gpu-check``): without CUDA it says what it needs and fails; it misses no CUDA test."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _script() -> object:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA is told")
def test_without_cuda_it_says_it_needs_a_gpu_fails_and_still_writes_its_report(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2
    needs = "gpu-check needs an NVIDIA GPU and a CUDA build of PyTorch: torch.cuda.is_available() is False"
    assert needs in done.stderr
    report_path = tmp_path / "gpu-check-report.json"
    assert f"report: {report_path}" in done.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is False and report["exit_code"] == 2 and report["steps"] == []
    assert report["torch"] == torch.__version__ and "needs an NVIDIA GPU" in report["problems"][0]


def test_its_cuda_test_files_are_every_file_with_a_cuda_test() -> None:
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.cuda\b", p.read_text()) and p != Path(__file__).resolve()}
    assert set(_script().CUDA_TEST_FILES) == marked  # type: ignore[attr-defined]


def test_make_gpu_check_runs_the_script() -> None:
    done = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "scripts/gpu_check.py" in done.stdout
