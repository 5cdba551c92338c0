"""``make gpu-check``: kvoffload's CUDA copy path checked and measured on a GPU machine, in one command.

Run with the Python that has a CUDA build of PyTorch (not the CPU venv of ``make setup``); it fetches nothing:

1. CUDA: ``torch.cuda.is_available()`` must be True, else it says what it needs and exits 2.
2. Prerequisites: setuptools and numpy importable, a C compiler and Python's headers; what is missing is named,
   exit 3. pytest and hypothesis, for the tests, come from the machine's Python or else from the wheels that
   ``make gpu-wheels`` downloaded into ``build/gpu-wheels`` beforehand (carry that folder to the GPU machine);
   without either the tests are not run (a failure of the check), but the bench still is.
3. Build: the C extensions in place (``build_ext --inplace``), so ``src/`` is importable as it stands; the
   machine's Python environment is left as it was.
4. Tests: every test marked ``cuda`` in ``CUDA_TEST_FILES``, with ``-rs``; a skip there is a failure.
5. Bench: ``kvoffload bench copy --device cuda --json`` over 4 KiB..2 MiB pages, one layer and eight.
6. One JSON report (``docs/gpu.md`` explains its fields) in ``$OUT`` when set, else ``build/gpu-check/``; its
   path is printed last. Exit 0 only when every step passed within ``BUDGET_SECONDS``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 480
CUDA_TEST_FILES = (
    "tests/transfer/test_cuda_copy.py",
    "tests/transfer/test_host_copier.py",
    "tests/testing/test_conformance.py",
    "tests/test_layout.py",
    "tests/tools/bench/test_copy_bench.py",
)
"""Every test file with a ``pytest.mark.cuda`` test (tests/test_gpu_check.py keeps this list complete)."""
PAGE_SIZES = "4K,16K,64K,256K,2M"
BENCH_LAYERS = (1, 8)
NO_CUDA = ("gpu-check needs an NVIDIA GPU and a CUDA build of PyTorch: {detail}. Run it on a GPU machine with "
           "that machine's Python: make gpu-check GPU_PYTHON=/path/to/python")
BUILD_MODULES = ("setuptools", "numpy")
TEST_MODULES = ("pytest", "hypothesis")
WHEELS = ROOT / "build" / "gpu-wheels"
"""Pure-Python wheels of the test modules and their dependencies (``make gpu-wheels``), for a machine without them."""


class Check:
    """The report being filled in, and the deadline every step's timeout is cut to."""

    def __init__(self, out_dir: Path) -> None:
        self.start = time.monotonic()
        self.out_dir = out_dir
        self.paths = [str(ROOT / "src")]
        """What every step has on its PYTHONPATH: this tree's src/, then the test modules when they came from wheels."""
        self.report: dict[str, Any] = {"ok": False, "python": sys.executable,
                                       "python_version": platform.python_version(),
                                       "budget_seconds": BUDGET_SECONDS, "steps": [], "problems": []}

    def left(self) -> float:
        return BUDGET_SECONDS - (time.monotonic() - self.start)

    def step(self, name: str, command: list[str], timeout: float) -> subprocess.CompletedProcess[str] | None:
        """Run ``command`` in the repository with ``src`` importable; record it; None when it timed out."""
        timeout = max(1.0, min(timeout, self.left() - 5))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*self.paths, os.environ.get("PYTHONPATH", "")]),
               "PIP_NO_INDEX": "1"}
        began = time.monotonic()
        print(f"gpu-check: {name}: {' '.join(command)}", flush=True)
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except subprocess.TimeoutExpired as e:
            output = _text(e.stdout) + _text(e.stderr)
            self._record(name, command, None, time.monotonic() - began, output)
            self.problem(f"{name}: did not finish within {timeout:.0f} s")
            return None
        self._record(name, command, done.returncode, time.monotonic() - began, done.stdout + done.stderr)
        if done.returncode != 0:
            self.problem(f"{name}: exit code {done.returncode}")
        return done

    def _record(self, name: str, command: list[str], rc: int | None, seconds: float, output: str) -> None:
        self.report["steps"].append({"name": name, "command": command, "rc": rc, "ok": rc == 0,
                                     "seconds": round(seconds, 2), "output_tail": output[-4000:]})
        print(output[-4000:], end="" if output.endswith("\n") else "\n", flush=True)

    def problem(self, text: str) -> None:
        self.report["problems"].append(text)
        print(f"gpu-check: {text}", file=sys.stderr, flush=True)

    def finish(self, code: int) -> int:
        wall = time.monotonic() - self.start
        self.report["wall_seconds"] = round(wall, 1)
        if code == 0 and wall > BUDGET_SECONDS:
            self.problem(f"took {wall:.0f} s, over the {BUDGET_SECONDS} s budget")
            code = 1
        self.report["ok"] = code == 0
        self.report["exit_code"] = code
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "gpu-check-report.json"
        path.write_text(json.dumps(self.report, indent=1) + "\n")
        verdict = "ok" if code == 0 else f"FAILED ({'; '.join(self.report['problems'])})"
        print(f"gpu-check: {verdict}; report: {path}", flush=True)
        return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="directory of the report (default: $OUT when set, else build/gpu-check)")
    args = parser.parse_args(argv)
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "build" / "gpu-check")
    check = Check(out_dir)
    if not _cuda(check):
        return check.finish(2)
    missing = _missing_prerequisites()
    if missing:
        check.problem("missing on this machine (gpu-check installs nothing): " + ", ".join(missing))
        return check.finish(3)
    if not _build(check):
        return check.finish(1)
    tests_ok = _test_modules(check, WHEELS) and _tests(check)
    bench_ok = _bench(check)
    return check.finish(0 if tests_ok and bench_ok else 1)


def _cuda(check: Check) -> bool:
    try:
        import torch
    except ImportError as e:
        check.problem(NO_CUDA.format(detail=f"PyTorch is not importable by {sys.executable}: {e}"))
        return False
    check.report.update(torch=torch.__version__, cuda=torch.version.cuda)
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        check.problem(NO_CUDA.format(detail=f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"))
        return False
    props = torch.cuda.get_device_properties(0)
    check.report.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                        capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1),
                        driver=_driver_version(), commit=_commit())
    print(f"gpu-check: {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"driver {check.report['driver']}", flush=True)
    return True


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, check=False, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.splitlines()[0].strip()
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"CUDA driver API {version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        pass
    return None


def _commit() -> str | None:
    git = shutil.which("git")
    if not git:
        return None
    done = subprocess.run([git, "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def _missing_prerequisites() -> list[str]:
    missing = [f"the Python module {m} (pip install {m})" for m in BUILD_MODULES
               if importlib.util.find_spec(m) is None]
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler):
        missing.append(f"a C compiler ({compiler}, for the C extensions)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        missing.append(f"Python's C headers ({include}/Python.h: the python3-dev package)")
    return missing


def _build(check: Check) -> bool:
    build = [sys.executable, "-c", "from setuptools import setup; setup()", "build_ext", "--inplace",
             "--build-temp", str(check.out_dir / "build-temp")]
    if not _passed(check.step("build", build, 180)):
        return False
    where = check.step("import", [sys.executable, "-c", "import kvoffload, kvoffload._blockplan, "
                                  "kvoffload._blockcopy, kvoffload._stepscan; print(kvoffload.__file__)"], 60)
    if not _passed(where):
        return False
    assert where is not None
    if not where.stdout.strip().startswith(str(ROOT / "src")):
        check.problem(f"import: kvoffload came from {where.stdout.strip()}, not this working tree's src/")
        return False
    return True


def _test_modules(check: Check, wheels: Path, modules: tuple[str, ...] = TEST_MODULES) -> bool:
    """Whether the steps can import ``modules``: from this Python, or else from the wheels in ``wheels``, installed
    offline into the report's folder (or, without pip, put on the path as they are: pure-Python wheels import
    from their zip files)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return True
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        check.problem(f"tests not run: {', '.join(missing)} missing from {sys.executable} and no wheels in {wheels} "
                      "(run `make gpu-wheels` on a machine with a package index, then bring that folder along)")
        return False
    site = check.out_dir / "test-site"
    if importlib.util.find_spec("pip") is not None:
        installed = check.step("test modules", [sys.executable, "-m", "pip", "install", "-q", "--no-index",
                                                "--no-deps", "--target", str(site), *map(str, found)], 120)
        if _passed(installed):
            check.paths.append(str(site))
    if str(site) not in check.paths:
        check.paths += map(str, found)
    imported = check.step("test modules import", [sys.executable, "-c", f"import {', '.join(modules)}"], 60)
    if not _passed(imported):
        check.problem(f"tests not run: {', '.join(missing)} not importable from the wheels in {wheels}")
        return False
    return True


def _tests(check: Check) -> bool:
    junit = check.out_dir / "cuda-tests.xml"
    done = check.step("cuda tests", [sys.executable, "-m", "pytest", "-m", "cuda", "-rs", "-q", "-p",
                                     "no:cacheprovider", f"--junitxml={junit}", *CUDA_TEST_FILES], 300)
    if done is None or not junit.exists():
        check.report["tests"] = None
        return False
    counts = _junit_counts(junit)
    check.report["tests"] = counts
    if counts["skipped"]:
        first = "; ".join(counts["skipped_tests"][:3])
        check.problem(f"cuda tests: {counts['skipped']} skipped on a CUDA machine (tests.skipped_tests): {first}")
    if counts["total"] == 0:
        check.problem("cuda tests: none ran")
    return _passed(done) and counts["skipped"] == 0 and counts["total"] > 0


def _junit_counts(path: Path) -> dict[str, Any]:
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "total": 0,
                              "failed_tests": [], "skipped_tests": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        counts["total"] += 1
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failed_tests"].append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            counts["failed_tests"].append(name)
        elif (skipped := case.find("skipped")) is not None:
            counts["skipped"] += 1
            counts["skipped_tests"].append(f"{name}: {skipped.get('message')}")
        else:
            counts["passed"] += 1
    return counts


def _bench(check: Check) -> bool:
    check.report["bench"] = []
    ok = True
    for layers in BENCH_LAYERS:
        done = check.step(f"bench copy, {layers} layer(s)", [
            sys.executable, "-m", "kvoffload.tools.cli", "bench", "copy", "--device", "cuda", "--json",
            "--page-sizes", PAGE_SIZES, "--layers", str(layers)], 150)
        if not _passed(done):
            ok = False
            continue
        assert done is not None
        try:
            check.report["bench"] += json.loads(done.stdout)
        except json.JSONDecodeError as e:
            check.problem(f"bench copy: output is not JSON: {e}")
            ok = False
    return ok


def _passed(done: subprocess.CompletedProcess[str] | None) -> bool:
    return done is not None and done.returncode == 0


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


if __name__ == "__main__":
    sys.exit(main())
