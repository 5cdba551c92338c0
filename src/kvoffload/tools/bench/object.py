"""``kvoffload bench object``: host<->object-store GB/s of ``ObjectHandler`` beside boto3's own PUT/GET of the same
bytes on the same server, requests per block, and the prefix search's round trips and time.

Per block size, each round runs the sides in an order that turns round by round, each on fresh object names. The
handler stores ``--total-mib`` of blocks (one job, submit to wait: headers, CRC32C or AES-256-GCM, ``PutObject``
requests from its pool of ``--io-threads``) and loads them back (ranged ``GetObject``s; every object verified, its
payload copied into the host pool). The raw side is what a user of boto3 writes for the same payload bytes, ready
made as ``bytes``: ``put_object`` and ``get_object(...)["Body"].read()`` from a thread pool of the same size, with
the same client settings (``tiers.object.client.connect``). Rows report medians over rounds, the ratios handler /
raw (target: at least 0.9) and the requests each block cost. Objects are deleted between sides (not timed). A
ratio is given two ways: of the two sides' medians, and ``paired``, the median of each round's own ratio (its two
sides ran back to back, under the same load from whatever else the machine runs); ``--json`` adds every round's
seconds. Each side's CPU time in this process per block (``client_cpu_ms``) is the client's own cost, which other
work on the machine hardly moves. ``--client-cpus`` and ``--server-cpus`` pin this process and the bench's own
server to CPUs of their own (``tools.bench.cpus``), so that the client's cost is seen apart from the server's on a
small machine.

The lookup figures: a fresh ``ObjectIndex`` (no cached answers) searches a 2,048-key prompt of which none, 1,500
or all 2,048 keys are stored, at each ``--fanouts``: median and worst milliseconds, search rounds and existence
requests (one-byte GETs). Without ``--endpoint`` the bench starts its own single-node Ceph cluster with radosgw
(``testing.ceph_rgw``, ~20 s); with it, credentials come from boto3's chain and ``--bucket`` must exist.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from kvoffload.testing.tier_conformance import answered_lookup
from kvoffload.tools.bench.cpus import parse_cpus, pin
from kvoffload.tools.bench.disk import KIB, MIB, _size, add_tier_secret_argument, sealed_ratio
from kvoffload.tools.bench.jobs import round_trip, timed_job

LOOKUP_KEYS = 2048
LOOKUP_STORED = (0, 1500, LOOKUP_KEYS)


@dataclass(frozen=True)
class Row:
    block_bytes: int
    blocks: int
    store_gbps: float
    raw_put_gbps: float
    store_ratio: float
    load_gbps: float
    raw_get_gbps: float
    load_ratio: float
    store_requests_per_block: float
    load_requests_per_block: float
    sealed_store_gbps: float | None = None
    sealed_load_gbps: float | None = None
    seconds: dict[str, list[float]] = field(default_factory=dict)
    """Each side's seconds, round by round (``store``, ``load``, ``put``, ``get``, ``sealed_*``)."""
    client_cpu_ms: dict[str, float] = field(default_factory=dict)
    """Each side's CPU time in this process per block, median over rounds (ms): the client's own cost, which the
    server's and other work's load hardly moves."""

    @property
    def store_ratio_paired(self) -> float:
        return paired_ratio(self.seconds["put"], self.seconds["store"])

    @property
    def load_ratio_paired(self) -> float:
        return paired_ratio(self.seconds["get"], self.seconds["load"])

    @property
    def sealed_store_ratio(self) -> float | None:
        return sealed_ratio(self.sealed_store_gbps, self.store_gbps)

    @property
    def sealed_load_ratio(self) -> float | None:
        return sealed_ratio(self.sealed_load_gbps, self.load_gbps)


@dataclass(frozen=True)
class Lookup:
    fanout: int
    stored: int
    found: int
    median_ms: float
    max_ms: float
    rounds: int
    requests: int


def paired_ratio(raw_s: list[float], handler_s: list[float]) -> float:
    """The median over rounds of raw seconds / handler seconds, each pair measured back to back in one round: the
    machine's load (other work on a shared machine) changes from round to round, and a pair sees the same."""
    return statistics.median(r / h for r, h in zip(raw_s, handler_s, strict=True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", default="64K,1M,4M",
                        help="comma-separated block sizes with K/M suffix (default 64K,1M,4M)")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per round and direction")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per block size (median reported)")
    parser.add_argument("--io-threads", type=int, default=8, help="requests in flight (handler and raw side)")
    parser.add_argument("--fanouts", default="4,8,16", help="lookup fan-outs to measure (default 4,8,16)")
    parser.add_argument("--endpoint", default=None, help="an S3 server to use (default: start Ceph RGW here)")
    parser.add_argument("--bucket", default="kvoffload-bench", help="the bucket (created on the bench's server)")
    parser.add_argument("--client-cpus", default=None,
                        help="run this process (handler and raw side alike) on these CPUs, e.g. 0 or 0-1")
    parser.add_argument("--server-cpus", default=None,
                        help="run the bench's own server (Ceph mon, OSD, radosgw) on these CPUs, e.g. 1")
    add_tier_secret_argument(parser, "objects")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from kvoffload.config import ObjectTierConfig

    sizes = [_size(s) for s in args.block_sizes.split(",")]
    client_cpus = parse_cpus(args.client_cpus, "--client-cpus") if args.client_cpus else None
    server_cpus = parse_cpus(args.server_cpus, "--server-cpus") if args.server_cpus else None
    if server_cpus is not None and args.endpoint is not None:
        raise ValueError("--server-cpus pins the bench's own server: it cannot pin one given by --endpoint")
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-ceph-") as directory:
        server, endpoint = None, args.endpoint
        if endpoint is None:
            server = _start_server(Path(directory), args.bucket)
            endpoint = server.endpoint
        try:
            _pin(server, server_cpus, client_cpus)
            config = ObjectTierConfig(bucket=args.bucket, endpoint=endpoint, timeout_s=30.0,
                                      io_threads=args.io_threads)
            rows = [bench_block_size(config, size, args) for size in sizes]
            lookups = [bench_lookup(config, int(f), stored, args.rounds)
                       for f in args.fanouts.split(",") for stored in LOOKUP_STORED]
        finally:
            if server is not None:
                server.stop()
    _report(rows, lookups, args)
    return 0


def _start_server(directory: Path, bucket: str) -> Any:
    """A Ceph cluster of the bench's own, its keys in this process's environment (boto3's chain reads them)."""
    from kvoffload.testing.ceph_rgw import CephRGW

    server = CephRGW(directory)
    os.environ.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key)
    admin = _client_of(server.endpoint, bucket)
    admin.create_bucket(Bucket=bucket)
    return server


def _pin(server: Any, server_cpus: set[int] | None, client_cpus: set[int] | None) -> None:
    """The server's daemons on ``server_cpus``, this process on ``client_cpus`` (None: where they are)."""
    if server_cpus is not None:
        for pid in server.running().values():
            pin(pid, server_cpus)
    if client_cpus is not None:
        pin(os.getpid(), client_cpus)


def _client_of(endpoint: str, bucket: str) -> Any:
    from kvoffload.config import ObjectTierConfig
    from kvoffload.tiers.object.client import connect

    return connect(ObjectTierConfig(bucket=bucket, endpoint=endpoint, timeout_s=60.0))


def bench_block_size(config: Any, block_bytes: int, args: argparse.Namespace) -> Row:
    import torch

    from kvoffload.auth import TierSecret
    from kvoffload.blocks import Medium
    from kvoffload.keys import Namespace
    from kvoffload.tiers.object.client import connect
    from kvoffload.tiers.object.handler import ObjectHandler
    from kvoffload.transfer.host_pool import HostPool

    blocks = max(1, args.total_mib * MIB // block_bytes)
    pool = HostPool(blocks, block_bytes)
    pool.buffer.copy_(torch.randint(-128, 128, (blocks, block_bytes), dtype=torch.int8))
    payloads = [bytes(pool.buffer[i].numpy()) for i in range(blocks)]
    ns = Namespace(model="bench", dtype="int8", layout=f"bench-{block_bytes}")
    handler = ObjectHandler(config, pool, ns, (block_bytes,))
    secret = TierSecret("bench --tier-secret", os.urandom(32))
    sealed = ObjectHandler(replace(config, secret=secret), pool, ns, (block_bytes,)) if args.tier_secret else None
    raw = connect(config, pool_size=args.io_threads)
    admin = _client_of(config.endpoint, config.bucket)  # its long timeout: a busy server's deletes are not timed
    threads = ThreadPoolExecutor(args.io_threads, thread_name_prefix="bench-raw")
    times: dict[str, list[float]] = {k: [] for k in ("store", "load", "put", "get", "sealed_store", "sealed_load")}
    cpu_s: dict[str, list[float]] = {k: [] for k in times}
    requests: dict[str, list[int]] = {"store": [], "load": []}
    try:
        for rnd in range(args.rounds):
            store, load = round_trip(rnd, blocks, Medium.OBJECT)
            names = [f"bench-raw/{rnd}/{i}" for i in range(blocks)]
            sides: dict[str, list[tuple[str, Callable[[], float]]]] = {
                "handler": [("store", partial(_counted, handler, store, requests["store"])),
                            ("load", partial(_counted, handler, load, requests["load"]))],
                "raw": [("put", partial(_raw_puts, raw, threads, config.bucket, names, payloads)),
                        ("get", partial(_raw_gets, raw, threads, config.bucket, names, block_bytes))]}
            if sealed is not None:
                sides["sealed"] = [("sealed_store", partial(timed_job, sealed, store)),
                                   ("sealed_load", partial(timed_job, sealed, load))]
            order = sorted(sides)
            for side in order[rnd % len(order):] + order[:rnd % len(order)]:
                for measure, run_side in sides[side]:
                    cpu = time.process_time()
                    times[measure].append(run_side())
                    cpu_s[measure].append(time.process_time() - cpu)
                _empty(admin, config.bucket)
    finally:
        handler.shutdown()
        if sealed is not None:
            sealed.shutdown()
        threads.shutdown()
    gbps = {k: blocks * block_bytes / statistics.median(v) / 1e9 for k, v in times.items() if v}
    per_block = {k: statistics.median(v) / blocks for k, v in requests.items()}
    return Row(block_bytes, blocks, gbps["store"], gbps["put"], gbps["store"] / gbps["put"], gbps["load"],
               gbps["get"], gbps["load"] / gbps["get"], per_block["store"], per_block["load"],
               gbps.get("sealed_store"), gbps.get("sealed_load"), {k: v for k, v in times.items() if v},
               {k: statistics.median(v) / blocks * 1e3 for k, v in cpu_s.items() if v})


def _counted(handler: Any, job: Any, requests: list[int]) -> float:
    before = handler.requests
    elapsed = timed_job(handler, job)
    requests.append(handler.requests - before)
    return elapsed


def _raw_puts(client: Any, threads: ThreadPoolExecutor, bucket: str, names: Sequence[str],
              payloads: Sequence[bytes]) -> float:
    start = time.perf_counter()
    pairs = zip(names, payloads, strict=True)
    list(threads.map(lambda pair: client.put_object(Bucket=bucket, Key=pair[0], Body=pair[1]), pairs))
    return time.perf_counter() - start


def _raw_gets(client: Any, threads: ThreadPoolExecutor, bucket: str, names: Sequence[str], nbytes: int) -> float:
    start = time.perf_counter()
    got = list(threads.map(lambda name: client.get_object(Bucket=bucket, Key=name)["Body"].read(), names))
    elapsed = time.perf_counter() - start
    if any(len(g) != nbytes for g in got):
        raise RuntimeError("bench object: a raw GET came back short")
    return elapsed


def _empty(client: Any, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})


def bench_lookup(config: Any, fanout: int, stored: int, rounds: int) -> Lookup:
    """A fresh index's lookup of a 2,048-key prompt whose first ``stored`` keys are in the bucket."""
    from kvoffload.keys import Namespace, offload_key
    from kvoffload.tiers.lower.block_format import BlockFormat
    from kvoffload.tiers.object.client import ObjectNames, connect
    from kvoffload.tiers.object.index import ObjectIndex

    config = replace(config, lookup_fanout=fanout, timeout_s=5.0)
    ns = Namespace(model="bench", dtype="int8", layout=f"lookup-{stored}")
    keys = [offload_key(i.to_bytes(16, "little"), 0) for i in range(LOOKUP_KEYS)]  # type: ignore[arg-type]
    names = ObjectNames(config, ns, BlockFormat.of(config.secret))
    client = connect(config, pool_size=16)
    with ThreadPoolExecutor(16) as threads:  # the search reads one byte: a byte stands in for a block
        list(threads.map(lambda key: client.put_object(Bucket=config.bucket, Key=names.of(key)[0], Body=b"v"),
                         keys[:stored]))
    times, counts = [], []
    for _ in range(rounds):
        index = ObjectIndex.create(config, ns, 1 << 20, client=client)
        start = time.perf_counter()
        found = answered_lookup(index, keys).hits  # the search, from the ask that starts it to its answer
        times.append((time.perf_counter() - start) * 1e3)
        counts.append((index.probe.rounds, index.probe.requests))
        index.probe.close()
        if found != stored:
            raise RuntimeError(f"bench object: a lookup found {found} of {stored} stored keys")
    _empty(_client_of(config.endpoint, config.bucket), config.bucket)  # 2,048 deletes: not within a lookup's timeout
    return Lookup(fanout, stored, found, statistics.median(times), max(times), max(c[0] for c in counts),
                  max(c[1] for c in counts))


def _report(rows: list[Row], lookups: list[Lookup], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps({"rows": [asdict(r) | {"sealed_store_ratio": r.sealed_store_ratio,
                                                "sealed_load_ratio": r.sealed_load_ratio,
                                                "store_ratio_paired": r.store_ratio_paired,
                                                "load_ratio_paired": r.load_ratio_paired} for r in rows],
                          "lookups": [asdict(x) for x in lookups], "rounds": args.rounds,
                          "io_threads": args.io_threads, "cpus": os.cpu_count(), "client_cpus": args.client_cpus,
                          "server_cpus": args.server_cpus}, indent=2))
        return
    pinned = "".join(f", {side} on CPUs {cpus}" for side, cpus in (("client", args.client_cpus),
                                                                   ("server", args.server_cpus)) if cpus)
    print(f"kvoffload bench object: boto3, {args.io_threads} requests in flight, {args.rounds} rounds{pinned}; raw = "
          f"put_object/get_object of the same payload bytes from the same number of threads; ratio = handler / raw "
          f"of the medians, paired = the median of each round's ratio")
    print(f"{'block':>8} {'blocks':>7} {'store':>7} {'raw PUT':>8} {'ratio':>6} {'paired':>6} {'load':>7} "
          f"{'raw GET':>8} {'ratio':>6} {'paired':>6} {'req/block':>10}   (GB/s)")
    for r in rows:
        print(f"{r.block_bytes // KIB:>7}K {r.blocks:>7} {r.store_gbps:>7.3f} {r.raw_put_gbps:>8.3f} "
              f"{r.store_ratio:>6.2f} {r.store_ratio_paired:>6.2f} {r.load_gbps:>7.3f} {r.raw_get_gbps:>8.3f} "
              f"{r.load_ratio:>6.2f} {r.load_ratio_paired:>6.2f} "
              f"{r.store_requests_per_block:>4.1f}/{r.load_requests_per_block:<4.1f}")
    print("client CPU per block (this process, ms): " + "; ".join(
        f"{r.block_bytes // KIB}K store {r.client_cpu_ms['store']:.2f} put {r.client_cpu_ms['put']:.2f} "
        f"load {r.client_cpu_ms['load']:.2f} get {r.client_cpu_ms['get']:.2f}" for r in rows))
    if args.tier_secret:
        print("with a throwaway tier secret (sealed: AES-256-GCM), the same blocks in the same rounds:")
        for r in rows:
            assert r.sealed_store_gbps is not None and r.sealed_load_gbps is not None
            print(f"{r.block_bytes // KIB:>7}K store {r.sealed_store_gbps:.3f} ({r.sealed_store_ratio:.2f} of "
                  f"plain) load {r.sealed_load_gbps:.3f} ({r.sealed_load_ratio:.2f} of plain)")
    print(f"lookup of a {LOOKUP_KEYS}-key prompt (fresh index, no cached answers):")
    print(f"{'fanout':>7} {'stored':>7} {'median ms':>10} {'max ms':>8} {'rounds':>7} {'requests':>9}")
    for x in lookups:
        print(f"{x.fanout:>7} {x.stored:>7} {x.median_ms:>10.1f} {x.max_ms:>8.1f} {x.rounds:>7} {x.requests:>9}")
