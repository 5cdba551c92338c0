"""``kvoffload bench remote``: host<->remote GB/s of ``RemoteHandler`` beside raw redis-py pipelines of the same
bytes on the same server.

Per block size, each round stores ``--total-mib`` of blocks through a real handler (one job, submit to wait:
planning, header, CRC32C, the value's one copy, one ``SET NX`` pipeline), then sends the same payload bytes, ready
made as ``bytes``, in one raw redis-py pipeline of plain ``SET``; then loads both back: the handler verifies every
value and copies its payload into the host pool, the raw side only receives the replies (one ``GET`` pipeline).
Both sides use redis-py with the same parser (hiredis when installed) over one TCP connection to one server on
127.0.0.1; the server is flushed between rounds (not timed) and which side goes first alternates round by round.
Rows report medians over rounds and the ratio handler / raw. Then the lookup figure: the scheduler's
``RemoteTierManager`` looks up a 2,048-key prompt whose values are all on the server (answers not cached: a fresh
manager each round), median milliseconds. Without ``--url`` the bench starts its own ``redis-server``
(``testing.redis_server``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from kvoffload.bench.disk import KIB, MIB, _size


@dataclass(frozen=True)
class Row:
    block_bytes: int
    blocks: int
    store_gbps: float
    raw_set_gbps: float
    store_ratio: float
    load_gbps: float
    raw_get_gbps: float
    load_ratio: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", default="64K,1M,4M",
                        help="comma-separated block sizes with K/M suffix (default 64K,1M)")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per round and direction")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per block size (median reported)")
    parser.add_argument("--url", default=None, help="a server to use (default: start a redis-server here); "
                                                    "it is FLUSHALLed between rounds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def bench_block_size(url: str, block_bytes: int, args: argparse.Namespace) -> Row:
    import redis
    import torch

    from kvoffload.config import RemoteTierConfig
    from kvoffload.keys import Namespace
    from kvoffload.transfer.host_pool import HostPool
    from kvoffload.transfer.remote import RemoteHandler

    blocks = max(1, args.total_mib * MIB // block_bytes)
    pool = HostPool(blocks, block_bytes)
    pool.buffer.copy_(torch.randint(-128, 128, (blocks, block_bytes), dtype=torch.int8))
    payloads = [bytes(pool.buffer[i].numpy()) for i in range(blocks)]
    ns = Namespace(model="bench", dtype="int8", layout=f"bench-{block_bytes}")
    handler = RemoteHandler(RemoteTierConfig(urls=(url,), timeout_s=30.0), pool, ns, (block_bytes,))
    raw = redis.Redis.from_url(url, socket_timeout=30.0)
    # The raw side runs on a thread of its own too, as the handler's lanes do: replies allocated on the main
    # thread come from another malloc arena and measured up to 1.6x slower here.
    raw_thread = ThreadPoolExecutor(1, thread_name_prefix="bench-raw")
    times: dict[str, list[float]] = {k: [] for k in ("store", "set", "load", "get")}
    try:
        for rnd in range(args.rounds):
            store, load = _jobs(rnd, blocks)
            sets = [("SET", f"raw:{i}", p) for i, p in enumerate(payloads)]
            gets = [("GET", f"raw:{i}") for i in range(blocks)]
            writes: dict[str, Callable[[], float]] = {
                "store": functools.partial(_run, handler, store),
                "set": functools.partial(_on, raw_thread, functools.partial(_raw, raw, sets))}
            reads: dict[str, Callable[[], float]] = {
                "load": functools.partial(_run, handler, load),
                "get": functools.partial(_on, raw_thread, functools.partial(_raw, raw, gets))}
            for sides in (writes, reads):
                # Which side goes first alternates: the first writer into a flushed server pays for its memory
                # growing, the second reader finds warmer caches.
                for side in sorted(sides, reverse=rnd % 2 == 1):
                    times[side].append(sides[side]())
            raw.flushall()
    finally:
        handler.shutdown()
        raw_thread.shutdown()
        raw.close()
    gbps = {k: blocks * block_bytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return Row(block_bytes, blocks, gbps["store"], gbps["set"], gbps["store"] / gbps["set"], gbps["load"],
               gbps["get"], gbps["load"] / gbps["get"])


def _jobs(rnd: int, blocks: int) -> tuple[Any, Any]:
    from kvoffload.keys import offload_key
    from kvoffload.specs import HostBlocks, JobId, RemoteBlocks, TransferJob

    keys = tuple(offload_key(rnd.to_bytes(4, "little") + i.to_bytes(8, "little"), 0)  # type: ignore[arg-type]
                 for i in range(blocks))
    host, remote = HostBlocks(tuple(range(blocks)), (blocks,)), RemoteBlocks(keys, (blocks,))
    return TransferJob(JobId(2 * rnd), host, remote), TransferJob(JobId(2 * rnd + 1), remote, host)


def _run(handler: Any, job: Any) -> float:
    start = time.perf_counter()
    handler.submit(job)
    handler.wait([job.job_id])
    elapsed = time.perf_counter() - start
    (result,) = handler.get_finished()
    if not result.success:
        raise RuntimeError(f"bench remote: job {job.job_id} failed (see the log)")
    return elapsed


def _on(thread: ThreadPoolExecutor, measure: Callable[[], float]) -> float:
    return thread.submit(measure).result()


def _raw(client: Any, commands: list[tuple[Any, ...]]) -> float:
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies = pipe.execute()
    elapsed = time.perf_counter() - start
    if any(r is None for r in replies):
        raise RuntimeError("bench remote: a raw GET missed")
    return elapsed


def run(args: argparse.Namespace) -> int:
    from kvoffload.testing.redis_server import RedisServer

    sizes = [_size(s) for s in args.block_sizes.split(",")]
    server = None if args.url else RedisServer({"maxmemory": "0"})
    try:
        url = args.url or server.url  # type: ignore[union-attr]
        rows = [bench_block_size(url, size, args) for size in sizes]
        lookup_ms = bench_lookup(url, args.rounds)
    finally:
        if server is not None:
            server.stop()
    _report(rows, lookup_ms, args)
    return 0


LOOKUP_KEYS = 2048


def bench_lookup(url: str, rounds: int) -> float:
    """Median ms of one ``RemoteTierManager.lookup`` of a 2,048-key prompt, every value present."""
    from kvoffload.config import RemoteTierConfig
    from kvoffload.disk_format import PLAIN
    from kvoffload.keys import Namespace, offload_key
    from kvoffload.manager.remote import RemoteTierManager
    from kvoffload.remote_client import connect, value_name

    config = RemoteTierConfig(urls=(url,))
    ns = Namespace(model="bench", dtype="int8", layout="lookup")
    keys = [offload_key(i.to_bytes(16, "little"), 0) for i in range(LOOKUP_KEYS)]  # type: ignore[arg-type]
    client = connect(config)
    client.flushall()
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.set(value_name(ns, PLAIN, key), b"v")
    pipe.execute()
    times = []
    for _ in range(rounds):
        manager = RemoteTierManager.create(config, ns, 1 << 20)
        start = time.perf_counter()
        found = manager.lookup(keys)
        times.append((time.perf_counter() - start) * 1e3)
        if found.hits != LOOKUP_KEYS:
            raise RuntimeError(f"bench remote: a lookup found {found.hits} of {LOOKUP_KEYS} values")
    client.flushall()
    client.close()
    return statistics.median(times)


def _parser() -> str:
    from redis.utils import HIREDIS_AVAILABLE

    return "hiredis" if HIREDIS_AVAILABLE else "python"


def _report(rows: list[Row], lookup_ms: float, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "lookup_2048_keys_ms": round(lookup_ms, 3),
                          "parser": _parser(), "rounds": args.rounds, "cpus": os.cpu_count()}, indent=2))
        return
    print(f"kvoffload bench remote: redis-py with the {_parser()} parser, one server on 127.0.0.1, "
          f"{args.rounds} rounds; raw = pipelined SET/GET of the same payload bytes")
    print(f"{'block':>8} {'blocks':>7} {'store':>7} {'raw SET':>8} {'ratio':>6} {'load':>7} {'raw GET':>8} "
          f"{'ratio':>6}   (GB/s)")
    for r in rows:
        print(f"{r.block_bytes // KIB:>7}K {r.blocks:>7} {r.store_gbps:>7.2f} {r.raw_set_gbps:>8.2f} "
              f"{r.store_ratio:>6.2f} {r.load_gbps:>7.2f} {r.raw_get_gbps:>8.2f} {r.load_ratio:>6.2f}")
    print(f"lookup of a {LOOKUP_KEYS}-key prompt (every value present, no cached answers): {lookup_ms:.2f} ms")
