"""Anchor check: LRU replay of the Mooncake conversation trace has the shape of the paper's Figure 9 (FAST'25):
an unbounded maximum near 0.4, and at 3M tokens less than half of it.

The figures asserted are those this replay measures (docs/planning.md and benchmarks/README.md record the runs):
on the whole trace unbounded 0.374 and LRU at 3M tokens 0.139; on its first 3,000 requests (a cold start, so the
maximum is lower) unbounded 0.320, LRU at 3M 0.141 and the optimum reaching the maximum. The first 2,000 requests
do not show the shape (LRU at 3M is 0.504 of their maximum), so the slice is 3,000.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from kvoffload.config import EvictionPolicy
from kvoffload.tools.replay import Bound, Trace, read_trace, replay

# The conversation trace of the Mooncake FAST'25 release (Apache 2.0, licence beside it), kept here gzipped so the
# anchor check runs in every clone; KVOFFLOAD_MOONCAKE_TRACE points it at another copy.
PACKED = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
M = 1_000_000


@pytest.fixture(scope="module")
def conversation(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    if (path := os.environ.get("KVOFFLOAD_MOONCAKE_TRACE")) is not None:
        return read_trace(path)
    unpacked = tmp_path_factory.mktemp("trace") / "mooncake_conversation_trace.jsonl"
    unpacked.write_bytes(gzip.decompress(PACKED.read_bytes()))
    return read_trace(unpacked)


def blocks(t: Trace, tokens: int) -> int:
    return tokens // t.block_tokens


def test_lru_on_the_whole_trace_gets_less_than_half_the_maximum_at_3m_tokens(conversation: Trace) -> None:
    assert len(conversation.requests) == 12_031
    unbounded = replay(conversation, 1, Bound.UNBOUNDED).token_hit_rate
    lru = replay(conversation, blocks(conversation, 3 * M), EvictionPolicy.LRU).token_hit_rate
    assert unbounded == pytest.approx(0.374, abs=0.005)
    assert lru == pytest.approx(0.139, abs=0.005)
    assert lru < unbounded / 2


def test_on_a_slice_lru_stays_below_half_while_the_optimum_reaches_the_maximum(conversation: Trace) -> None:
    head = conversation.head(3000)
    unbounded = replay(head, 1, Bound.UNBOUNDED).token_hit_rate
    lru = replay(head, blocks(head, 3 * M), EvictionPolicy.LRU).token_hit_rate
    optimum = replay(head, blocks(head, 3 * M), Bound.OPTIMUM).token_hit_rate
    assert unbounded == pytest.approx(0.320, abs=0.005)
    assert lru == pytest.approx(0.141, abs=0.005)
    assert lru < unbounded / 2
    assert optimum == pytest.approx(unbounded, rel=0.01)
