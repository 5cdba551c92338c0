"""The dependency rules of docs/architecture.md, checked on the source."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvoffload"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_integrations_import_an_engine():
    # bench/ measures against vLLM's own code (its offloading manager, the demo), importing it inside the bench.
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if "integrations" not in p.parts and "bench" not in p.parts
                 and any(m.split(".")[0] in ("vllm", "sglang") for m in imported_modules(p))]
    assert offenders == []


def test_the_scheduler_side_index_imports_no_torch():
    code = ("import sys, kvoffload.manager.host, kvoffload.manager.tiered, kvoffload.manager.disk, "
            "kvoffload.manager.remote;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_trace_replay_imports_no_torch_and_no_engine():
    code = ("import sys, kvoffload.replay, kvoffload.replay.replay_command, kvoffload.replay.plan_command, "
            "kvoffload.replay.plot;"
            "print(sorted(m for m in ('torch', 'vllm', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
