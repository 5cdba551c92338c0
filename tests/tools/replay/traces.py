"""Small traces for the replay tests: built from id lists, written as JSONL, drawn at random; and a brute-force
optimum to check Belady's policy against."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

from hypothesis import strategies as st

from kvoffload.keys import OffloadKey
from kvoffload.tools.replay import Request, Trace, int_key

BLOCK = 4
"""Tokens per block of the small traces (a request's input length is its blocks * BLOCK unless given)."""


def trace(*prompts: Sequence[int], block_tokens: int = BLOCK, lengths: Sequence[int] | None = None) -> Trace:
    """A trace of one request per id list; full blocks unless ``lengths`` gives the input lengths."""
    requests = tuple(
        Request(float(i), lengths[i] if lengths else len(ids) * block_tokens, 1, tuple(int_key(b) for b in ids))
        for i, ids in enumerate(prompts))
    return Trace(requests, block_tokens)


def write_jsonl(path: Path, prompts: Sequence[Sequence[int]], block: int = 512) -> Path:
    """A Mooncake-format file of ``prompts`` (full blocks of ``block`` tokens), one line each."""
    lines = [json.dumps({"timestamp": i * 10, "input_length": len(ids) * block, "output_length": 7, "hash_ids": ids})
             for i, ids in enumerate(prompts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def random_chained(rng: random.Random, requests: int, max_new: int = 3, reuse: float = 0.7) -> list[list[int]]:
    """Prefix-chained prompts: each extends a random prefix of an earlier one (or starts afresh) with new ids."""
    prompts: list[list[int]] = []
    next_id = 0
    for _ in range(requests):
        base: list[int] = []
        if prompts and rng.random() < reuse:
            earlier = rng.choice(prompts)
            base = earlier[:rng.randint(0, len(earlier))]
        new = rng.randint(0 if base else 1, max_new)
        prompts.append(base + list(range(next_id, next_id + new)))
        next_id += new
    return prompts


@st.composite
def chained_prompts(draw: st.DrawFn, max_requests: int = 7, max_new: int = 3) -> list[list[int]]:
    """Hypothesis: prefix-chained prompts as ``random_chained`` builds them, from a drawn seed and size."""
    seed = draw(st.integers(0, 2**32 - 1))
    requests = draw(st.integers(1, max_requests))
    return random_chained(random.Random(seed), requests, max_new)


def prefix_hits(resident: frozenset[OffloadKey], keys: Sequence[OffloadKey]) -> int:
    hits = 0
    for key in keys:
        if key not in resident:
            break
        hits += 1
    return hits


def brute_force_hits(t: Trace, capacity: int) -> int:
    """The most prefix block hits any cache of ``capacity`` blocks can get on ``t``.

    Exhaustive over cache contents: after each request the cache may hold any subset of at most ``capacity`` of
    what it held and the request's blocks (more freedom than the replay loop has, so never less than the optimum).
    """
    best: dict[frozenset[OffloadKey], int] = {frozenset(): 0}
    for request in t.requests:
        after: dict[frozenset[OffloadKey], int] = {}
        for state, total in best.items():
            score = total + prefix_hits(state, request.keys)
            pool = sorted(state | set(request.keys))
            for size in range(min(capacity, len(pool)) + 1):
                for kept in combinations(pool, size):
                    contents = frozenset(kept)
                    if after.get(contents, -1) < score:
                        after[contents] = score
        best = after
    return max(best.values())
