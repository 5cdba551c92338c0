"""``kvoffload simulate``: a multi-turn chat workload through the simulated engine, with kvoffload on.

Several conversations take turns; each turn's prompt is the whole conversation so far plus a new user message,
so it shares its prefix with the previous turn. The device cache holds far fewer blocks than the conversations
need, so earlier turns are evicted there and come back from kvoffload. Every device block is checked bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from dataclasses import dataclass

from kvoffload.config import OffloadConfig
from kvoffload.connector.stats import TransferStats
from kvoffload.testing.layouts import attention_layout
from kvoffload.testing.sim import SimEngine
from kvoffload.testing.sim_workload import close_engine


@dataclass(frozen=True)
class SimulateResult:
    turns: int
    prompt_tokens: int
    device_hit_tokens: int
    kvoffload_hit_tokens: int
    computed_tokens: int
    bytes_stored: int
    bytes_loaded: int
    store_gbps: float
    load_gbps: float
    wall_seconds: float
    verified_blocks: int
    corrupt_blocks: int

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served by kvoffload."""
        return self.kvoffload_hit_tokens / max(1, self.prompt_tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-tokens", type=int, default=256, help="new tokens per user message")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--device-blocks", type=int, default=256, help="engine blocks in the device cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--offload-block-tokens", type=int, default=64)
    parser.add_argument("--host-gib", type=float, default=1.0)
    parser.add_argument("--disk-path", default=None, help="also run a disk tier in this directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def simulate(args: argparse.Namespace) -> SimulateResult:
    raw: dict[str, object] = {"offload_block_tokens": args.offload_block_tokens, "host_gib": args.host_gib}
    if args.disk_path:
        raw["disk_path"] = args.disk_path
    config = OffloadConfig.from_dict(raw)
    # 4 layers of 8 KV heads x 64 (fp16): 32 KiB per layer and engine block of 16 tokens.
    layout, make_kv = attention_layout(4, num_blocks=args.device_blocks, block_size=args.block_size,
                                       num_kv_heads=8, head_size=64)
    engine = SimEngine(layout, make_kv, config, block_size=args.block_size)
    try:
        return _run_turns(engine, args)
    finally:
        close_engine(engine)  # the disk tier's table thread and engine number


def _run_turns(engine: SimEngine, args: argparse.Namespace) -> SimulateResult:
    rng = random.Random(args.seed)
    history = [[rng.randrange(1000) for _ in range(args.user_tokens)] for _ in range(args.conversations)]
    prompt_tokens = device_hits = loaded = 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            req = engine.add_request(f"c{c}-t{turn}", history[c], max_new_tokens=args.reply_tokens)
            engine.run()
            prompt_tokens += req.num_prompt_tokens
            device_hits += req.device_hit_tokens
            loaded += req.loaded_tokens
            history[c] = req.all_token_ids + [rng.randrange(1000) for _ in range(args.user_tokens)]
        if not args.json:
            print(f"turn {turn + 1}/{args.turns}: {loaded} tokens served by kvoffload so far", flush=True)
    wall = time.perf_counter() - start
    stats = functools.reduce(TransferStats.aggregate, engine.transfer_stats, TransferStats())
    store = stats.by_type.get("device_to_host")
    load = stats.by_type.get("host_to_device")
    return SimulateResult(
        turns=args.turns * args.conversations, prompt_tokens=prompt_tokens, device_hit_tokens=device_hits,
        kvoffload_hit_tokens=loaded, computed_tokens=engine.computed_tokens,
        bytes_stored=store.bytes if store else 0, bytes_loaded=load.bytes if load else 0,
        store_gbps=store.bytes / store.seconds / 1e9 if store and store.seconds else 0.0,
        load_gbps=load.bytes / load.seconds / 1e9 if load and load.seconds else 0.0, wall_seconds=wall,
        verified_blocks=engine.verified_blocks, corrupt_blocks=len(engine.corrupt_blocks))


def run(args: argparse.Namespace) -> int:
    result = simulate(args)
    summary = {**vars(result), "hit_rate": result.hit_rate}
    status = 1 if result.corrupt_blocks else 0
    if args.json:
        print(json.dumps(summary, indent=2))
        return status
    print(f"requests (turns x conversations): {result.turns}")
    print(f"prompt tokens:                    {result.prompt_tokens}")
    print(f"  from the device prefix cache:   {result.device_hit_tokens}")
    print(f"  from kvoffload (not recomputed): {result.kvoffload_hit_tokens}  (hit rate {result.hit_rate:.1%})")
    print(f"tokens computed:                  {result.computed_tokens}")
    print(f"bytes stored device->host:        {result.bytes_stored / 2**20:.1f} MiB at {result.store_gbps:.2f} GB/s")
    print(f"bytes loaded host->device:        {result.bytes_loaded / 2**20:.1f} MiB at {result.load_gbps:.2f} GB/s")
    print(f"loaded blocks checked bit for bit: {result.verified_blocks}, wrong: {result.corrupt_blocks}")
    print(f"wall time {result.wall_seconds:.1f} s")
    return status
