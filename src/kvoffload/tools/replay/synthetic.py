"""Synthetic traces for judging eviction and admission rules beyond one production trace.

Each is built for a tier of ``tier`` blocks (16-token blocks, seeded, the same on every run) and has a shape that
favours some rule; ``kvoffload replay --trace synthetic:NAME[:TIER]`` replays one (``sweep.load``):

- ``recency``: prompts of 4 blocks; 70% reuse an earlier prompt at a stack distance of half the tier on average
  (geometric), 30% are new: what LRU is best at, and what second-sighting admission costs most on.
- ``loop``: single blocks cycled over 1.5 times the tier: LRU and ARC keep nothing, frequency keeps most.
- ``chain-loop``: the same loop of 8-block prefix chains: a block is useless without its parents.
- ``zipf``: 4-block prompts drawn by popularity (Zipf, s = 0.9) from 20 times the tier.
- ``scan``: the recency traffic with, every tenth request, a one-time scan of a quarter of the tier.
- ``chat``: conversations on a shared 4-block system prompt, each turn the last one's prompt plus 2 blocks, turns
  of a few hundred conversations interleaved: prefix trees whose tails the next turn reuses.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

from kvoffload.tools.replay.trace import Request, Trace, int_key

BLOCK_TOKENS = 16
DEFAULT_TIER = 2000
"""Tier blocks a synthetic trace is built for when its name gives none."""
PREFIX = "synthetic:"


def _trace(prompts: Iterator[list[int]]) -> Trace:
    requests = tuple(Request(float(i), len(ids) * BLOCK_TOKENS, 1, tuple(int_key(b) for b in ids))
                     for i, ids in enumerate(prompts))
    return Trace(requests, BLOCK_TOKENS)


def _reuse(rng: random.Random, history: list[list[int]], mean_distance: float) -> list[int]:
    """An earlier prompt at a geometric stack distance (in prompts) of mean ``mean_distance``."""
    distance = min(len(history) - 1, int(rng.expovariate(1.0 / max(1.0, mean_distance))))
    return history[-1 - distance]


def _recency_prompts(tier: int, requests: int, rng: random.Random, scan_every: int = 0) -> Iterator[list[int]]:
    ids = itertools.count()
    history: list[list[int]] = []
    for i in range(requests):
        if scan_every and i % scan_every == scan_every - 1:
            yield [next(ids) for _ in range(max(1, tier // 4))]  # never seen again
            continue
        reuse = bool(history) and rng.random() < 0.7
        prompt = _reuse(rng, history, tier / 2 / 4) if reuse else [next(ids) for _ in range(4)]
        history.append(prompt)
        yield prompt


def recency(tier: int, seed: int = 0) -> Trace:
    return _trace(_recency_prompts(tier, 10 * tier, random.Random(seed)))


def scan(tier: int, seed: int = 0) -> Trace:
    return _trace(_recency_prompts(tier, 10 * tier, random.Random(seed), scan_every=10))


def loop(tier: int, seed: int = 0, chain: int = 1) -> Trace:
    chains = max(1, int(1.5 * tier) // chain)
    prompts = (list(range(c * chain, (c + 1) * chain)) for _ in range(6) for c in range(chains))
    return _trace(prompts)


def chain_loop(tier: int, seed: int = 0) -> Trace:
    return loop(tier, seed, chain=8)


def zipf(tier: int, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    prompts = 20 * tier // 4
    weights = list(itertools.accumulate(1.0 / (r + 1) ** 0.9 for r in range(prompts)))
    picks = rng.choices(range(prompts), cum_weights=weights, k=10 * tier)
    return _trace(list(range(p * 4, p * 4 + 4)) for p in picks)


def chat(tier: int, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    ids = itertools.count(4)  # 0..3: the shared system prompt
    live: list[list[int]] = []

    def turns() -> Iterator[list[int]]:
        for _ in range(5 * tier):
            if not live or (len(live) < 300 and rng.random() < 0.3):
                live.append([0, 1, 2, 3])
            i = rng.randrange(len(live))
            live[i] = live[i] + [next(ids), next(ids)]
            yield live[i]
            if len(live[i]) > 40 or rng.random() < 0.1:  # the conversation ends
                live.pop(i)

    return _trace(turns())


TRACES: dict[str, Callable[..., Trace]] = {"recency": recency, "loop": loop, "chain-loop": chain_loop,
                                           "zipf": zipf, "scan": scan, "chat": chat}


def synthetic(name: str) -> Trace:
    """The trace a ``synthetic:NAME[:TIER]`` argument names.

    Raises:
        ValueError: an unknown name, or a tier that is not a positive integer.
    """
    parts = name.removeprefix(PREFIX).split(":")
    if parts[0] not in TRACES or len(parts) > 2:
        raise ValueError(f"unknown synthetic trace {name!r}; known: {', '.join(PREFIX + n for n in TRACES)}"
                         f"[:TIER blocks]")
    try:
        tier = int(parts[1]) if len(parts) == 2 else DEFAULT_TIER
    except ValueError:
        tier = 0
    if tier <= 0:
        raise ValueError(f"synthetic trace {name!r}: the tier must be a positive number of blocks")
    return TRACES[parts[0]](tier)
