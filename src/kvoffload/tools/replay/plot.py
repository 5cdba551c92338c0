"""The capacity planner's figure, in the style of Mooncake (FAST'25) Figure 9: token hit rate against capacity.

One curve per policy, the optimum dashed, the unbounded maximum a horizontal line; capacity in tokens on a log
axis below and in GiB of KV above. matplotlib is imported here only, when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvoffload.tools.replay.models import GIB


def draw_plan(path: str, title: str, capacity_tokens: Sequence[int], curves: Mapping[str, Sequence[float]],
              optimum: Sequence[float], unbounded: float, bytes_per_token: int) -> None:
    """Write the figure to ``path`` (PNG).

    Args:
        capacity_tokens: the x values.
        curves: per policy, its token hit rate at each capacity.
        optimum: the optimum's token hit rate at each capacity.
        unbounded: the unbounded-capacity hit rate.
    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for name, rates in curves.items():
            ax.plot(capacity_tokens, rates, marker="o", markersize=4, label=name)
        ax.plot(capacity_tokens, optimum, linestyle="--", color="black", label="optimum (Belady)")
        ax.axhline(unbounded, linestyle=":", color="grey", label=f"unbounded ({unbounded:.3f})")
        ax.set_xscale("log")
        ax.set_xlabel("cache capacity (tokens)")
        ax.set_ylabel("prefix hit rate (tokens)")
        ax.set_ylim(0, max(unbounded, *optimum, 0.01) * 1.1)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(title, fontsize=10)
        gib_per_token = bytes_per_token / GIB
        top = ax.secondary_xaxis("top", functions=(lambda t: np.multiply(t, gib_per_token),
                                                   lambda g: np.divide(g, gib_per_token)))
        top.set_xlabel("KV capacity (GiB)")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
