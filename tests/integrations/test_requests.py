"""A vLLM request as the scheduler half sees it: the same keys whatever vLLM keeps its tokens in (lists up to 0.33,
0.34's int32 ``TokenBuffer``), and no lookup for a request whose hit vLLM would drop (prompt logprobs)."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvoffload.connector.requests import RequestState
from kvoffload.integrations.vllm.adapters import VllmRequest
from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.keys import Namespace

BLOCK = 16
TOKENS = [random.Random(7).randrange(200_000) for _ in range(8 * BLOCK)]  # ids past 2**16 too, as real vocabularies


def int32_tokens(tokens: Sequence[int]) -> Sequence[int]:
    """vLLM 0.34's TokenBuffer where it is installed, else what it is: int32 token ids in an ``array``."""
    try:
        from vllm.v1.token_buffer import TokenBuffer  # type: ignore[import-not-found]
    except ImportError:
        return array("i", tokens)
    buffer: Sequence[int] = TokenBuffer(tokens)
    return buffer


class Tokens:
    """An engine request over ``tokens``, whatever sequence type holds them."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.request_id = "r"
        self.all_token_ids = tokens
        self.extra_keys: Sequence[str] = ()


def keys(request: Any) -> list[bytes]:
    state = RequestState(request, Namespace("m", "bf16", "pages=16").chain_root(), BLOCK, 1)
    return [bytes(k) for k in state.keys(0, len(TOKENS) // BLOCK, 0)]


def test_keys_of_int32_token_buffers_are_the_keys_of_lists() -> None:
    assert keys(Tokens(int32_tokens(TOKENS))) == keys(Tokens(list(TOKENS)))
    assert keys(Tokens(int32_tokens([*TOKENS[:-1], TOKENS[-1] + 1]))) != keys(Tokens(list(TOKENS)))  # can differ


def test_keys_of_a_vllm_request_are_the_keys_of_its_tokens_as_a_list() -> None:
    request = VllmRequest(Request("r", list(TOKENS), SamplingParams(), None))
    assert keys(request) == keys(Tokens(list(TOKENS)))


@pytest.mark.parametrize("params", [SamplingParams(prompt_logprobs=1), SamplingParams(skip_reading_prefix_cache=True)],
                         ids=["prompt logprobs", "skip reading the prefix cache"])
def test_a_request_whose_hit_vllm_drops_is_not_looked_up(vllm_configs: tuple[Any, Any], params: SamplingParams,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    connector = KVOffloadConnector(*vllm_configs[:1], KVConnectorRole.SCHEDULER, vllm_configs[1])
    core = connector.scheduler.core
    asked: list[int] = []
    lookup = core.get_num_new_matched_tokens
    monkeypatch.setattr(core, "get_num_new_matched_tokens", lambda r, n: asked.append(n) or lookup(r, n))

    assert connector.get_num_new_matched_tokens(Request("p", list(TOKENS), params, None), 0) == (0, False)
    assert asked == []  # no lookup: no promotion started for nothing, no lookup counted
    connector.get_num_new_matched_tokens(Request("q", list(TOKENS), SamplingParams(), None), 0)
    assert asked == [0]  # the same prompt without it is looked up
