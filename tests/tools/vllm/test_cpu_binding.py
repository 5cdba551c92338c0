"""The CPU binding every compared engine gets (``cpu_binding``): where it comes from, what it puts into an
engine's environment, what vLLM's log says it bound, and the refusal to compare engines bound differently."""

from __future__ import annotations

import pytest

from kvoffload.tools.vllm.cpu_binding import (
    ENV,
    BindingError,
    BindingMismatch,
    CpuBinding,
    EngineBinding,
    format_cpus,
    logged_binding,
    parse_cpus,
    require_same,
    resolve,
)

TWO_CPUS = {0, 1}

# vLLM 0.32's "OpenMP thread binding info" record (ompmultiprocessing.py), as a server's log holds it.
VLLM_LOG = """(EngineCore pid=812) INFO 12-01 21:43:10 [ompmultiprocessing.py:186] OpenMP thread binding info:
\tVLLM_CPU_OMP_THREADS_BIND='0-1', auto_setup=False, skip_setup=False
\tlocal_world_size=1, reserve_cpu_num=2
\tlocal_rank=0, core ids=[0, 1]
\treserved_cpus=[]
"""


def test_without_flag_or_variable_every_allowed_cpu_is_bound() -> None:
    binding = resolve(None, environ={}, allowed=TWO_CPUS)
    assert (binding.spec, binding.threads, binding.source) == ("0-1", 2, "sched_getaffinity")


def test_the_flag_wins_over_the_user_s_variable_which_wins_over_the_affinity() -> None:
    assert resolve("1", environ={ENV: "0"}, allowed=TWO_CPUS) == CpuBinding((1,), "--cpu-bind")
    assert resolve(None, environ={ENV: "0"}, allowed=TWO_CPUS) == CpuBinding((0,), ENV)


@pytest.mark.parametrize("spec", ["auto", "nobind", "0|1", "", "a", "1-0", "0-", "0,,1"])
def test_a_value_that_is_not_one_plain_cpu_list_is_refused_naming_it(spec: str) -> None:
    with pytest.raises(BindingError, match=f"--cpu-bind={spec!r}"):
        resolve(spec, environ={}, allowed=TWO_CPUS)


def test_cpus_this_process_may_not_run_on_are_refused() -> None:
    with pytest.raises(BindingError, match=r"VLLM_CPU_OMP_THREADS_BIND='1-3' .* 2-3 \(allowed: 0-1\)"):
        resolve(None, environ={ENV: "1-3"}, allowed=TWO_CPUS)


def test_cpu_lists_parse_and_format_like_vllm_s() -> None:
    assert parse_cpus("5,0-2,7-8,1") == (0, 1, 2, 5, 7, 8)
    assert format_cpus([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert format_cpus([3]) == "3"


def test_a_server_gets_vllm_s_variable_and_an_in_process_engine_openmp_s_own() -> None:
    binding = CpuBinding((0, 1), "sched_getaffinity")
    assert binding.environment(in_process=False) == {ENV: "0-1"}
    assert binding.environment(in_process=True) == {ENV: "0-1", "OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}",
                                                    "OMP_PROC_BIND": "true"}
    assert binding.as_json() == {"cpu_bind": "0-1", "omp_threads": 2, "source": "sched_getaffinity"}


def test_the_binding_vllm_logged_is_read_from_its_log() -> None:
    assert logged_binding("no binding here\n" + VLLM_LOG) == EngineBinding("0-1", 2)
    assert logged_binding(VLLM_LOG.replace("[0, 1]", "[1]")) == EngineBinding("1", 1)
    assert logged_binding("INFO started\n") is None


def test_sides_bound_alike_are_compared() -> None:
    require_same({"plain": EngineBinding("0-1", 2), "kvoffload": EngineBinding("0-1", 2)})


def test_sides_with_different_thread_counts_are_refused_naming_each() -> None:
    with pytest.raises(BindingMismatch, match=r"plain CPUs 0-1 \(1 OpenMP thread\), kvoffload CPUs 0-1 \(2 OpenMP"):
        require_same({"plain": EngineBinding("0-1", 1), "kvoffload": EngineBinding("0-1", 2)})


def test_a_side_that_reported_no_binding_is_refused() -> None:
    with pytest.raises(BindingMismatch, match=r"on \(reported no binding\)"):
        require_same({"off": EngineBinding("0", 1), "on": None})
