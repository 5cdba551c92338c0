"""Retention hints through vLLM's OpenAI server: turn 1 of a session carries
``kv_transfer_params: {"kvoffload": {"retain_s": 600}}``; one-off prompts then flood the host tier (more new
blocks than it holds, and more than the device cache, which keeps nothing of the session either); turn 2 (turn 1's
prompt, its answer and a new question) loads its prefix from the host tier and completes as computed KV does. The
control, in the same test and server, is the same sequence without the hint: turn 2 recomputes (no hit). The
retention series on /metrics count the hint, the retained bytes and the hits on retained blocks; a bad hint and a
hint above ``max_retain_s`` do not fail their requests and are counted as ignored and capped.

One server serves every test here (a server costs tens of seconds to start on two cores). The control and the
hinted session run the same tokens under different ``cache_salt``s: the salt makes their blocks distinct, so the
control's turn 2, computed, is what the hinted turn 2, loaded, must match.

The same on a node pool with two engines: turn 1 and the flood run on another engine (``tier_engine``'s flood
mode, in its own process, the hint in ``extra_args`` as the OpenAI server passes it), turn 2 through the server;
the deadline lives in the pool's shared index, so the other engine's hint keeps the blocks through its own flood.
This test starts its own server and engine (last in the module, while the first server idles).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.conftest import BLOCK_SIZE, DEVICE_BLOCKS, MAX_MODEL_LEN
from tests.e2e.test_tenants import BLOCK_BYTES, HOST_BLOCKS, ROOT, assert_same_completion, read_line, series

from kvoffload.tools.bench.serve_server import Server, ServerSettings

pytestmark = pytest.mark.e2e

PREFIX_TOKENS = 6 * BLOCK_SIZE  # turn 1's prompt: 6 blocks, within the retained share of the host tier (8 of 16)
QUESTION_TOKENS = 40  # turn 2's new text after turn 1's prompt and answer
FLOOD_TOKENS = 7 * BLOCK_SIZE
FLOODS = 6  # 42 new blocks: the host tier over twice, the device cache (15 blocks) many times
MAX_RETAIN_S = 900
SESSION_HINT = {"kvoffload": {"retain_s": 600}}
POOL_BLOCKS = 24
"""The node pool's slots. The other engine (an in-process ``vllm.LLM``) stops stepping when a prompt is answered,
so that prompt's stores are still in flight, their slots no victims, when the next prompt of the flood reserves its
own: the pool must hold the 6 retained blocks and two prompts of the flood (14 blocks), or the sweep, finding no
other victim, takes retained ones (as it should; with 16 slots it took 4 of the 6). 42 blocks still flood it."""


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("sessions")
    extra: dict[str, object] = {"host_bytes": HOST_BLOCKS * BLOCK_BYTES, "max_retain_s": MAX_RETAIN_S}
    settings = ServerSettings(model_dir, BLOCK_SIZE, DEVICE_BLOCKS, MAX_MODEL_LEN, "bfloat16", extra)
    with Server(settings, tmp / "server.log") as running:
        yield running


def complete(server: Server, prompt: list[int], salt: str, hint: dict[str, Any] | None = None) -> dict[str, Any]:
    """One greedy completion through /v1/completions; ``hint`` goes in the body's ``kv_transfer_params``."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
                            "cache_salt": salt, "return_token_ids": True}
    if hint is not None:
        body["kv_transfer_params"] = hint
    request = urllib.request.Request(f"{server.base_url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        choice: dict[str, Any] = json.loads(r.read())["choices"][0]
    return choice


def hints(server: Server) -> dict[str, float]:
    return {outcome: series(server, "retention_hints_total", outcome=outcome)
            for outcome in ("received", "capped", "ignored")}


class Turns:
    """A session's two turns with a flood between them: the completions, and the tokens each turn loaded."""

    def __init__(self, server: Server, salt: str, hint: dict[str, Any] | None) -> None:
        rng = random.Random(7)  # the same tokens in every session: only the salt and the hint differ
        prompt = [rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)]
        before = series(server, "hit_tokens_total")
        self.first = complete(server, prompt, salt, hint)
        self.first_loaded = series(server, "hit_tokens_total") - before
        for _ in range(FLOODS):
            complete(server, [rng.randrange(10, 1000) for _ in range(FLOOD_TOKENS)], "flood")
        self.retained_after_flood = series(server, "retained_bytes", tier="host")
        question = [rng.randrange(10, 1000) for _ in range(QUESTION_TOKENS)]
        before = series(server, "hit_tokens_total")
        self.second = complete(server, prompt + self.first["token_ids"] + question, salt, hint)
        self.second_loaded = series(server, "hit_tokens_total") - before


def test_a_hinted_session_resumes_from_the_host_tier_after_a_flood_and_an_unhinted_one_recomputes(
        server: Server) -> None:
    # The control: no hint, the flood evicts turn 1's blocks, turn 2 computes them again.
    before = hints(server)
    control = Turns(server, "control", None)
    assert control.second_loaded == 0
    assert control.retained_after_flood == 0
    assert hints(server) == before
    retained_hits = series(server, "retained_hit_blocks_total", tier="host")
    session = Turns(server, "session", SESSION_HINT)
    assert session.first_loaded == 0  # the salt keeps the control's blocks apart
    assert session.first["text"] == control.first["text"]
    assert session.retained_after_flood >= PREFIX_TOKENS // BLOCK_SIZE * BLOCK_BYTES  # kept through the flood
    assert session.second_loaded >= PREFIX_TOKENS  # turn 1's blocks, loaded from the host tier
    assert_same_completion(session.second, control.second)  # loaded KV completes as the control's computed KV
    assert series(server, "retained_hit_blocks_total", tier="host") - retained_hits >= PREFIX_TOKENS // BLOCK_SIZE
    after = hints(server)
    assert (after["received"] - before["received"], after["capped"], after["ignored"]) == (
        2, before["capped"], before["ignored"])  # one hint per turn, below the cap


def test_a_bad_hint_is_ignored_and_counted_and_the_request_completes(server: Server) -> None:
    before = hints(server)
    choice = complete(server, [5, 6, 7, 8], "bad", {"kvoffload": {"retain_s": "soon"}})
    assert len(choice["token_ids"]) == 8
    after = hints(server)
    assert after["ignored"] - before["ignored"] == 1
    assert after["received"] == before["received"]


def test_a_hint_above_max_retain_s_is_capped_and_counted(server: Server) -> None:
    before = hints(server)
    complete(server, [9, 10, 11, 12], "long", {"kvoffload": {"retain_s": 100_000}})
    after = hints(server)
    assert after["capped"] - before["capped"] == 1
    assert after["received"] - before["received"] == 1  # a capped hint is a received one too
    assert after["ignored"] == before["ignored"]


# ---- the node pool: the hint given on one engine, the session resumed on the other ----------------------------------


class Flooder:
    """The other engine (``tier_engine``'s flood mode, in its own process) on the node pool the server uses."""

    def __init__(self, engine: subprocess.Popen[str]) -> None:
        assert engine.stdin is not None
        self.engine, self.stdin = engine, engine.stdin

    def turn(self, prompt: list[int], salt: str, hint: dict[str, Any] | None) -> list[int]:
        """Serve one turn of a session (the hint passed as the OpenAI server passes it); its answer's tokens."""
        spec = {"prompt": prompt, "salt": salt, **({"kv_transfer_params": hint} if hint is not None else {})}
        self._send(json.dumps(spec))
        token_ids: list[int] = json.loads(read_line(self.engine))["token_ids"]
        return token_ids

    def flood(self, seed: int) -> None:
        self._send(str(seed))
        assert read_line(self.engine) == "flooded\n"

    def _send(self, line: str) -> None:
        self.stdin.write(line + "\n")
        self.stdin.flush()


class PoolTurns:
    """Turn 1 and the flood on the other engine, turn 2 through the server: the server's completion of turn 2, and
    the tokens it loaded."""

    def __init__(self, server: Server, other: Flooder, salt: str, hint: dict[str, Any] | None, seed: int) -> None:
        rng = random.Random(7)  # the same tokens in every session: only the salt and the hint differ
        prompt = [rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)]
        answer = other.turn(prompt, salt, hint)
        other.flood(seed)  # new blocks every time: each flood its own seed
        question = [rng.randrange(10, 1000) for _ in range(QUESTION_TOKENS)]
        before = series(server, "hit_tokens_total")
        self.second = complete(server, prompt + answer + question, salt, hint)
        self.second_loaded = series(server, "hit_tokens_total") - before


def test_on_a_node_pool_a_session_hinted_on_one_engine_resumes_on_the_other_after_a_flood(
        model_dir: Path, node_path: Path, tmp_path: Path) -> None:
    extra: dict[str, object] = {"host_bytes": POOL_BLOCKS * BLOCK_BYTES, "host_scope": "node",
                                "node_path": str(node_path), "max_retain_s": MAX_RETAIN_S}
    spec = {"extra_config": extra, "rounds": [], "announce": True,
            "flood": {"salt": "flood", "prompts": FLOODS, "tokens": FLOOD_TOKENS}}
    with open(tmp_path / "other.log", "w") as log:
        engine = subprocess.Popen([sys.executable, "-m", "tests.e2e.tier_engine", str(model_dir), json.dumps(spec)],
                                  cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            other = Flooder(engine)
            settings = ServerSettings(model_dir, BLOCK_SIZE, DEVICE_BLOCKS, MAX_MODEL_LEN, "bfloat16", extra)
            with Server(settings, tmp_path / "server.log") as running:  # starts beside the other engine
                assert read_line(engine) == "serving\n"
                control = PoolTurns(running, other, "control", None, seed=1)
                assert control.second_loaded == 0  # the other engine's flood evicted turn 1's blocks from the pool
                retained_hits = series(running, "retained_hit_blocks_total", tier="host")
                session = PoolTurns(running, other, "session", SESSION_HINT, seed=2)
                assert session.second_loaded >= PREFIX_TOKENS  # held in the pool by the other engine's hint
                assert_same_completion(session.second, control.second)
                # The pool's figures, every engine's blocks counted: the server's turn 2 used the retained blocks.
                assert series(running, "retained_hit_blocks_total", tier="host") - retained_hits >= (
                    PREFIX_TOKENS // BLOCK_SIZE)
        finally:
            engine.stdin.close()  # type: ignore[union-attr]
            engine.wait(timeout=120)
    assert engine.returncode == 0
