"""scripts/gpu_check.py (``make gpu-check``): without CUDA it says what it needs and fails; it misses no CUDA test."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of one module ``name`` (what ``make gpu-wheels`` downloads, in miniature)."""
    import base64
    import hashlib
    import zipfile

    files = {f"{name}.py": b"VALUE = 42\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                           b"Tag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{name}-1.0.dist-info/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in {**files, f"{name}-1.0.dist-info/RECORD": record.encode()}.items():
            wheel.writestr(member, data)
    return path


@pytest.mark.parametrize("with_pip", [True, False])
def test_test_modules_missing_here_come_from_the_wheels_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               with_pip: bool) -> None:
    script: Any = _script()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "kvoffload_gpu_check_probe")
    if not with_pip:  # a Python without pip: the wheel goes on the path as it is (pure-Python wheels import from zip)
        real = script.importlib.util.find_spec
        monkeypatch.setattr(script.importlib.util, "find_spec", lambda m: None if m == "pip" else real(m))
    check = script.Check(tmp_path / "out")
    assert script._test_modules(check, wheels, ("kvoffload_gpu_check_probe",))
    assert [s["name"] for s in check.report["steps"]] == (["test modules"] if with_pip else []) + [
        "test modules import"]
    assert all(s["ok"] for s in check.report["steps"]) and check.report["problems"] == []
    done = subprocess.run([sys.executable, "-c", "import kvoffload_gpu_check_probe as p; print(p.VALUE)"],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(check.paths)}, capture_output=True,
                          text=True, check=False)
    assert done.stdout.strip() == "42"


def test_without_the_test_modules_or_their_wheels_the_tests_are_not_run_and_it_says_why(tmp_path: Path) -> None:
    script: Any = _script()
    check = script.Check(tmp_path / "out")
    assert not script._test_modules(check, tmp_path / "no-wheels", ("kvoffload_gpu_check_probe",))
    assert "tests not run: kvoffload_gpu_check_probe missing" in check.report["problems"][0]
    assert "make gpu-wheels" in check.report["problems"][0]
    # A wheel that does not give the module is caught by the import step, not trusted.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "some_other_module")
    check = script.Check(tmp_path / "out2")
    assert not script._test_modules(check, wheels, ("kvoffload_gpu_check_probe",))
    assert "not importable from the wheels" in check.report["problems"][-1]
