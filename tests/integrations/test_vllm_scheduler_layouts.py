"""kvoffload under vLLM's real scheduler (scheduler_harness.py) past plain attention: speculative decoding with
rejected drafts, sliding-window and state (Mamba-style) hybrid models, and vLLM 0.34's
``--max-num-inflight-kv-loads``. Each test checks the hits, every byte read back and the outputs, as in
test_vllm_scheduler.py; the controls show the checks failing on a corrupted state load and on a wrong answer to
vLLM's ``may_load_async``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch
from tests.integrations.scheduler_harness import (
    VOCAB,
    Engine,
    Engines,
    assert_served_right,
    attention,
    store_then_reset,
    tokens,
    write_model_config,
)
from vllm.config import SchedulerConfig
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec
from vllm.v1.request import RequestStatus

from kvoffload.blocks import NO_BLOCK, DeviceBlocks
from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.messages import KVOffloadMetadata


def hybrid_window(num_layers: int, window: int, block_size: int = 16) -> dict[str, KVCacheSpec]:
    """Gemma-style layers: sliding-window layers with every other one full attention (two KV-cache groups)."""
    return {f"model.layers.{i}.self_attn.attn": attention(block_size, None if i % 2 else window)
            for i in range(num_layers)}


def hybrid_state(num_layers: int) -> dict[str, KVCacheSpec]:
    """LFM2-style layers: ShortConv state layers ("align" mode) alternating with full attention, the state page
    padded to the attention page and the block size the smallest multiple of 32 whose page holds the state, as
    vLLM sizes them for such models."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    shapes = MambaStateShapeCalculator.short_conv_state_shape(tp_world_size=1, intermediate_size=64, conv_kernel=3)
    dtypes = MambaStateDtypeCalculator.short_conv_state_dtype(torch.float32, "auto")
    state = MambaSpec(block_size=1, shapes=shapes, dtypes=dtypes, mamba_type=MambaAttentionBackendEnum.SHORT_CONV)
    block_size = 32 * -(-state.page_size_bytes // (32 * attention(1).page_size_bytes))
    attn = attention(block_size)
    padded = dataclasses.replace(state, block_size=block_size, page_size_padded=attn.page_size_bytes,
                                 mamba_cache_mode="align")
    return {f"model.layers.{i}.{'attn' if i % 2 else 'mixer'}": attn if i % 2 else padded
            for i in range(num_layers)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("model"))


@pytest.fixture
def build(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engines]:
    """Engines on vLLM's scheduler, shut down after the test (also on releases the adapter does not yet declare
    tested: that refusal is compat.py's business, not this test's)."""
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    engines = Engines(model_dir)
    yield engines
    engines.close()


# ---- speculative decoding --------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def flawed_drafter(engine: Engine, req_id: str) -> list[int]:
    """Proposes the model's own next three tokens with one wrong (the second or the third, alternately), so each
    verification accepts some drafts and rejects the rest. Stands in for vLLM's n-gram proposer, which the
    stand-in model's tokens would never match."""
    known = list(engine.scheduler.requests[req_id].all_token_ids)
    drafts = engine.model.reference(known, 3)
    wrong = 1 if len(known) % 2 else 2
    drafts[wrong] = (drafts[wrong] + 1) % VOCAB
    return drafts


def test_a_block_filled_while_speculating_is_stored_only_with_the_accepted_tokens_kv(build: Engines) -> None:
    """a's prompt ends four tokens before a block boundary, so the step that verifies its first drafts fills
    block 3 and leaves a rejected draft's KV in it; kvoffload must store that block only once a later step
    recomputed the position. After vLLM's prefix cache is emptied, b starts with a's first four blocks."""
    engine = build(speculative=NGRAM)
    engine.drafter = flawed_drafter
    prompt = tokens(30, 60)
    engine.add_request("a", prompt, 20)
    engine.step()  # the prefill, and the first drafts
    verify = engine.step()
    assert verify.num_scheduled_tokens == {"a": 4}  # positions 60-63: a token and three drafts
    # The sharpness of this test: position 62 holds the KV of the rejected draft, in block 3, for now.
    assert {w.position for w in engine.kv_differences("a", range(60, 63))} == {62}
    engine.run()
    engine.reset_prefix_cache()
    engine.add_request("b", prompt + engine.records["a"].output[:6] + tokens(31, 5), 4)
    engine.run()
    drafted, accepted = engine.drafts
    assert 0 < accepted < drafted  # drafts were verified, some accepted, some rejected
    assert engine.records["b"].external_cached_tokens == 64  # block 3 (tokens 48-63) too
    assert_served_right(engine, "a", "b")


# ---- hybrid layouts --------------------------------------------------------------------------------------------


def test_a_sliding_window_model_loads_the_window_and_every_full_attention_block(build: Engines) -> None:
    engine = build(hybrid_window(4, window=32))
    assert len(engine.scheduler.kv_cache_config.kv_cache_groups) == 2
    prompt = tokens(40, 100)
    store_then_reset(engine, {"a": prompt}, max_tokens=10)
    engine.add_request("b", prompt[:96] + tokens(41, 7), 8)
    meta = engine.step().kv_connector_metadata
    assert isinstance(meta, KVOffloadMetadata)
    (load,) = meta.meta.load_jobs
    assert isinstance(load.job.dst, DeviceBlocks)
    window_blocks, full_blocks = load.job.dst.block_ids[:6], load.job.dst.block_ids[6:]
    assert window_blocks[:4] == (NO_BLOCK,) * 4 and NO_BLOCK not in window_blocks[4:]  # the window's two blocks
    assert NO_BLOCK not in full_blocks
    engine.run()
    assert engine.records["b"].external_cached_tokens == 96
    assert_served_right(engine, "a", "b")


def test_the_control_a_corrupted_load_is_caught_in_a_sliding_window_model(build: Engines) -> None:
    engine = build(hybrid_window(4, window=32), extra={"inject_load_corruption": 1})
    prompt = tokens(40, 100)
    store_then_reset(engine, {"a": prompt}, max_tokens=10)
    engine.add_request("b", prompt[:96] + tokens(41, 7), 8)
    engine.run()
    assert engine.records["b"].external_cached_tokens == 96
    assert {w.req_id for w in engine.wrong} == {"b"}


def serve_state_model(engine: Engine) -> None:
    """Chunks of two 32-token blocks leave a state at tokens 64 and 128 (vLLM keeps a state only where a chunk
    ends); b starts with a's first 128 tokens."""
    prompt = tokens(50, 150)
    store_then_reset(engine, {"a": prompt})
    engine.add_request("b", prompt[:128] + tokens(51, 7), 6)
    engine.run()


def test_a_state_model_loads_the_state_where_the_prefix_ends_and_the_attention_blocks(build: Engines) -> None:
    engine = build(hybrid_state(4), max_num_batched_tokens=64)
    assert engine.model.block_size == 32
    serve_state_model(engine)
    assert engine.records["b"].external_cached_tokens == 128
    assert_served_right(engine, "a", "b")


def test_the_control_a_corrupted_state_load_is_caught_by_the_byte_comparison(build: Engines) -> None:
    engine = build(hybrid_state(4), max_num_batched_tokens=64, extra={"inject_load_corruption": 1})
    serve_state_model(engine)
    assert engine.records["b"].external_cached_tokens == 128
    assert engine.wrong and {w.layer for w in engine.wrong} <= {"model.layers.0.mixer", "model.layers.2.mixer"}
    assert {(w.req_id, w.position, w.reason) for w in engine.wrong} == {("b", 127, "differs")}


# ---- vLLM 0.34's cap on loads in flight ------------------------------------------------------------------------

needs_inflight_cap = pytest.mark.skipif(
    "max_num_inflight_kv_loads" not in {f.name for f in dataclasses.fields(SchedulerConfig)},
    reason="this vLLM has no --max-num-inflight-kv-loads (vLLM 0.34 added it)")


def start_capped_loads(engine: Engine) -> dict[str, int]:
    """Two stored prefixes, then x1 and x2 (each a hit) and y (no hit) arrive together; one step, under a cap of
    one load in flight: returns the step's scheduled tokens."""
    p1, p2 = tokens(60, 64), tokens(61, 64)
    store_then_reset(engine, {"a1": p1, "a2": p2}, max_tokens=2)
    engine.add_request("x1", p1 + tokens(62, 3), 4)
    engine.add_request("x2", p2 + tokens(63, 3), 4)
    engine.add_request("y", tokens(64, 20), 4)
    return dict(engine.step().num_scheduled_tokens)


@needs_inflight_cap
def test_a_hit_past_the_inflight_load_cap_waits_without_holding_back_other_requests(build: Engines) -> None:
    engine = build(scheduler={"max_num_inflight_kv_loads": 1})
    scheduled = start_capped_loads(engine)
    status = {r: engine.scheduler.requests[r].status for r in ("x1", "x2")}
    assert status == {"x1": RequestStatus.WAITING_FOR_REMOTE_KVS, "x2": RequestStatus.WAITING}
    assert scheduled == {"y": 20}
    engine.run()
    assert engine.records["x1"].external_cached_tokens == engine.records["x2"].external_cached_tokens == 64
    assert_served_right(engine, "x1", "x2", "y")


@needs_inflight_cap
def test_the_control_a_hit_vllm_is_told_will_not_load_async_holds_back_the_whole_waiting_queue(
        build: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``may_load_async`` answering no, x2 waits in vLLM's plain waiting queue, and a load past the cap there
    ends the step's whole waiting scan: y is not admitted."""
    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    monkeypatch.setattr(KVOffloadConnector, "may_load_async", lambda self, request: False)
    engine = build(scheduler={"max_num_inflight_kv_loads": 1})
    assert "y" not in start_capped_loads(engine)
