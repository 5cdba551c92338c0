"""One CPU binding for every vLLM engine a comparison starts, so that no side computes with more OpenMP threads.

Why it is needed: vLLM's CPU backend binds OpenMP threads itself, and not alike for every engine. In its
multiprocess mode (an OpenAI server; ``LLM`` by default) the executor's ``OMPProcessManager``
(``vllm/utils/ompmultiprocessing.py``) reads ``VLLM_CPU_OMP_THREADS_BIND``. At ``auto``, its default, it takes
the allowed CPUs of one NUMA node per rank and reserves ``local_world_size`` of them for the engine process, and
``local_world_size`` more whenever any ``kv_transfer_config`` is set (meant for NIXL); when nothing would be left
it reserves none. On 2 cores a plain engine then computes with 1 thread and an engine with any connector with 2.
An explicit CPU list is parsed as it is (``cpu_resource_utils.parse_id_list``), one per rank; the reservation
only shapes ``auto``'s lists, so with an explicit list the worker gets ``OMP_NUM_THREADS`` = the list's length and
``OMP_PLACES`` = the list, with and without a connector. That is what ``environment(in_process=False)`` sets.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the demo's engines) vLLM keeps its ``UniProcExecutor``, which
binds nothing: ``VLLM_CPU_OMP_THREADS_BIND`` is ignored (measured: 2 threads with it at ``0``) and OpenMP takes
what the process environment says when torch loads it. For those engines ``environment(in_process=True)`` adds
the variables vLLM would have set for a worker; they must be in the engine process's environment before torch
is imported.

Data flow: ``resolve(flag)`` (the ``--cpu-bind`` flag, else the user's ``VLLM_CPU_OMP_THREADS_BIND``, else every
CPU this process may run on) -> ``CpuBinding`` -> ``environment()`` into each engine's environment -> each engine
reports the ``EngineBinding`` it computed with (a server from vLLM's log: ``logged_binding``; an in-process engine
from torch and its affinity) -> ``require_same`` refuses to compare sides that differ. Nothing here imports torch
or vLLM.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

ENV = "VLLM_CPU_OMP_THREADS_BIND"
FLAG = "--cpu-bind"
FLAG_HELP = ("CPUs every engine's OpenMP threads are bound to, the same for every side, e.g. 0-1 (default: "
             f"${ENV}, else every CPU this process may run on)")


class BindingError(ValueError):
    """A CPU binding that cannot be used; the message names it and where it came from."""


class BindingMismatch(BindingError):
    """Sides of one comparison computed with different CPU bindings; the message lists every side's."""


class EngineBinding(NamedTuple):
    """The CPUs and OpenMP thread count one engine computed with, as the engine reported them."""

    cpu_bind: str
    omp_threads: int

    def as_json(self) -> dict[str, Any]:
        return {"cpu_bind": self.cpu_bind, "omp_threads": self.omp_threads}


@dataclass(frozen=True)
class CpuBinding:
    """The CPUs every engine of a comparison is bound to, and where that choice came from."""

    cpus: tuple[int, ...]
    source: str
    """``--cpu-bind``, ``VLLM_CPU_OMP_THREADS_BIND`` or ``sched_getaffinity``."""

    @property
    def spec(self) -> str:
        """The CPUs as vLLM's variable takes them: ``0-1``, ``0-3,6``."""
        return format_cpus(self.cpus)

    @property
    def threads(self) -> int:
        """OpenMP threads per engine: one per CPU, as vLLM sets ``OMP_NUM_THREADS`` from an explicit list."""
        return len(self.cpus)

    def expected(self) -> EngineBinding:
        return EngineBinding(self.spec, self.threads)

    def environment(self, in_process: bool) -> dict[str, str]:
        """The variables to put into an engine's environment; ``in_process`` adds OpenMP's own (module doc)."""
        env = {ENV: self.spec}
        if in_process:
            env |= {"OMP_NUM_THREADS": str(self.threads), "OMP_PLACES": "{" + ",".join(map(str, self.cpus)) + "}",
                    "OMP_PROC_BIND": "true"}
        return env

    def as_json(self) -> dict[str, Any]:
        return {**self.expected().as_json(), "source": self.source}


def resolve(flag: str | None = None, environ: Mapping[str, str] | None = None,
            allowed: Collection[int] | None = None) -> CpuBinding:
    """The binding for this machine: ``flag`` if given, else ``$VLLM_CPU_OMP_THREADS_BIND``, else ``allowed``.

    Args:
        flag: the ``--cpu-bind`` value, or None.
        environ: where to read the user's variable (default ``os.environ``).
        allowed: the CPUs this process may run on (default ``os.sched_getaffinity(0)``).

    Raises:
        BindingError: the chosen value is not a plain CPU list (``auto`` and ``nobind`` let vLLM choose per
            engine; ``|`` gives one list per rank) or names CPUs outside ``allowed``.
    """
    environ = os.environ if environ is None else environ
    allowed_set = set(os.sched_getaffinity(0) if allowed is None else allowed)
    if flag is not None:
        spec, source = flag, FLAG
    elif environ.get(ENV):
        spec, source = environ[ENV], ENV
    else:
        return CpuBinding(tuple(sorted(allowed_set)), "sched_getaffinity")
    cpus = parse_cpus(spec, source)
    if outside := sorted(set(cpus) - allowed_set):
        raise BindingError(f"{source}={spec!r} names CPUs this process may not run on: {format_cpus(outside)} "
                           f"(allowed: {format_cpus(allowed_set)})")
    return CpuBinding(cpus, source)


def parse_cpus(spec: str, source: str = FLAG) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``, sorted, as vLLM parses one rank's list.

    Raises:
        BindingError: ``auto``, ``nobind``, several ranks' lists, an empty or malformed list.
    """
    if spec in ("auto", "nobind"):
        raise BindingError(f"{source}={spec!r} lets vLLM bind each engine its own way (at 'auto' it reserves one "
                           "more core for an engine with a KV connector): give a CPU list such as '0-1'")
    if "|" in spec:
        raise BindingError(f"{source}={spec!r} has one CPU list per rank; these engines run one rank each: "
                           "give one list such as '0-1'")
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.isdigit() and (not dash or last.isdigit())) or (dash and int(last) < int(first)):
            raise BindingError(f"{source}={spec!r} is not a CPU list such as '0-1' or '0,2-3'")
        cpus.update(range(int(first), int(last if dash else first) + 1))
    return tuple(sorted(cpus))


def format_cpus(cpus: Iterable[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    ordered = sorted(set(cpus))
    runs: list[list[int]] = []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


_CORE_IDS = re.compile(r"local_rank=0, core ids=\[([0-9, ]*)\]")


def logged_binding(log: str) -> EngineBinding | None:
    """What a multiprocess engine bound its rank-0 worker to, from vLLM's "OpenMP thread binding info" log
    line (INFO, logged by the engine process before it starts the worker); None when the log has no such line."""
    found = _CORE_IDS.findall(log)
    if not found:
        return None
    cpus = [int(c) for c in found[-1].split(",") if c.strip()]
    return EngineBinding(format_cpus(cpus), len(cpus))


def require_same(sides: Mapping[str, EngineBinding | None]) -> None:
    """Refuse a comparison whose sides computed with different CPU bindings or thread counts.

    Raises:
        BindingMismatch: two sides differ, or one reported nothing.
    """
    if len(set(sides.values())) > 1:
        listed = ", ".join(f"{name} {_describe(b)}" for name, b in sides.items())
        raise BindingMismatch(f"refusing to compare engines bound differently: {listed}; give every side the same "
                           f"{FLAG} (or {ENV})")


def _describe(binding: EngineBinding | None) -> str:
    if binding is None:
        return "(reported no binding)"
    return f"CPUs {binding.cpu_bind} ({binding.omp_threads} OpenMP thread{'s' * (binding.omp_threads != 1)})"
