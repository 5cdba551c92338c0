"""``kvoffload bench faults``: the longest engine step while a shared store misbehaves, and a cross-engine hit's
TTFT on a healthy one, with the scheduler's lookups off the step (kvoffload) beside waiting for them on it (as
lookups did before issue 43).

The engine is the simulated one (``testing.sim``: the real scheduler and worker halves, no model), so a step's
time is the connector's and the tiers' alone. Its lower tier is the remote tier (a ``redis-server`` of the bench's
own) or, with ``--object``, the object tier (a Ceph RGW of its own, about a minute to start), reached through a
``FaultProxy``. Per fault (none, trickle, freeze, silent, black-holed connects) and side, a round runs on a fresh
engine with the tier's default timeouts: a prompt is stored and pushed out of the host (the store alone holds it);
the fault is switched on; a hit on that prompt, a new prompt and a prompt the host holds are run to the end; the
row gives the longest step and the median step of that phase, and whether every request finished. Target: the
longest step under each fault within 50 ms of the longest with no fault.

The node rows (``faults_node``): two engines on one node pool while another process holds the pool's index lock
for ``HOLD_S`` seconds, beside the same workload with the lock free.

The TTFT rows: one engine stores a prompt, a second one (fresh caches, the same store) serves a request starting
with it; TTFT is the time from ``add_request`` to its first token, median over rounds. The "on the step" side
wraps the index's lookup so that it waits for the search's answer, as the synchronous lookup did: the same code,
threads and data on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FAULTS = ("pass", "trickle", "freeze", "silent", "blackhole")
SIDES = ("off the step", "on the step")
COOLDOWN_S = 0.5
"""The breakers' cool-down here: the bench waits it out between phases."""


@dataclass(frozen=True)
class StepRow:
    tier: str
    fault: str
    side: str
    max_step_ms: float
    median_step_ms: float
    steps: int
    finished: bool


@dataclass(frozen=True)
class TtftRow:
    tier: str
    side: str
    median_ttft_ms: float
    steps: float
    """Median engine steps from the request's arrival to its first token."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="rounds per fault and side (default 3)")
    parser.add_argument("--object", action="store_true", help="also the object tier (starts a Ceph RGW)")
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")


def run(args: argparse.Namespace) -> int:
    from kvoffload.tools.bench.faults_node import node_rows

    step_rows: list[StepRow] = []
    ttft_rows: list[TtftRow] = []
    step_rows += [StepRow(**row) for row in node_rows(args.rounds)]
    for tier, store in _stores(args.object):
        with store as (make_engine, proxy):
            for fault in FAULTS:
                for side in SIDES:
                    step_rows.append(_step_row(tier, fault, side, make_engine, proxy, args.rounds))
            for side in SIDES:
                ttft_rows.append(_ttft_row(tier, side, make_engine, proxy, args.rounds))
    _report(step_rows, ttft_rows, args)
    return 0


EngineMaker = Callable[[], Any]


def _stores(with_object: bool) -> Iterator[tuple[str, Any]]:
    yield "remote", _remote_store()
    if with_object:
        yield "object", _object_store()


@contextmanager
def _remote_store() -> Iterator[tuple[EngineMaker, Any]]:
    from kvoffload.testing import sim_workload
    from kvoffload.testing.fault_proxy import FaultProxy
    from kvoffload.testing.redis_server import RedisServer

    with RedisServer() as server, FaultProxy("127.0.0.1", server.port) as proxy:
        def make() -> Any:
            return sim_workload.make_engine(host_blocks=4, remote_url=f"redis://{proxy.url_host}",
                                            remote_bytes=1 << 24, remote_breaker_cooldown_s=COOLDOWN_S)
        yield make, proxy


@contextmanager
def _object_store() -> Iterator[tuple[EngineMaker, Any]]:
    from urllib.parse import urlsplit

    from kvoffload.testing import sim_workload
    from kvoffload.testing.ceph_rgw import CephRGW
    from kvoffload.testing.fault_proxy import FaultProxy
    from kvoffload.tools.bench.object import _client_of

    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-faults-") as directory:
        server = CephRGW(Path(directory))
        try:
            os.environ.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key)
            _client_of(server.endpoint, "bench-faults").create_bucket(Bucket="bench-faults")
            where = urlsplit(server.endpoint)
            with FaultProxy(where.hostname or "127.0.0.1", where.port or 80) as proxy:
                def make() -> Any:
                    return sim_workload.make_engine(host_blocks=4, object_url="s3://bench-faults/sim",
                                                    object_endpoint=f"http://{proxy.url_host}",
                                                    object_bytes=1 << 24, object_breaker_cooldown_s=COOLDOWN_S)
                yield make, proxy
        finally:
            server.stop()


def _engine(make_engine: EngineMaker, side: str) -> Any:
    from kvoffload.testing.settled import wait_on_the_step

    engine = make_engine()
    if side == "on the step":
        wait_on_the_step(engine.scheduler.index.lower_indexes[0])
    return engine


def _step_row(tier: str, fault: str, side: str, make_engine: EngineMaker, proxy: Any, rounds: int) -> StepRow:
    from kvoffload.testing.fault_proxy import Fault
    from kvoffload.testing.sim import Status
    from kvoffload.testing.sim_workload import pushed_out, run_timed, tokens

    times: list[float] = []
    finished = True
    for r in range(rounds):
        engine = _engine(make_engine, side)
        prompt = pushed_out(engine, 1 + r, checked=False)
        proxy.set(Fault(fault))
        requests = [engine.add_request("hit", [*prompt, 7]), engine.add_request("new", tokens(16, seed=500 + r)),
                    engine.add_request("local", tokens(16, seed=1000 + 10 * (1 + r) + 2))]
        times += run_timed(engine, checked=False)
        finished = finished and all(q.status is Status.FINISHED for q in requests)
        proxy.set(Fault.PASS)
        engine.scheduler.index.close()
        time.sleep(COOLDOWN_S)  # the store's breakers close before the next round
    return StepRow(tier, fault, side, max(times) * 1e3, statistics.median(times) * 1e3, len(times), finished)


def _ttft_row(tier: str, side: str, make_engine: EngineMaker, proxy: Any, rounds: int) -> TtftRow:
    from kvoffload.testing.sim import Status
    from kvoffload.testing.sim_workload import run_timed, tokens

    ttfts: list[float] = []
    steps: list[int] = []
    for r in range(rounds):
        writer = make_engine()
        prompt = tokens(16, seed=700 + 10 * rounds * SIDES.index(side) + r)
        writer.add_request("stored", prompt)
        run_timed(writer, checked=False)
        writer.step()  # ships the write-through
        run_timed(writer, checked=False)
        reader = _engine(make_engine, side)
        started = time.perf_counter()
        request = reader.add_request("hit", [*prompt, 7])
        count = 0
        while request.status is not Status.FINISHED:
            reader.step()
            count += 1
        ttfts.append(time.perf_counter() - started)
        steps.append(count)
        if request.loaded_tokens != 16:
            raise RuntimeError(f"bench faults: the hit loaded {request.loaded_tokens} of 16 tokens")
        for engine in (writer, reader):
            engine.scheduler.index.close()
    return TtftRow(tier, side, statistics.median(ttfts) * 1e3, statistics.median(steps))


def _report(step_rows: list[StepRow], ttft_rows: list[TtftRow], args: argparse.Namespace) -> None:
    if args.json:
        args.json.write_text(json.dumps({"steps": [asdict(r) for r in step_rows],
                                         "ttft": [asdict(r) for r in ttft_rows], "rounds": args.rounds,
                                         "cpus": os.cpu_count()}, indent=2))
    print(f"kvoffload bench faults: simulated engine, the tiers' default timeouts, {args.rounds} rounds per row")
    print(f"{'tier':<7} {'fault':<10} {'lookups':<13} {'max step ms':>12} {'median ms':>10} {'steps':>7} "
          f"{'finished':>9} {'max - no fault':>15}")
    baseline = {(r.tier, r.side): r.max_step_ms for r in step_rows if r.fault in ("pass", "free")}
    for r in step_rows:
        extra = r.max_step_ms - baseline[(r.tier, r.side)]
        print(f"{r.tier:<7} {r.fault:<10} {r.side:<13} {r.max_step_ms:>12.1f} {r.median_step_ms:>10.3f} "
              f"{r.steps:>7} {r.finished!s:>9} {extra:>15.1f}")
    print(f"\n{'tier':<7} {'lookups':<13} {'hit TTFT ms':>12} {'steps':>6}  (a prompt another engine stored)")
    for t in ttft_rows:
        print(f"{t.tier:<7} {t.side:<13} {t.median_ttft_ms:>12.2f} {t.steps:>6.0f}")
