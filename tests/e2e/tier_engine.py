"""One vLLM engine with a shared tier (remote, node, object), in its own process, for test_remote_tier.py,
test_node_tier.py and test_object_tier.py.

Run as ``python -m tests.e2e.tier_engine MODEL_DIR REQUEST_JSON``: it builds an in-process engine on the tiny
model with ``kv_connector_extra_config`` from the request, serves the request's rounds of prompts (one request at
a time, the device prefix cache reset before each round), and prints one JSON line: per round the generated
tokens, top logprobs and cached tokens of each prompt, and kvoffload's counters. With ``"announce": true`` it
prints ``serving`` first, once the engine is up; with ``"hold": true`` too, it then waits for a line on its stdin
before serving (so a test starts it beside another engine, overlapping the start-ups, and lets it serve when the
other is done); with ``"hold_before": [i, ...]`` it prints ``round i`` before round ``i`` and waits for a line
(so a test can break the store between rounds); with ``"loop": true`` it then serves its rounds again and again
(loads, pins and stores without end) until it is killed. ``counters`` are kvoffload's counters at the end,
``round_counters`` the same after each round. With ``"flood": {"salt": S, "prompts": N, "tokens": T}`` it serves
no rounds: it prints ``serving`` once up, then for each line on its stdin (its text the seed) serves N new prompts
of T random tokens with the cache salt S, printing ``flooded`` after each, until its stdin closes
(test_tenants.py's flooding tenant); a line that is a JSON object ``{"prompt": [...], "salt": S,
"kv_transfer_params": {...}}`` (the last optional) is one turn of a session instead: it serves that prompt (8 greedy
tokens, ``kv_transfer_params`` passed as vLLM's OpenAI server passes it) and prints ``{"token_ids": [...]}``
(test_sessions.py's other engine).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import vllm
from tests.e2e.conftest import close, generate, make_llm, metric, prompts
from vllm.inputs import TokensPrompt


def main(model_dir: str, request: str) -> None:
    result_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM (and its C++ code) log to stdout: only our lines go to the real one
    spec = json.loads(request)
    llm = make_llm(Path(model_dir), spec["extra_config"])
    if spec.get("announce"):
        os.write(result_fd, b"serving\n")
    if "flood" in spec:
        flood(llm, spec["flood"], result_fd)
        close(llm)
        return
    if spec.get("hold"):
        sys.stdin.readline()
    rounds = []
    round_counters = []
    for i, tail in enumerate(spec["rounds"]):
        if i in spec.get("hold_before", ()):
            os.write(result_fd, f"round {i}\n".encode())
            sys.stdin.readline()
        assert llm.reset_prefix_cache()
        rounds.append([{"tokens": r.tokens, "logprobs": [list(p.items()) for p in r.logprobs],
                        "cached": r.cached_tokens} for r in generate(llm, prompts(tail))])
        round_counters.append(counters(llm))
    os.write(result_fd, (json.dumps({"rounds": rounds, "counters": round_counters[-1],
                                     "round_counters": round_counters}) + "\n").encode())
    while spec.get("loop"):
        for tail in spec["rounds"]:
            assert llm.reset_prefix_cache()
            generate(llm, prompts(tail))
    close(llm)


def flood(llm: vllm.LLM, spec: dict[str, Any], result_fd: int) -> None:
    """Serve a round of new salted prompts for each line read (its text their seed), until stdin closes."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=1)
    for line in sys.stdin:
        if line.startswith("{"):
            turn(llm, json.loads(line), result_fd)
            continue
        rng = random.Random(int(line))
        for _ in range(spec["prompts"]):
            prompt = TokensPrompt(prompt_token_ids=[rng.randrange(10, 1000) for _ in range(spec["tokens"])],
                                  cache_salt=spec["salt"])
            llm.generate([prompt], params, use_tqdm=False)
        os.write(result_fd, b"flooded\n")


def turn(llm: vllm.LLM, spec: dict[str, Any], result_fd: int) -> None:
    """Serve one turn of a session; its hint, if any, rides in ``extra_args`` as the OpenAI server puts it."""
    extra = {"kv_transfer_params": spec["kv_transfer_params"]} if "kv_transfer_params" in spec else None
    params = vllm.SamplingParams(temperature=0.0, max_tokens=8, extra_args=extra)
    prompt = TokensPrompt(prompt_token_ids=spec["prompt"], cache_salt=spec["salt"])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    os.write(result_fd, (json.dumps({"token_ids": list(out.outputs[0].token_ids)}) + "\n").encode())


def counters(llm: vllm.LLM) -> dict[str, float]:
    return {"hit_tokens": metric(llm, "vllm:kvoffload_hit_tokens"),
            "remote_to_host": metric(llm, "vllm:kvoffload_transfer_bytes", direction="remote_to_host"),
            "host_to_remote": metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_remote"),
            "object_to_host": metric(llm, "vllm:kvoffload_transfer_bytes", direction="object_to_host"),
            "host_to_object": metric(llm, "vllm:kvoffload_transfer_bytes", direction="host_to_object"),
            "failed_jobs": metric(llm, "vllm:kvoffload_transfer_failed_jobs"),
            "node_cross_hits": metric(llm, "vllm:kvoffload_node_pool", counter="cross_hits")}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
