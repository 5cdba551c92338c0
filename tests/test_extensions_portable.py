"""The C extensions run on any x86_64 CPU: built for the baseline ISA, no AVX or AVX-512 code.

A wheel built on an AVX-512 machine with ``-march=native`` would die with SIGILL on an AVX2-only CPU (many AMD
EPYCs), so the build flags name no ``-march``/``-m<isa>``, and each built extension's machine code uses no ymm or
zmm register. The check is shown to catch a wrong build: a loop compiled with ``-mavx512f`` is flagged.
"""

from __future__ import annotations

import importlib
import platform
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = ("kvoffload._blockcopy", "kvoffload._blockplan", "kvoffload._stepscan", "kvoffload._nodeindex",
              "kvoffload._mapguard")
WIDE_REGISTER = re.compile(r"%[yz]mm\d+")

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="checks x86_64 machine code; other architectures build their own baseline")


def wide_instructions(shared_object: Path) -> list[str]:
    """The instructions of a shared object that use an AVX (ymm) or AVX-512 (zmm) register."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(shared_object)], capture_output=True,
                             text=True, check=True).stdout
    return [line.strip() for line in listing.splitlines() if WIDE_REGISTER.search(line)]


def test_the_build_flags_name_no_target_isa() -> None:
    flag_lines = [line for line in (ROOT / "pyproject.toml").read_text().splitlines()
                  if line.startswith(("extra-compile-args", "extra-link-args"))]
    assert len(flag_lines) >= len(EXTENSIONS)
    for line in flag_lines:
        assert not re.search(r"-march|-mtune=native|-mavx|-msse4|-mfma", line), line


@pytest.mark.parametrize("name", EXTENSIONS)
def test_each_built_extension_uses_only_baseline_registers(name: str) -> None:
    path = Path(importlib.import_module(name).__file__ or "")
    assert path.suffix == ".so", f"{name} is not the built C extension: {path}"
    assert wide_instructions(path) == []


def test_the_check_flags_avx512_code(tmp_path: Path) -> None:
    source = tmp_path / "wide.c"
    source.write_text("void scale(float *x, int n) { for (int i = 0; i < n; i++) x[i] *= 3.0f; }\n")
    built = tmp_path / "wide.so"
    subprocess.run(["cc", "-O3", "-mavx512f", "-mprefer-vector-width=512", "-shared", "-fPIC", "-o", str(built),
                    str(source)], check=True)
    assert any("zmm" in line for line in wide_instructions(built))
