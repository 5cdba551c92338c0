"""The dependency rules of docs/architecture.md, checked on the source."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from tests.architecture_rules import (
    cycles,
    foreign_tier_imports,
    imports_into,
    module_graph,
    oversized,
    tier_crossings,
    tier_halves,
)

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
    # tools/ drives vLLM (the demo) and measures against its own code (its offloading manager), importing it inside
    # the tools that need it.
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if "integrations" not in p.parts and "tools" not in p.parts
                 and any(m.split(".")[0] in ("vllm", "sglang") for m in imported_modules(p))]
    assert offenders == []


def imports_torch(*modules: str) -> bool:
    """Whether importing ``modules`` in a fresh interpreter loads torch."""
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_the_scheduler_side_index_imports_no_torch():
    assert not imports_torch("kvoffload.index.slot_index", "kvoffload.index.tiered", "kvoffload.tiers.disk.index",
                             "kvoffload.tiers.remote.index", "kvoffload.tiers.stack", "kvoffload.tiers.disk.spec",
                             "kvoffload.tiers.remote.spec", "kvoffload.tiers.registry", "kvoffload.tiers.host.spec",
                             "kvoffload.tiers.node.spec")
    assert imports_torch("kvoffload.transfer.host_pool")  # the check sees a module that does


def test_trace_replay_imports_no_torch_and_no_engine():
    code = ("import sys, kvoffload.tools.replay, kvoffload.tools.replay.replay_command, "
            "kvoffload.tools.replay.plan_command, kvoffload.tools.replay.plot;"
            "print(sorted(m for m in ('torch', 'vllm', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- the layout's rules (tests/architecture_rules.py), each shown failing once on a tree that breaks it -------

GRAPH = module_graph(SRC)
TOOLS_AND_HELPERS = ("kvoffload.tools", "kvoffload.testing")
CORE = sorted(m for m in GRAPH if not any(m == p or m.startswith(p + ".") for p in TOOLS_AND_HELPERS))
TIER_SCHEDULER, TIER_WORKER = tier_halves(GRAPH, "kvoffload.tiers")
"""Each tier's modules by half, derived from file names: an index and what it reaches, a handler and its I/O."""
SCHEDULER_HALF = ("kvoffload.index", "kvoffload.connector.scheduler", "kvoffload.connector.loads",
                  "kvoffload.connector.stores", "kvoffload.connector.jobs", *sorted(TIER_SCHEDULER))
WORKER_HALF = ("kvoffload.transfer", "kvoffload.connector.worker", *sorted(TIER_WORKER))
LINE_LIMIT = 400
OVER_THE_LIMIT: dict[str, int] = {}
"""Files still over the limit; each may shrink, none may grow, no other may join them (none is left)."""


def test_src_has_no_import_cycle():
    assert cycles(GRAPH) == []


def test_the_core_imports_no_tool_and_no_test_helper():
    assert imports_into({m: GRAPH[m] for m in CORE}, ["kvoffload"], TOOLS_AND_HELPERS) == []
    assert suite_importers(SRC) == []


def suite_importers(root: Path) -> list[str]:
    """Files of ``root`` outside tools/ and testing/ that import this repository's test suite (``tests``)."""
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
            if not str(p.relative_to(root)).startswith(("tools/", "testing/"))
            and any(m == "tests" or m.startswith("tests.") for m in imported_modules(p))]


def test_the_two_halves_never_import_each_other():
    assert imports_into(GRAPH, SCHEDULER_HALF, WORKER_HALF) == []
    assert imports_into(GRAPH, WORKER_HALF, SCHEDULER_HALF) == []
    # the derived halves see every tier's index, probe, handler and I/O
    scheduler = {f"kvoffload.tiers.{m}" for m in ("disk.index", "remote.index", "remote.probe", "object.index",
                                                  "object.probe", "node.index", "lower.probed_index")}
    worker = {f"kvoffload.tiers.{m}" for m in ("disk.handler", "disk.file_io", "remote.handler", "remote.link",
                                               "object.handler", "node.handler", "lower.laned", "lower.handler")}
    assert scheduler <= TIER_SCHEDULER
    assert worker <= TIER_WORKER


def test_no_tier_index_imports_its_handler_nor_the_reverse():
    assert tier_crossings(GRAPH, "kvoffload.tiers") == []
    assert {m.rsplit(".", 1)[0] for m in GRAPH if m.endswith((".index", ".handler"))} >= {
        "kvoffload.tiers.disk", "kvoffload.tiers.remote"}  # the rule sees the tiers


def test_a_tier_imports_no_other_tiers_folder_only_the_shared_one():
    assert foreign_tier_imports(GRAPH, "kvoffload.tiers") == []
    assert {m.split(".")[2] for m in GRAPH if m.count(".") >= 3 and m.startswith("kvoffload.tiers.")} >= {
        "disk", "remote", "object", "node", "lower"}  # the rule sees the folders


def test_no_file_in_src_is_over_the_line_limit():
    over = oversized(SRC, LINE_LIMIT)
    assert set(over) <= set(OVER_THE_LIMIT), f"new files over {LINE_LIMIT} lines: {set(over) - set(OVER_THE_LIMIT)}"
    assert {p: n for p, n in over.items() if n > OVER_THE_LIMIT[p]} == {}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A package that breaks every rule once: a cycle, the core importing a tool, a half importing the other,
    a file over the limit, a tier's index reaching its handler, a tier importing another tier's module (the shared
    folder ``lower`` is allowed)."""
    return write_tree(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def later():\n    import pkg.a\n",  # a cycle, even when hidden in a function
        "core.py": "from pkg.tools import demo\n",
        "tools/__init__.py": "",
        "tools/demo.py": "import pkg.manager\n",
        "manager/__init__.py": "",
        "manager/index.py": "from pkg.transfer.handler import Handler\n",
        "transfer/__init__.py": "",
        "transfer/handler.py": "Handler = object\n",
        "big.py": "x = 1\n" * (LINE_LIMIT + 1),
        "uses_tests.py": "from tests.forgeries import forge\n",
        "tiers/__init__.py": "",
        "tiers/t/__init__.py": "",
        "tiers/t/index.py": "from pkg.tiers.t import names\n",
        "tiers/t/names.py": "def later():\n    import pkg.tiers.t.handler\n",  # through a module of the tier
        "tiers/t/handler.py": "",
        "tiers/t/spec.py": "from pkg.tiers.t import handler, index\n",  # the spec may import both
        "tiers/u/__init__.py": "",
        "tiers/u/index.py": "",
        "tiers/u/handler.py": "from pkg.tiers.u.index import Index\n",
        "tiers/u/borrowed.py": "from pkg.tiers.t.names import later\nfrom pkg.tiers.lower import shared\n",
        "tiers/lower/__init__.py": "",
        "tiers/lower/shared.py": "",
        "tiers/v/__init__.py": "",
        "tiers/v/index.py": "from pkg.tiers.v import names\n",
        "tiers/v/names.py": "",  # both halves reach it: in neither
        "tiers/v/handler.py": "from pkg.tiers.v import io, names\n",
        "tiers/v/io.py": "",
        "manager/uses_io.py": "from pkg.tiers.v.io import read\n",  # the scheduler half reaching a handler's I/O
    })


def test_each_rule_fails_on_a_tree_that_breaks_it(broken: Path):
    graph = module_graph(broken)
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    core = {m: deps for m, deps in graph.items() if not m.startswith("pkg.tools")}
    assert imports_into(core, ["pkg"], ["pkg.tools"]) == [("pkg.core", "pkg.tools.demo")]
    assert imports_into(graph, ["pkg.manager"], ["pkg.transfer"]) == [("pkg.manager.index", "pkg.transfer.handler")]
    assert oversized(broken, LINE_LIMIT) == {"big.py": LINE_LIMIT + 1}
    assert suite_importers(broken) == ["uses_tests.py"]
    assert tier_crossings(graph, "pkg.tiers") == [("pkg.tiers.t.index", "pkg.tiers.t.handler"),
                                                   ("pkg.tiers.u.handler", "pkg.tiers.u.index")]
    assert foreign_tier_imports(graph, "pkg.tiers") == [("pkg.tiers.u.borrowed", "pkg.tiers.t.names")]
    scheduler, worker = tier_halves(graph, "pkg.tiers")
    assert {m for m in scheduler | worker if m.startswith("pkg.tiers.v.")} == {"pkg.tiers.v.index",
                                                                              "pkg.tiers.v.handler", "pkg.tiers.v.io"}
    assert imports_into(graph, ["pkg.manager", *scheduler], worker) == [("pkg.manager.uses_io", "pkg.tiers.v.io")]
