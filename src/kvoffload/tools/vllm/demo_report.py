"""The demo's workload and its report: what each turn sends, what each turn measured, the summary and chart.

Data flow: ``Workload`` -> ``user_turns()`` (token ids per conversation and turn) -> the demo drives vLLM once
without and once with kvoffload, recording a ``TurnResult`` per request -> ``summarize()`` pairs the two runs
turn by turn into the JSON summary -> ``format_report()`` / ``write_chart()`` show it. Nothing here imports
vLLM, so the arithmetic is tested without an engine.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvoffload.testing.outputs import TOLERANCE, Control, divergence
from kvoffload.tools.vllm.cpu_binding import EngineBinding, require_same

# Targets the demo checks itself against (the acceptance figures).
HIT_TTFT_RATIO_TARGET = 0.25
MISS_TTFT_SLACK = 1.05


@dataclass(frozen=True)
class Workload:
    """A multi-turn chat: each conversation opens with a long message (a pasted document), then short turns.

    Conversations are served round-robin, turn by turn, so by the time a conversation comes back its prefix has
    been evicted from a device cache that holds about one conversation.
    """

    conversations: int = 6
    turns: int = 5
    system_tokens: int = 32
    first_user_tokens: int = 1536
    user_tokens: int = 32
    reply_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def max_conversation_tokens(self) -> int:
        """Length of a conversation's last prompt plus its reply: what one request can need at most."""
        return (
            self.system_tokens
            + self.first_user_tokens
            + (self.turns - 1) * self.user_tokens
            + self.turns * self.reply_tokens
        )


def user_turns(workload: Workload, vocab_size: int) -> list[list[list[int]]]:
    """Token ids of each user message, ``[conversation][turn]``; the system prompt is turn 0's head.

    The model's weights are random, so random ids (fixed seed, specials excluded) are as meaningful as text.
    """
    rng = random.Random(workload.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(2, vocab_size) for _ in range(n)]

    system = ids(workload.system_tokens)  # shared by all conversations, as one app's system prompt is
    messages = []
    for _ in range(workload.conversations):
        first = system + ids(workload.first_user_tokens)
        messages.append([first] + [ids(workload.user_tokens) for _ in range(workload.turns - 1)])
    return messages


@dataclass(frozen=True)
class TurnResult:
    """One request as one engine served it."""

    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    device_hit_tokens: int
    """Prompt tokens found in vLLM's own (device) prefix cache."""
    offload_hit_tokens: int
    """Prompt tokens loaded from kvoffload instead of computed."""
    bytes_loaded: int
    bytes_stored: int
    tokens: tuple[int, ...]
    """The generated token ids (greedy)."""
    logprobs: tuple[dict[int, float], ...]
    """Per generated position, the top token ids and their logprobs (``kvoffload.testing.outputs``)."""

    def loaded_position(self) -> int | None:
        """A prompt position inside the run of tokens kvoffload loaded for this turn (None: nothing loaded)."""
        if not self.offload_hit_tokens:
            return None
        return self.device_hit_tokens + self.offload_hit_tokens // 2


@dataclass(frozen=True)
class RunResult:
    """One engine's pass over the whole workload."""

    name: str
    turns: tuple[TurnResult, ...]
    wall_s: float
    binding: EngineBinding | None = None
    """The CPUs and OpenMP threads the engine reported computing with (None: not reported)."""


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 4) if num is not None and den else None


def run_summary(run: RunResult) -> dict[str, Any]:
    """Totals of one run: median TTFT, hit rates over all prompt tokens, bytes moved, wall time."""
    prompt = sum(t.prompt_tokens for t in run.turns)
    return {
        "ttft_median_s": round(_median([t.ttft_s for t in run.turns]) or 0.0, 4),
        "ttft_total_s": round(sum(t.ttft_s for t in run.turns), 3),
        "prompt_tokens": prompt,
        "device_hit_rate": round(sum(t.device_hit_tokens for t in run.turns) / prompt, 4) if prompt else 0.0,
        "offload_hit_rate": round(sum(t.offload_hit_tokens for t in run.turns) / prompt, 4) if prompt else 0.0,
        "bytes_loaded": sum(t.bytes_loaded for t in run.turns),
        "bytes_stored": sum(t.bytes_stored for t in run.turns),
        "wall_s": round(run.wall_s, 2),
        **(run.binding.as_json() if run.binding else {"cpu_bind": None, "omp_threads": None}),
    }


def same_output(a: TurnResult, b: TurnResult) -> bool:
    """Same generated tokens, top logprobs within ``TOLERANCE``."""
    return divergence([a], [b]) <= TOLERANCE


def summarize(off: RunResult, on: RunResult, control: Control | None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pair the runs turn by turn into the demo's JSON summary.

    Hit turns are those where kvoffload loaded tokens in the ``on`` run; ``ttft_ratio_hit_turns`` is the median
    TTFT of those turns with kvoffload over the median of the same turns without it. Miss turns are the rest.
    ``outputs_match`` (same tokens, logprobs within ``TOLERANCE``, every turn) is None unless ``control`` held:
    a comparison whose outputs do not depend on the KV proves nothing.

    Raises:
        ValueError: the runs did not serve the same turns in the same order.
        BindingMismatch: the engines computed with different CPU bindings or thread counts (``cpu_binding``).
    """
    require_same({off.name: off.binding, on.name: on.binding})
    keys_off = [(t.conversation, t.turn) for t in off.turns]
    if keys_off != [(t.conversation, t.turn) for t in on.turns]:
        raise ValueError("off and on runs served different turns")
    hit = [i for i, t in enumerate(on.turns) if t.offload_hit_tokens > 0]
    miss = [i for i in range(len(on.turns)) if i not in set(hit)]

    def ratio(indices: list[int]) -> float | None:
        return _ratio(_median([on.turns[i].ttft_s for i in indices]), _median([off.turns[i].ttft_s for i in indices]))

    hit_ratio, miss_ratio = ratio(hit), ratio(miss)
    mismatched = [i for i, (a, b) in enumerate(zip(off.turns, on.turns, strict=True)) if not same_output(a, b)]
    meaningful = control is not None and control.holds
    outputs_match = not mismatched if meaningful else None
    return {
        **(extra or {}),
        "off": run_summary(off),
        "on": run_summary(on),
        "hit_turns": len(hit),
        "miss_turns": len(miss),
        "ttft_ratio_hit_turns": hit_ratio,
        "ttft_ratio_miss_turns": miss_ratio,
        "outputs_match": outputs_match,
        "mismatched_turns": [[off.turns[i].conversation, off.turns[i].turn] for i in mismatched],
        "control": None if control is None else control.as_json(),
        "targets": {
            "ttft_ratio_hit_turns<=0.25": hit_ratio is not None and hit_ratio <= HIT_TTFT_RATIO_TARGET,
            "miss_turns_within_5pct": miss_ratio is None or miss_ratio <= MISS_TTFT_SLACK,
            "outputs_match": outputs_match is True,
        },
        "turns": [_turn_row(a, b) for a, b in zip(off.turns, on.turns, strict=True)],
    }


def _turn_row(off: TurnResult, on: TurnResult) -> dict[str, Any]:
    return {
        "conversation": off.conversation,
        "turn": off.turn,
        "prompt_tokens": off.prompt_tokens,
        "ttft_off_s": round(off.ttft_s, 4),
        "ttft_on_s": round(on.ttft_s, 4),
        "offload_hit_tokens": on.offload_hit_tokens,
        "device_hit_tokens_off": off.device_hit_tokens,
        "device_hit_tokens_on": on.device_hit_tokens,
        "bytes_loaded": on.bytes_loaded,
        "bytes_stored": on.bytes_stored,
        "match": same_output(off, on),
    }


def format_turn(run: str, t: TurnResult) -> str:
    """One progress line, printed as each request finishes."""
    return (
        f"[{run:>3}] conv {t.conversation} turn {t.turn}: {t.prompt_tokens:5d} prompt tokens, "
        f"TTFT {t.ttft_s * 1000:8.1f} ms, device hit {t.device_hit_tokens:5d}, "
        f"kvoffload hit {t.offload_hit_tokens:5d} ({t.offload_hit_tokens / t.prompt_tokens:4.0%}), "
        f"loaded {_mib(t.bytes_loaded)}, stored {_mib(t.bytes_stored)}"
    )


def format_report(summary: dict[str, Any]) -> str:
    """The per-turn table and the summary lines a person reads at the end of ``kvoffload demo``."""
    lines = [
        "conv turn prompt  TTFT off ms  TTFT on ms  ratio  kvoffload hit  hit %  loaded      stored      match",
    ]
    for r in summary["turns"]:
        ratio = r["ttft_on_s"] / r["ttft_off_s"] if r["ttft_off_s"] else float("nan")
        lines.append(
            f"{r['conversation']:4d} {r['turn']:4d} {r['prompt_tokens']:6d} {r['ttft_off_s'] * 1000:12.1f} "
            f"{r['ttft_on_s'] * 1000:11.1f} {ratio:6.2f} {r['offload_hit_tokens']:14d} "
            f"{r['offload_hit_tokens'] / r['prompt_tokens']:5.0%}  "
            f"{_mib(r['bytes_loaded'])}  {_mib(r['bytes_stored'])}  {'yes' if r['match'] else 'NO'}"
        )
    off, on = summary["off"], summary["on"]
    lines += [
        "",
        f"median TTFT: {off['ttft_median_s'] * 1000:.1f} ms without kvoffload, "
        f"{on['ttft_median_s'] * 1000:.1f} ms with it",
        f"hit turns ({summary['hit_turns']}): TTFT ratio on/off {_fmt(summary['ttft_ratio_hit_turns'])} "
        f"(target <= {HIT_TTFT_RATIO_TARGET})",
        f"miss turns ({summary['miss_turns']}): TTFT ratio on/off {_fmt(summary['ttft_ratio_miss_turns'])} "
        f"(target <= {MISS_TTFT_SLACK})",
        f"prompt tokens from kvoffload: {on['offload_hit_rate']:.1%}; from the device cache: "
        f"{off['device_hit_rate']:.1%} off, {on['device_hit_rate']:.1%} on",
        f"bytes moved: {_mib(on['bytes_loaded'])} loaded, {_mib(on['bytes_stored'])} stored",
        _outputs_line(summary),
    ]
    if on.get("cpu_bind") is not None:
        lines.append(f"both engines computed on CPUs {on['cpu_bind']} with {on['omp_threads']} OpenMP threads")
    return "\n".join(lines)


def _outputs_line(summary: dict[str, Any]) -> str:
    control = summary["control"]
    if control is None:
        return "outputs not compared: no turn loaded anything from kvoffload"
    moved = "changed the generated tokens" if control["tokens_changed"] else (
        f"moved the logprobs by {control['max_logprob_shift']:.3f}")
    check = f"(control: one prompt token changed inside a loaded block {moved} in plain vLLM"
    if not control["holds"]:
        return f"outputs comparison not meaningful {check}, less than {control['required_shift']})"
    verdict = "yes" if summary["outputs_match"] else "NO " + str(summary["mismatched_turns"])
    return f"generated tokens match: {verdict} {check}; tolerance {TOLERANCE})"


def write_chart(summary: dict[str, Any], path: Path) -> bool:
    """Write a PNG of TTFT per turn, both runs; returns False (writing nothing) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = summary["turns"]
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(rows)), 4.0))
    ax.plot(x, [r["ttft_off_s"] * 1000 for r in rows], "o-", label="vLLM")
    ax.plot(x, [r["ttft_on_s"] * 1000 for r in rows], "s-", label="vLLM + kvoffload")
    hits = [i for i, r in enumerate(rows) if r["offload_hit_tokens"]]
    ax.scatter(hits, [rows[i]["ttft_on_s"] * 1000 for i in hits], s=80, facecolors="none", edgecolors="green",
               label="served from kvoffload", zorder=3)
    ax.set_xticks(x, [f"c{r['conversation']}t{r['turn']}" for r in rows], rotation=90, fontsize=7)
    ax.set_xlabel("request (conversation, turn), in the order served")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"TTFT per turn; hit-turn ratio {_fmt(summary['ttft_ratio_hit_turns'])}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _mib(n: int) -> str:
    return f"{n / (1 << 20):6.2f} MiB"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
