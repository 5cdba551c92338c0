"""The series of docs/grafana/kvoffload.json, sampled from a live server and drawn as its panels.

``bench serve --dashboard PNG`` runs a ``Sampler`` beside vLLM's client on the kvoffload server (a thread scraping
/metrics once a second) and draws the dashboard's panels from the samples with matplotlib: what an operator's
Grafana would show for that run, without needing Grafana here.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Scrape = Callable[[], dict[str, float]]


@dataclass
class Sampler:
    """Scrapes every ``period_s`` seconds in a thread between ``start`` and ``stop``; samples are (t, series)."""

    scrape: Scrape
    period_s: float = 1.0
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvoffload-metrics-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s if self.samples else 0):
            self._take()

    def _take(self) -> None:
        with contextlib.suppress(OSError):  # a failed scrape (server busy) is a gap in the plot, not an error
            self.samples.append((time.monotonic(), self.scrape()))


def total(sample: dict[str, float], name: str, label: str | None = None) -> float:
    """The sum of ``name``'s series (those with ``label`` in their labels, if given)."""
    return sum(v for s, v in sample.items() if s.partition("{")[0] == name and (label is None or label in s))


def rates(samples: Sequence[tuple[float, dict[str, float]]], name: str,
          label: str | None = None) -> tuple[list[float], list[float]]:
    """Per-second rate of a counter between consecutive samples: (times from the first sample, rates)."""
    times, values = [], []
    for (t0, a), (t1, b) in itertools.pairwise(samples):
        if t1 > t0:
            times.append(t1 - samples[0][0])
            values.append((total(b, name, label) - total(a, name, label)) / (t1 - t0))
    return times, values


def directions(samples: Sequence[tuple[float, dict[str, float]]]) -> list[str]:
    names = {s.partition('direction="')[2].partition('"')[0] for _, sample in samples[-1:] for s in sample}
    return sorted(n for n in names if n)


def draw(path: str, samples: Sequence[tuple[float, dict[str, float]]]) -> None:
    """The dashboard's panels for one run, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11.0, 7.0))
    (hits, moved), (failed, usage) = axes
    for name, label in (("vllm:kvoffload_hit_tokens_total", "kvoffload hits"),
                        ("vllm:kvoffload_miss_tokens_total", "kvoffload misses")):
        hits.plot(*rates(samples, name), label=label)
    hits.set_title("Prompt tokens/s looked up in kvoffload")
    for d in directions(samples):
        t, v = rates(samples, "vllm:kvoffload_transfer_bytes_total", f'direction="{d}"')
        moved.plot(t, [x / 2**20 for x in v], label=d)
    moved.set_title("MiB/s moved per direction")
    failed.plot(*rates(samples, "vllm:kvoffload_failed_load_tokens_total"), label="failed load tokens/s")
    failed.plot(*rates(samples, "vllm:kvoffload_transfer_failed_jobs_total"), label="failed jobs/s")
    failed.set_title("Failures (each one recomputed)")
    start = samples[0][0] if samples else 0.0
    usage.plot([t - start for t, _ in samples],
               [total(s, "vllm:kvoffload_host_used_bytes") / 2**20 for _, s in samples], label="host")
    usage.set_title("Tier usage, MiB")
    for ax in (hits, moved, failed, usage):
        ax.set_xlabel("seconds into the run")
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle("kvoffload dashboard panels (docs/grafana/kvoffload.json), bench serve's kvoffload server")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
