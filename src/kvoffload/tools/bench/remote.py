"""``kvoffload bench remote``: host<->remote GB/s of ``RemoteHandler`` beside raw redis-py pipelines of the same
bytes on the same server.

Per block size, each round runs three sides, each into a server just flushed (not timed), in an order that turns
round by round. The handler stores ``--total-mib`` of blocks (one job, submit to wait: planning, headers, CRC32C,
the values' one copy into staging, ``SET NX`` pipelines) and loads them back (``GET`` pipelines; every value
verified, its payload copied into the host pool). The raw side sends the same payload bytes, ready made as
``bytes``, in one redis-py pipeline of plain ``SET`` with redis-py's defaults (hiredis packs every command, copying
each value once), and receives them in one pipeline of ``GET``. The in-place side is the raw ``SET`` again with the
packer the handler's client uses (``tiers.remote.client.in_place_connection``: values sent as they are): the best
redis-py does with these bytes. Every side uses the hiredis parser when installed and one TCP connection to one server
on 127.0.0.1. Rows report medians over rounds and the ratios handler / raw and handler / in place. Then the lookup
figure: the scheduler's ``RemoteIndex`` looks up a 2,048-key prompt whose values are all on the server (answers not
cached: a fresh manager each round), median milliseconds. Without ``--url`` the bench starts its own ``redis-server``
(``testing.redis_server``).

``--tier-secret``: a fourth side, a second handler given a throwaway secret, stores and loads the same blocks
sealed (AES-256-GCM, ``kvoffload.auth``) in the same rounds; its rows are reported beside the plain handler's with
the ratio sealed / plain (target: at least 0.9) and sealed / raw.
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
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvoffload.testing.tier_conformance import answered_lookup
from kvoffload.tools.bench.disk import KIB, MIB, _size, add_tier_secret_argument, sealed_ratio
from kvoffload.tools.bench.jobs import round_trip, timed_job


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
    raw_set_in_place_gbps: float
    """Raw ``SET`` with redis-py's Python packer, which sends values as they are (the handler's client does)."""
    store_ratio_in_place: float
    sealed_store_gbps: float | None = None
    sealed_load_gbps: float | None = None

    @property
    def sealed_store_ratio(self) -> float | None:
        return sealed_ratio(self.sealed_store_gbps, self.store_gbps)

    @property
    def sealed_load_ratio(self) -> float | None:
        return sealed_ratio(self.sealed_load_gbps, self.load_gbps)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", default="64K,1M,4M",
                        help="comma-separated block sizes with K/M suffix (default 64K,1M,4M)")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per round and direction")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per block size (median reported)")
    parser.add_argument("--url", default=None, help="a server to use (default: start a redis-server here); "
                                                    "it is FLUSHALLed between sides")
    add_tier_secret_argument(parser, "values")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def bench_block_size(url: str, block_bytes: int, args: argparse.Namespace) -> Row:
    import redis
    import torch

    from kvoffload.auth import TierSecret
    from kvoffload.blocks import Medium
    from kvoffload.config import RemoteTierConfig
    from kvoffload.keys import Namespace
    from kvoffload.tiers.remote.client import in_place_connection
    from kvoffload.tiers.remote.handler import RemoteHandler
    from kvoffload.transfer.host_pool import HostPool

    blocks = max(1, args.total_mib * MIB // block_bytes)
    pool = HostPool(blocks, block_bytes)
    pool.buffer.copy_(torch.randint(-128, 128, (blocks, block_bytes), dtype=torch.int8))
    payloads = [bytes(pool.buffer[i].numpy()) for i in range(blocks)]
    ns = Namespace(model="bench", dtype="int8", layout=f"bench-{block_bytes}")
    config = RemoteTierConfig(urls=(url,), timeout_s=30.0)
    handler = RemoteHandler(config, pool, ns, (block_bytes,))
    secret = TierSecret("bench --tier-secret", os.urandom(32))
    sealed = RemoteHandler(replace(config, secret=secret), pool, ns, (block_bytes,)) if args.tier_secret else None
    raw = redis.Redis.from_url(url, socket_timeout=30.0)  # redis-py's defaults: what a user of it writes
    raw_in_place = redis.Redis.from_url(url, socket_timeout=30.0, connection_class=in_place_connection("redis"))
    # The raw side runs on a thread of its own too, as the handler's lanes do: replies allocated on the main
    # thread come from another malloc arena and measured up to 1.6x slower here.
    raw_thread = ThreadPoolExecutor(1, thread_name_prefix="bench-raw")
    times: dict[str, list[float]] = {k: [] for k in ("store", "load", "set", "get", "set_in_place", "sealed_store",
                                                     "sealed_load")}
    sets = [("SET", f"raw:{i}", p) for i, p in enumerate(payloads)]
    gets = [("GET", f"raw:{i}") for i in range(blocks)]
    try:
        for rnd in range(args.rounds):
            store, load = round_trip(rnd, blocks, Medium.REMOTE)
            sides: dict[str, list[tuple[str, Callable[[], float]]]] = {
                "handler": [("store", functools.partial(timed_job, handler, store)),
                            ("load", functools.partial(timed_job, handler, load))],
                "raw": [("set", functools.partial(_on, raw_thread, functools.partial(_raw, raw, sets))),
                        ("get", functools.partial(_on, raw_thread, functools.partial(_raw, raw, gets)))],
                "in_place": [("set_in_place",
                              functools.partial(_on, raw_thread, functools.partial(_raw, raw_in_place, sets)))]}
            if sealed is not None:
                sides["sealed"] = [("sealed_store", functools.partial(timed_job, sealed, store)),
                                   ("sealed_load", functools.partial(timed_job, sealed, load))]
            # Every side writes into a server just flushed (a fuller server is slower to grow), and which side
            # goes first turns round by round (the first after a flush may find colder caches).
            names = sorted(sides)
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                raw.flushall()
                for measure, run_side in sides[name]:
                    times[measure].append(run_side())
            raw.flushall()
    finally:
        handler.shutdown()
        if sealed is not None:
            sealed.shutdown()
        raw_thread.shutdown()
        raw.close()
        raw_in_place.close()
    gbps = {k: blocks * block_bytes / statistics.median(v) / 1e9 for k, v in times.items() if v}
    return Row(block_bytes, blocks, gbps["store"], gbps["set"], gbps["store"] / gbps["set"], gbps["load"],
               gbps["get"], gbps["load"] / gbps["get"], gbps["set_in_place"], gbps["store"] / gbps["set_in_place"],
               gbps.get("sealed_store"), gbps.get("sealed_load"))


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
    """Median ms of one ``RemoteIndex.lookup`` of a 2,048-key prompt, every value present."""
    from kvoffload.config import RemoteTierConfig
    from kvoffload.keys import Namespace, offload_key
    from kvoffload.tiers.lower.block_format import PLAIN
    from kvoffload.tiers.remote.client import connect, value_name
    from kvoffload.tiers.remote.index import RemoteIndex

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
        manager = RemoteIndex.create(config, ns, 1 << 20)
        start = time.perf_counter()
        found = answered_lookup(manager, keys)  # the search, from the ask that starts it to its answer
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
        print(json.dumps({"rows": [asdict(r) | {"sealed_store_ratio": r.sealed_store_ratio,
                                                "sealed_load_ratio": r.sealed_load_ratio} for r in rows],
                          "lookup_2048_keys_ms": round(lookup_ms, 3),
                          "parser": _parser(), "rounds": args.rounds, "cpus": os.cpu_count()}, indent=2))
        return
    print(f"kvoffload bench remote: redis-py with the {_parser()} parser, one server on 127.0.0.1, "
          f"{args.rounds} rounds; raw = pipelined SET/GET of the same payload bytes")
    print(f"{'block':>8} {'blocks':>7} {'store':>7} {'raw SET':>8} {'ratio':>6} {'load':>7} {'raw GET':>8} "
          f"{'ratio':>6} {'SET in place':>13} {'ratio':>6}   (GB/s)")
    for r in rows:
        print(f"{r.block_bytes // KIB:>7}K {r.blocks:>7} {r.store_gbps:>7.2f} {r.raw_set_gbps:>8.2f} "
              f"{r.store_ratio:>6.2f} {r.load_gbps:>7.2f} {r.raw_get_gbps:>8.2f} {r.load_ratio:>6.2f} "
              f"{r.raw_set_in_place_gbps:>13.2f} {r.store_ratio_in_place:>6.2f}")
    if args.tier_secret:
        print("with a throwaway tier secret (sealed: AES-256-GCM), the same blocks in the same rounds:")
        print(f"{'block':>8} {'store':>7} {'vs pl':>6} {'vs raw':>7} {'load':>7} {'vs pl':>6} {'vs raw':>7}   "
              "(GB/s; vs pl = sealed / plain handler, target >= 0.9)")
        for r in rows:
            assert r.sealed_store_gbps is not None and r.sealed_load_gbps is not None
            print(f"{r.block_bytes // KIB:>7}K {r.sealed_store_gbps:>7.2f} {r.sealed_store_ratio:>6.2f} "
                  f"{r.sealed_store_gbps / r.raw_set_gbps:>7.2f} {r.sealed_load_gbps:>7.2f} "
                  f"{r.sealed_load_ratio:>6.2f} {r.sealed_load_gbps / r.raw_get_gbps:>7.2f}")
    print(f"lookup of a {LOOKUP_KEYS}-key prompt (every value present, no cached answers): {lookup_ms:.2f} ms")
