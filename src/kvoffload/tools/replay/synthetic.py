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

Multi-tenant (each request names its tenant; ``kvoffload replay --tenants``): ``tenants-calm`` is four chat
tenants ``t0``..``t3``, each the ``chat`` shape on its own system prompt with ``tier / 40`` conversations live at
most, keys salted per tenant (disjoint key spaces, as ``cache_salt`` makes them), a request's tenant drawn
uniformly; ``tenants-flood`` is the same chat requests, in the same order, with a ``flood`` tenant's requests between
them (before each, a geometric count of mean 1: half the requests): a long prompt (``FLOOD_BLOCKS`` new blocks) never
seen again, what a batch job or an abusive client sends.
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


def _conversations(rng: random.Random, ids: Iterator[int], system: list[int], live_most: int
                   ) -> Iterator[list[int]]:
    """Turns of interleaved conversations on ``system``, forever: each turn is its conversation's last prompt plus
    2 new blocks; a new conversation starts with probability 0.3 while fewer than ``live_most`` are live."""
    live: list[list[int]] = []
    while True:
        if not live or (len(live) < live_most and rng.random() < 0.3):
            live.append(list(system))
        i = rng.randrange(len(live))
        live[i] = live[i] + [next(ids), next(ids)]
        yield live[i]
        if len(live[i]) > 40 or rng.random() < 0.1:  # the conversation ends
            live.pop(i)


def chat(tier: int, seed: int = 0) -> Trace:
    turns = _conversations(random.Random(seed), itertools.count(4), [0, 1, 2, 3], 300)  # 0..3: the system prompt
    return _trace(itertools.islice(turns, 5 * tier))


CHAT_TENANTS = ("t0", "t1", "t2", "t3")
FLOOD = "flood"
"""The flooding tenant of ``tenants-flood``."""
FLOOD_BLOCKS = 16
_SALT_BITS = 40
"""A tenant's block ids are its index shifted by this: disjoint key spaces, as a per-tenant salt gives."""


def _tenant_requests(tier: int, seed: int, flood: bool) -> Iterator[tuple[str, list[int]]]:
    # Separate generators for the tenant draw, each tenant's conversations and the flood, so that the calm trace
    # is the flood trace without its flood requests.
    pick, flood_rng = random.Random(seed), random.Random(seed + 1)
    chats = [_conversations(random.Random(seed + 2 + i), itertools.count(4), [0, 1, 2, 3], max(2, tier // 40))
             for i in range(len(CHAT_TENANTS))]
    flood_ids = itertools.count()
    for _ in range(5 * tier):
        while flood and flood_rng.random() < 0.5:  # as many flood requests as chat ones, on average
            yield FLOOD, [next(flood_ids) for _ in range(FLOOD_BLOCKS)]
        t = pick.randrange(len(CHAT_TENANTS))
        yield CHAT_TENANTS[t], next(chats[t])


def _tenant_trace(tier: int, seed: int, flood: bool) -> Trace:
    index = {name: i for i, name in enumerate((*CHAT_TENANTS, FLOOD))}
    requests = tuple(
        Request(float(i), len(ids) * BLOCK_TOKENS, 1,
                tuple(int_key(index[tenant] << _SALT_BITS | b) for b in ids), tenant)
        for i, (tenant, ids) in enumerate(_tenant_requests(tier, seed, flood)))
    return Trace(requests, BLOCK_TOKENS)


def tenants_calm(tier: int, seed: int = 0) -> Trace:
    return _tenant_trace(tier, seed, flood=False)


def tenants_flood(tier: int, seed: int = 0) -> Trace:
    return _tenant_trace(tier, seed, flood=True)


TRACES: dict[str, Callable[..., Trace]] = {"recency": recency, "loop": loop, "chain-loop": chain_loop,
                                           "zipf": zipf, "scan": scan, "chat": chat,
                                           "tenants-calm": tenants_calm, "tenants-flood": tenants_flood}


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
