"""What a KV-aware router learns from an engine with kvoffload: real vLLM engines publish their KV events over ZMQ
(``--kv-events-config``) to NVIDIA Dynamo's real indexer (kvoffload.testing.router_indexer), issue 44.

One engine with a private host tier over a disk tier: after prompt P, the indexer scores P's full blocks on the
device, host and disk; once other prompts pushed P off the device, it still scores them on host (CPU) and no longer
on the device; once more prompts pushed P out of the host tier, on the disk (STORAGE) alone; once the disk evicted
it too, nothing. Then two engines on one node pool: after A ran P, the
indexer scores P on both (B through the pool's announcements). A control publishes the same engine's blocks in
kvoffload's former event shape (16-byte keys, no token ids): the indexer fails to decode that batch.

Each engine runs in its own process, driven line by line (this module's ``__main__``: one JSON prompt in, the
cached tokens out), so the test checks the indexer between requests. ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from tests.e2e.conftest import BLOCK_SIZE, PREFIX_TOKENS, generate, make_llm

from kvoffload.testing.router_indexer import IndexerUnavailable, RouterIndexer, WorkerScore, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FULL_BLOCKS = PREFIX_TOKENS // BLOCK_SIZE  # 6 of P's 200 tokens' blocks are full
HOST_SLOTS = 16
DISK_SLOTS = 60  # every block up to the host fillers (50) fits; with the disk fillers (72 more) P leaves the disk
SLOT_BYTES = 32 << 10
EVENTS_TIMEOUT_S = 30.0


def prompt(seed: int, length: int = PREFIX_TOKENS) -> list[int]:
    return [10 + (seed * 7919 + i * 104729) % 990 for i in range(length)]


P = prompt(1)
WARM_UP = prompt(2, 2 * BLOCK_SIZE + 5)
DEVICE_FILLERS = [prompt(s) for s in (3, 4, 5)]  # 18 blocks > 15 usable device blocks: P leaves the device
HOST_FILLERS = [prompt(s) for s in range(6, 10)]  # 4 x 6 more blocks through a 16-slot host: P leaves the host
POOL_FILLERS = [prompt(s) for s in range(10, 14)]
DISK_FILLERS = [prompt(s) for s in range(10, 22)]  # a disk block file is smaller than a host slot: more of them


class Engine:
    """One engine process (this module run as a script), publishing KV events on ``tcp://*:port``."""

    def __init__(self, model_dir: Path, extra_config: dict[str, Any], log: IO[str]) -> None:
        self.port = free_port()
        spec = {"extra_config": extra_config, "port": self.port}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.test_router_events", str(model_dir),
                                      json.dumps(spec)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def wait_serving(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "serving\n", "the engine exited before serving (see its log)"

    def run(self, token_ids: list[int]) -> int:
        """Serve one request; its cached tokens."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(token_ids) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the engine exited with {self.proc.wait()} (see its log)"
        return int(json.loads(line)["cached"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()


def blocks(score: WorkerScore) -> dict[str, int]:
    return {"longest": score.blocks, **score.tier_blocks()}


def report(figures: dict[str, dict[str, int]], title: str) -> None:
    print(f"\n{title} (blocks of P = {PREFIX_TOKENS} tokens, {FULL_BLOCKS} full blocks of {BLOCK_SIZE}):")
    for step, counts in figures.items():
        print(f"  {step:<34} " + "  ".join(f"{k}={v}" for k, v in counts.items()))


@pytest.fixture
def indexer_for() -> Iterator[Any]:
    started: list[RouterIndexer] = []

    def start(workers: dict[int, str]) -> RouterIndexer:
        try:
            indexer = RouterIndexer(workers, BLOCK_SIZE)
        except IndexerUnavailable as e:
            pytest.fail(str(e))  # make test sets it up: never a silent skip
        started.append(indexer)
        return indexer
    yield start
    for indexer in started:
        indexer.close()


def heard(indexer: RouterIndexer, engine: Engine, worker: int) -> WorkerScore:
    """Serve warm-up requests until the indexer scores one on the device: a PUB socket drops what it publishes
    before the indexer's subscription lands, and this says the engine's batches decode at all."""
    def scored() -> WorkerScore | None:
        engine.run(WARM_UP)
        s = indexer.worker_score(WARM_UP, worker)
        return s if s.gpu else None
    return indexer.wait_for(lambda: scored() or None, EVENTS_TIMEOUT_S, f"worker {worker}'s warm-up scored")


def test_the_host_then_the_disk_keep_p_scored_after_the_device_drops_it(
        model_dir: Path, indexer_for: Any, tmp_path: Path) -> None:
    figures: dict[str, dict[str, int]] = {}
    full = FULL_BLOCKS * BLOCK_SIZE
    extra = {"host_bytes": HOST_SLOTS * SLOT_BYTES, "disk_path": str(tmp_path / "disk"),
             "disk_bytes": DISK_SLOTS * SLOT_BYTES}
    with open(tmp_path / "engine.log", "w") as log:
        engine = Engine(model_dir, extra, log)
        try:
            engine.wait_serving()
            indexer = indexer_for({1: engine.endpoint})
            heard(indexer, engine, 1)

            engine.run(P)
            s = indexer.wait_for_blocks(P, 1, FULL_BLOCKS, tier="cpu", timeout=EVENTS_TIMEOUT_S)
            figures["after P"] = blocks(s)
            assert s.gpu == s.cpu == s.disk == full

            for filler in DEVICE_FILLERS:
                engine.run(filler)
            s = indexer.wait_for(lambda: (x := indexer.worker_score(P, 1)).gpu == 0 and x, EVENTS_TIMEOUT_S,
                                 "P off the device")
            figures["P pushed off the device"] = blocks(s)
            assert (s.blocks, s.gpu, s.cpu) == (FULL_BLOCKS, 0, full)  # the host keeps it

            for filler in HOST_FILLERS:
                engine.run(filler)
            s = indexer.wait_for(lambda: (x := indexer.worker_score(P, 1)).cpu < full and x, EVENTS_TIMEOUT_S,
                                 "P out of the host tier")
            figures["P pushed out of the host tier"] = blocks(s)
            assert (s.blocks, s.gpu, s.disk) == (FULL_BLOCKS, 0, full)  # the disk keeps it: STORAGE

            for filler in DISK_FILLERS:
                engine.run(filler)
            s = indexer.wait_for(lambda: (x := indexer.worker_score(P, 1)).disk < full and x, EVENTS_TIMEOUT_S,
                                 "P off the disk")
            figures["P pushed off the disk too"] = blocks(s)
            assert s.gpu == 0 and s.cpu < full and s.disk < full
            assert indexer.decode_failures() == 0, indexer.dropped_lines()
            assert engine.run(P) < full  # the engine agrees: P is no longer all held
        finally:
            engine.close()
    report(figures, "one engine, private host tier over a disk tier")


def test_old_event_shape_is_not_decoded(indexer_for: Any) -> None:
    """The control: kvoffload's former events (16-byte keys, empty token_ids, through vLLM's publisher) of P's
    blocks, beside a valid device event in the same batch: the indexer drops the whole batch."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

    port = free_port()
    publisher = EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                            endpoint=f"tcp://*:{port}"))
    try:
        indexer = indexer_for({1: f"tcp://127.0.0.1:{port}"})
        device = BlockStored(block_hashes=list(range(1, FULL_BLOCKS + 1)), parent_block_hash=None,
                             token_ids=P[:FULL_BLOCKS * BLOCK_SIZE], block_size=BLOCK_SIZE, lora_id=None,
                             medium="GPU", lora_name=None)
        old = BlockStored(block_hashes=[bytes([i]) * 16 for i in range(FULL_BLOCKS)], parent_block_hash=None,
                          token_ids=[], block_size=BLOCK_SIZE, lora_id=None, medium="CPU", lora_name=None)

        def dropped() -> int:
            publisher.publish(KVEventBatch(ts=time.time(), events=[device, old]))
            return indexer.decode_failures()
        assert indexer.wait_for(dropped, EVENTS_TIMEOUT_S, "a failed decode") >= 1
        assert indexer.worker_score(P, 1).blocks == 0
    finally:
        publisher.shutdown()


def test_both_engines_on_a_node_pool_score_p(model_dir: Path, indexer_for: Any, node_path: Path,
                                             tmp_path: Path) -> None:
    extra = {"host_bytes": HOST_SLOTS * SLOT_BYTES, "host_scope": "node", "node_path": str(node_path)}
    figures: dict[str, dict[str, int]] = {}
    with open(tmp_path / "engines.log", "w") as log:
        a, b = Engine(model_dir, extra, log), Engine(model_dir, extra, log)
        try:
            a.wait_serving()
            b.wait_serving()
            indexer = indexer_for({1: a.endpoint, 2: b.endpoint})
            heard(indexer, a, 1)
            heard(indexer, b, 2)
            a.run(P)
            s = indexer.wait_for_blocks(P, 1, FULL_BLOCKS, tier="cpu", timeout=EVENTS_TIMEOUT_S)
            figures["A after A ran P"] = blocks(s)
            b.run(WARM_UP)  # B reads the pool's announcements once a step
            figures["B before waiting"] = blocks(indexer.worker_score(P, 2))
            s = indexer.wait_for_blocks(P, 2, FULL_BLOCKS, tier="cpu", timeout=EVENTS_TIMEOUT_S)
            figures["B after A ran P"] = blocks(s)
            assert s.gpu == 0  # B holds P in the pool only

            for filler in HOST_FILLERS + POOL_FILLERS:  # A's stores push P out of the pool: both engines announce
                a.run(filler)                               # the removal (the pool evicts by CLOCK: two rounds)
            s = indexer.wait_for(lambda: (x := indexer.worker_score(P, 1)).cpu < FULL_BLOCKS * BLOCK_SIZE and x,
                                 EVENTS_TIMEOUT_S, "P out of the pool, for A")
            figures["A after P left the pool"] = blocks(s)
            def b_dropped() -> WorkerScore | None:
                b.run(WARM_UP)  # B reads the pool's announcements once a step
                x = indexer.worker_score(P, 2)
                return x if x.cpu < FULL_BLOCKS * BLOCK_SIZE else None
            s = indexer.wait_for(b_dropped, EVENTS_TIMEOUT_S, "P out of the pool, for B")
            figures["B after P left the pool"] = blocks(s)
            assert indexer.decode_failures() == 0, indexer.dropped_lines()
        finally:
            a.close()
            b.close()
    report(figures, "two engines, one node pool")


def serve(model_dir: str, spec_json: str) -> None:
    """The engine process: one prompt (a JSON list of token ids) per stdin line, ``{"cached": n}`` per line."""
    result = os.dup(1)
    os.dup2(2, 1)  # vLLM logs to stdout: only our lines go to the real one
    spec = json.loads(spec_json)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{spec['port']}"}
    llm = make_llm(Path(model_dir), spec["extra_config"], kv_events_config=events)
    os.write(result, b"serving\n")
    for line in sys.stdin:
        (r,) = generate(llm, [json.loads(line)])
        os.write(result, (json.dumps({"cached": r.cached_tokens}) + "\n").encode())


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
