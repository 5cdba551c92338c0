"""The vLLM API check: the table is right for the installed vLLM, covers every vLLM import of the adapter and of the
bench that compares it with vLLM, matches the connector's own overrides, and the check reports drift in an altered
source: a changed name or signature, a name moved to another module (naming it), hooks called in another order."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest

from kvoffload.tools.vllm import api_check, api_surface
from kvoffload.tools.vllm.api_check import VllmSource, check, format_report
from kvoffload.tools.vllm.api_surface import AVOIDED, SURFACE, CallOrder, ClassUse, ModuleUse, Use

TOOLS = Path(api_surface.__file__).parent  # the demo and its helpers, beside the checker
ADAPTER = TOOLS.parents[1] / "integrations" / "vllm"
BENCH = TOOLS.parent / "bench" / "overhead_vllm.py"
MIXIN = "vllm/v1/worker/kv_connector_model_runner_mixin.py"  # Model Runner V1, up to 0.33
V2_CONNECTOR = "vllm/v1/worker/gpu/kv_connector.py"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
OUTPUT = "vllm/v1/core/sched/output.py"
SPECS = "vllm/v1/kv_cache_interface.py"
EVENTS = "vllm/distributed/kv_events.py"
UTILS = "vllm/v1/core/kv_cache_utils.py"
PLANNING = "vllm/v1/core/kv_cache_planning.py"  # vLLM 0.33 on
CONFIG = "vllm/config/vllm.py"


@pytest.fixture(scope="module")
def root() -> Path:
    try:
        return api_check.installed_vllm_root()
    except FileNotFoundError:
        pytest.skip("vllm is not installed")


def altered(root: Path, path: str, old: str, new: str) -> VllmSource:
    text = (root / path).read_text()
    assert old in text, f"{old!r} is not in {path}: the installed vLLM changed, update this test"
    return VllmSource.open(root, {path: text.replace(old, new)})


def test_the_installed_vllm_matches_the_table(root: Path) -> None:
    source = VllmSource.open(root)

    drifts = check(source)

    assert drifts == [], format_report(source, drifts)
    assert "matches the API the adapter uses" in format_report(source, drifts)


def test_a_wheel_is_read_like_a_directory(root: Path, tmp_path: Path) -> None:
    read: list[str] = []
    directory = VllmSource.open(root)
    recording = VllmSource(lambda name: read.append(name) or directory._read(name), "recording")
    check(recording)
    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        for name in read:
            text = directory._read(name)
            if text is not None:
                out.writestr(name, text)

    source = VllmSource.open(wheel)

    assert source.version == directory.version
    assert check(source) == []


DRIFTS = {
    "renamed hook": (BASE, "def get_num_new_matched_tokens(", "def get_num_matched_tokens(",
                     "get_num_new_matched_tokens: missing (the adapter overrides it)"),
    "hook gains a parameter": (BASE, "def request_finished(\n        self,\n        request",
                               "def request_finished(\n        self,\n        reason,\n        request",
                               "request_finished: signature differs"),
    "new abstract hook": (BASE, "    @abstractmethod\n    def wait_for_save(self):",
                          "    @abstractmethod\n    def wait_for_everything(self): ...\n\n"
                          "    @abstractmethod\n    def wait_for_save(self):",
                          "wait_for_everything: abstract in vLLM and not implemented by the connector"),
    "new hook with a default": (BASE, "    @abstractmethod\n    def wait_for_save(self):",
                                "    def on_sleep(self):\n        return\n\n    @abstractmethod\n"
                                "    def wait_for_save(self):",
                                "on_sleep: new in vLLM and not in the table"),
    "renamed scheduler-output field": (OUTPUT, "    scheduled_cached_reqs: CachedRequestData",
                                       "    scheduled_running_reqs: CachedRequestData",
                                       "scheduled_cached_reqs: missing (the adapter reads it)"),
    "renamed new-request field": (OUTPUT, "    num_computed_tokens: int\n    lora_request",
                                  "    num_cached_tokens: int\n    lora_request",
                                  "vllm.v1.core.sched.output.NewRequestData\n    num_computed_tokens: missing"),
    "renamed spec field": (SPECS, "    num_kv_heads: int", "    num_kv_head_count: int",
                           "vllm.v1.kv_cache_interface.AttentionSpec\n    num_kv_heads: missing"),
    "new required event field": (EVENTS, "    lora_name: str | None", "    lora_name: str | None\n    tier_index: int",
                                 "tier_index: a required field the adapter does not pass"),
    "renamed function parameter": (UTILS, "def resolve_kv_cache_block_sizes(\n    kv_cache_config: KVCacheConfig,",
                                   "def resolve_kv_cache_block_sizes(\n    kv_cache_cfg: KVCacheConfig,",
                                   "resolve_kv_cache_block_sizes: signature no longer takes the adapter's call"),
    "renamed class": (SPECS, "class MambaSpec(", "class MambaStateSpec(",
                      "vllm.v1.kv_cache_interface\n    MambaSpec: name not defined"),
    "wait_for_save after the reports": (
        MIXIN, "            if not defer_finalize:\n                kv_connector.wait_for_save()\n",
        "", "KVConnectorModelRunnerMixin._get_kv_connector_output\n    (hook calls): calls the connector in another "
        "order than the adapter was tested with"),
    "a new hook call": (MIXIN, "            output.kv_connector_stats = kv_connector.get_kv_connector_stats()",
                        "            kv_connector.reset_cache()\n"
                        "            output.kv_connector_stats = kv_connector.get_kv_connector_stats()",
                        "get_block_ids_with_load_errors, reset_cache, get_kv_connector_stats"),
    "Model Runner V2's wait_for_save gone": (
        V2_CONNECTOR, "self.kv_connector.wait_for_save()", "pass",
        "ActiveKVConnector.post_forward\n    (hook calls): calls the connector in another order than the adapter was "
        "tested with"),
    "a new hook call in Model Runner V2": (
        V2_CONNECTOR, "        output.kv_connector_stats = self.kv_connector.get_kv_connector_stats()",
        "        self.kv_connector.reset_cache()\n"
        "        output.kv_connector_stats = self.kv_connector.get_kv_connector_stats()",
        "get_block_ids_with_load_errors, reset_cache, get_kv_connector_stats"),
}
"""Each alteration of the installed vLLM's source and what the report must then say (the V1 runner's cases are
skipped from 0.34, which removed it; Model Runner V2's run on every release)."""


@pytest.mark.parametrize("case", DRIFTS, ids=list(DRIFTS))
def test_drift_in_an_altered_source_is_reported(root: Path, case: str) -> None:
    path, old, new, expected = DRIFTS[case]
    if not (root / path).exists():
        pytest.skip(f"this vLLM has no {path}")
    source = altered(root, path, old, new)

    drifts = check(source)
    report = format_report(source, drifts)

    assert drifts, f"{case}: no drift reported"
    assert expected in report, report


def test_a_changed_signature_is_shown_as_both_lines(root: Path) -> None:
    path, old, new, _ = DRIFTS["hook gains a parameter"]

    report = format_report(source := altered(root, path, old, new), check(source))

    assert "      - adapter: request_finished(self, request, block_ids)" in report
    assert "      + vLLM:    request_finished(self, reason, request, block_ids)" in report


def test_a_called_function_may_gain_a_parameter_with_a_default(root: Path) -> None:
    source = altered(root, UTILS, "    vllm_config: VllmConfig,\n) -> tuple[int, int]:",
                     "    vllm_config: VllmConfig,\n    strict: bool = False,\n) -> tuple[int, int]:")

    assert check(source) == []


def test_a_member_newer_than_the_source_may_be_missing(root: Path) -> None:
    newer = ClassUse(api_surface._BASE, "KVConnectorBase_V1", members=api_surface.uses(
        Use.OVERRIDE, "@classmethod supports_wormholes(cls) [since 99.0]", "@classmethod supports_tunnels(cls)"))

    drifts = check(VllmSource.open(root), (newer,))

    assert [d.member for d in drifts] == ["supports_tunnels"]


def test_a_member_older_than_the_source_may_be_missing(root: Path) -> None:
    older = ModuleUse("vllm.v1.core.kv_cache_utils", functions=api_surface.uses(
        Use.CALL, "plan_kv_caches(vllm_config) [until 0.1]", "plan_kv_cache_groups(vllm_config)"))

    drifts = check(VllmSource.open(root), (older,), ())

    assert [d.member for d in drifts] == ["plan_kv_cache_groups"]


def test_a_moved_function_is_reported_with_where_vllm_defines_it_now(root: Path) -> None:
    # The planner lives in kv_cache_utils up to 0.32 and in kv_cache_planning from 0.33: move it from there.
    [(path, text)] = [(p, (root / p).read_text()) for p in (UTILS, PLANNING)
                      if (root / p).exists() and "\ndef get_kv_cache_configs(" in (root / p).read_text()]
    source = VllmSource.open(root, {
        path: text.replace("\ndef get_kv_cache_configs(", "\ndef _planned_elsewhere("),
        "vllm/v1/core/kv_cache_planner.py": "def get_kv_cache_configs(vllm_config, specs, memory, groups): ...\n"})
    module = path.removesuffix(".py").replace("/", ".")
    bench_use = ModuleUse(module, functions=api_surface.uses(
        Use.CALL, "get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory)"))

    report = format_report(source, check(source, (bench_use,), ()))

    assert ("get_kv_cache_configs: function not defined; moved? vLLM defines it in vllm.v1.core.kv_cache_planner"
            in report), report


def test_a_call_order_newer_than_the_source_is_not_required(root: Path) -> None:
    newer = CallOrder(api_surface._V2_CONNECTOR, "ActiveKVConnector.finish_everything", ("wait_for_save",), "test",
                      since=(99, 0))
    missing = CallOrder(api_surface._V2_CONNECTOR, "ActiveKVConnector.finish_everything", ("wait_for_save",), "test")

    assert check(VllmSource.open(root), (), (newer,)) == []
    assert [d.problem for d in check(VllmSource.open(root), (), (missing,))] == [
        "function not found (the adapter was tested with the hooks it calls)"]


def test_a_vllm_that_stops_asking_about_sleep_mode_is_drift(root: Path) -> None:
    # Read as 0.33, which must ask: 0.31 and 0.32 never do, and from 0.33 on the question is taken out.
    config = (root / CONFIG).read_text()
    source = VllmSource.open(root, {"vllm/_version.py": "__version__ = version = '0.33.0'\n",
                                    CONFIG: config.replace(".supports_sleep_mode(", ".supports_nothing(")})
    [asks] = [o for o in api_surface.CALL_ORDERS if o.calls == ("supports_sleep_mode",)]

    [drift] = check(source, (), (asks,))

    assert drift.where == "vllm.config.vllm.VllmConfig._verify_kv_transfer_compat"
    assert (drift.expected, drift.found) == ("supports_sleep_mode", "")


def test_the_command_exits_1_on_drift_and_0_without(root: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert api_check.main([str(root)]) == 0
    assert "matches" in capsys.readouterr().out

    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr("vllm/_version.py", "__version__ = version = '0.32.0'\n")
    assert api_check.main([str(wheel)]) == 1
    assert "module not found" in capsys.readouterr().out


# ---- the table against the adapter's own source ------------------------------------------------------------


def adapter_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` in the adapter, the vLLM tools (the demo) and the bench
    comparing it with vLLM, and every ``alias.attr`` used through a module alias (``from vllm.v1 import
    kv_cache_interface as vkv`` then ``vkv.MambaSpec``)."""
    found: set[tuple[str, str]] = set()
    for path in [*ADAPTER.glob("*.py"), *TOOLS.glob("*.py"), BENCH]:
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    found.add((node.module, alias.name))
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                found.add((aliases[node.value.id], node.attr))
    return found


def test_every_vllm_import_of_the_adapter_is_in_the_table() -> None:
    declared = {(u.module, n) for u in SURFACE if isinstance(u, ModuleUse)
                for n in (*u.names, *(m.name for m in u.functions))}
    declared |= {(f"{u.module}.{u.name}", m.name) for u in SURFACE if isinstance(u, ClassUse) for m in u.members}

    assert adapter_imports() - declared == set()


def test_the_adapter_imports_none_of_the_vllm_names_it_avoids() -> None:
    assert adapter_imports() & set(AVOIDED) == set()


def own_methods(path: Path, class_name: str) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.name: api_check.signature(n) for n in cls.body if isinstance(n, ast.FunctionDef)}


def overrides(use: ClassUse) -> dict[str, str]:
    return {m.name: m.signature for m in use.members if m.use is Use.OVERRIDE}


def table_class(name: str) -> ClassUse:
    return next(u for u in SURFACE if isinstance(u, ClassUse) and u.name == name)


def test_the_connector_overrides_exactly_the_hooks_the_table_says_with_its_signatures() -> None:
    ours = {**own_methods(ADAPTER / "compat.py", "VersionHooks"),
            **own_methods(ADAPTER / "connector.py", "KVOffloadConnector")}
    hooks = {**overrides(table_class("KVConnectorBase_V1")), **overrides(table_class("SupportsHMA"))}
    base = table_class("KVConnectorBase_V1")
    vllm_names = {m.name for m in base.members} | set(hooks)

    assert {name: ours[name] for name in hooks if name in ours} == hooks
    assert {name for name in ours if name in vllm_names} == set(hooks)


@pytest.mark.parametrize(("our_class", "vllm_class"), [
    ("KVOffloadStats", "KVConnectorStats"),
    ("KVOffloadPromMetrics", "KVConnectorPromMetrics"),
])
def test_the_metrics_classes_override_what_the_table_says(our_class: str, vllm_class: str) -> None:
    ours = own_methods(ADAPTER / "metrics.py", our_class)

    hooks = overrides(table_class(vllm_class))

    assert {name: ours[name] for name in hooks} == hooks
