"""What Dynamo's real KV indexer makes of vLLM KV events, published through vLLM's own ZMQ publisher (issue 44).

Each test publishes a batch, then a marker batch, and waits for the marker: the indexer handles one publisher's
batches in order (per tier), so whatever the first batch did is done by then, indexed or dropped. The findings these
tests pin are listed in kvoffload/testing/router_indexer.py's docstring and docs/routing.md.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventPublisherFactory,
    KVCacheEvent,
    KVEventBatch,
)

from kvoffload.testing.router_indexer import IndexerUnavailable, RouterIndexer, free_port

BLOCK = 32
WORKER, OTHER = 1, 2
TIERS = {"GPU": "gpu", "CPU": "cpu", "STORAGE": "disk", "REMOTE": "disk"}
"""The media the indexer keeps apart, and the WorkerScore field that first counts each."""
_seeds = itertools.count(1)


class Engine:
    """One engine's event stream: vLLM's publisher, as vLLM builds it from ``--kv-events-config``."""

    def __init__(self, publisher: EventPublisher, indexer: RouterIndexer, worker_id: int) -> None:
        self.publisher, self.indexer, self.worker_id = publisher, indexer, worker_id

    def publish(self, *events: KVCacheEvent) -> None:
        """Publish one batch, then a marker batch, and return once the indexer indexed the marker.

        The indexer keeps each tier in its own structure and a query may see one tier's events before another's,
        so the marker stores a block on every tier and waits for all of them.
        """
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))
        markers = [(medium, *prompt(1)) for medium in TIERS]
        self.publisher.publish(KVEventBatch(ts=time.time(), events=[stored(h, t, m) for m, t, h in markers]))
        for medium, tokens, _ in markers:
            self.indexer.wait_for_blocks(tokens, self.worker_id, 1, tier=TIERS[medium])

    def score(self, tokens: Sequence[int], lora_name: str | None = None) -> tuple[int, int, int, int]:
        """(longest matched, gpu, cpu, disk) in blocks."""
        s = self.indexer.worker_score(tokens, self.worker_id, lora_name)
        return s.blocks, s.gpu // BLOCK, s.cpu // BLOCK, s.disk // BLOCK


def dropped_since(engine: Engine, before: int) -> int:
    """Dropped batches or blocks logged since ``before``: its log lags what it indexed, so wait for one first."""
    return engine.indexer.wait_for(lambda: engine.indexer.decode_failures() - before, 5.0, "a dropped-event line")


def prompt(blocks: int) -> tuple[list[int], list[int]]:
    """Tokens no other test uses, and an int block hash per block (distinct across the module)."""
    seed = next(_seeds)
    return [seed * 10_000 + i for i in range(blocks * BLOCK)], [seed * 100 + i for i in range(blocks)]


def stored(hashes: list[Any], tokens: list[int], medium: str | None, parent: int | None = None,
           **fields: Any) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=fields.pop("block_size", BLOCK), lora_id=None, medium=medium,
                       lora_name=fields.pop("lora_name", None), **fields)


def publisher(port: int) -> EventPublisher:
    return EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                       endpoint=f"tcp://*:{port}"))


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    ports = free_port(), free_port()
    pubs = [publisher(p) for p in ports]
    try:
        indexer = RouterIndexer({WORKER: f"tcp://127.0.0.1:{ports[0]}", OTHER: f"tcp://127.0.0.1:{ports[1]}"}, BLOCK)
    except IndexerUnavailable as e:
        for p in pubs:
            p.shutdown()
        pytest.skip(str(e))
    with indexer:
        pair = Engine(pubs[0], indexer, WORKER), Engine(pubs[1], indexer, OTHER)
        for engine in pair:  # a PUB socket drops what it sends before the indexer's subscription lands
            indexer.wait_for(lambda e=engine: _heard(e), 10.0, f"worker {engine.worker_id} heard")
        yield pair
    for p in pubs:
        p.shutdown()


def _heard(engine: Engine) -> bool:
    tokens, hashes = prompt(1)
    engine.publisher.publish(KVEventBatch(ts=time.time(), events=[stored(hashes, tokens, "GPU")]))
    return engine.indexer.worker_score(tokens, engine.worker_id).blocks == 1


@pytest.fixture
def engine(engines: tuple[Engine, Engine]) -> Iterator[Engine]:
    before = engines[0].indexer.decode_failures()
    yield engines[0]
    assert engines[0].indexer.decode_failures() == before, engines[0].indexer.dropped_lines()


def test_int_hashes_with_token_ids_are_scored_on_their_medium(engine: Engine) -> None:
    tokens, hashes = prompt(3)
    engine.publish(stored(hashes, tokens, "CPU"))
    assert engine.score(tokens) == (3, 0, 3, 3)
    assert engine.score(tokens + [7] * 40) == (3, 0, 3, 3)  # the prompt's full blocks, whatever follows


def test_bytes_hashes_and_no_token_ids_drop_the_whole_batch_with_the_device_event_in_it(
        engines: tuple[Engine, Engine]) -> None:
    """The control for decode_failures: kvoffload's former event shape."""
    engine = engines[0]
    before = engine.indexer.decode_failures()
    device_tokens, device_hashes = prompt(2)
    old_tokens, _ = prompt(2)
    old = [bytes(16 * [i]) for i in range(2)]
    engine.publish(stored(device_hashes, device_tokens, "GPU"), stored(old, [], "CPU"))
    assert engine.score(device_tokens) == (0, 0, 0, 0)
    assert engine.score(old_tokens) == (0, 0, 0, 0)
    assert dropped_since(engine, before) == 1
    assert "Failed to decode KvEventBatch" in engine.indexer.dropped_lines()[-1]


@pytest.mark.parametrize(("medium", "expected"), [
    ("GPU", (2, 2, 2, 2)), (None, (2, 2, 2, 2)), ("DEVICE", (2, 2, 2, 2)),
    ("CPU", (2, 0, 2, 2)),
    ("STORAGE", (2, 0, 0, 2)), ("DISK", (2, 0, 0, 2)),
    ("REMOTE", (2, 0, 0, 2)),  # its "external" tier, counted with disk
])
def test_each_medium_scores_on_its_tier(engine: Engine, medium: str | None, expected: tuple[int, ...]) -> None:
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, medium))
    assert engine.score(tokens) == expected


@pytest.mark.parametrize("medium", ["cpu", "gpu", "storage", "HOST", "OBJECT", "foo"])
def test_an_unknown_medium_drops_only_its_event_silently(engine: Engine, medium: str) -> None:
    tokens, hashes = prompt(2)
    device_tokens, device_hashes = prompt(2)
    engine.publish(stored(hashes, tokens, medium), stored(device_hashes, device_tokens, "GPU"))
    assert engine.score(tokens) == (0, 0, 0, 0)
    assert engine.score(device_tokens) == (2, 2, 2, 2)


def test_a_duplicate_store_is_harmless_but_one_remove_drops_the_block(engine: Engine) -> None:
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, "CPU"), stored(hashes, tokens, "CPU"))
    assert engine.score(tokens) == (2, 0, 2, 2)
    engine.publish(BlockRemoved(block_hashes=hashes, medium="CPU"))
    assert engine.score(tokens) == (0, 0, 0, 0)


def test_removes_are_per_medium(engine: Engine) -> None:
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, "GPU"), stored(hashes, tokens, "CPU"), stored(hashes, tokens, "STORAGE"))
    engine.publish(BlockRemoved(block_hashes=hashes, medium="GPU"))
    assert engine.score(tokens) == (2, 0, 2, 2)
    engine.publish(BlockRemoved(block_hashes=hashes, medium="CPU"))
    assert engine.score(tokens) == (2, 0, 0, 2)
    engine.publish(BlockRemoved(block_hashes=hashes, medium="foo"))  # removes nothing
    assert engine.score(tokens) == (2, 0, 0, 2)


def test_a_remove_without_medium_removes_the_device_entry(engine: Engine) -> None:
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, "GPU"), stored(hashes, tokens, "CPU"))
    engine.publish(BlockRemoved(block_hashes=hashes, medium=None))
    assert engine.score(tokens) == (2, 0, 2, 2)


def test_removing_unknown_hashes_is_harmless(engine: Engine) -> None:
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, "CPU"))
    engine.publish(BlockRemoved(block_hashes=[10**12 + 1, 10**12 + 2], medium="CPU"),
                   BlockRemoved(block_hashes=hashes, medium="GPU"))
    assert engine.score(tokens) == (2, 0, 2, 2)


def test_a_block_on_a_lower_medium_extends_a_device_prefix(engine: Engine) -> None:
    tokens, hashes = prompt(4)
    engine.publish(stored(hashes[:2], tokens[:64], "GPU"), stored(hashes[2:], tokens[64:], "CPU", parent=hashes[1]))
    assert engine.score(tokens) == (4, 2, 4, 4)
    engine.publish(BlockRemoved(block_hashes=hashes[:1], medium="GPU"))  # the prefix's first block: nothing left
    assert engine.score(tokens) == (0, 0, 0, 0)


def test_a_device_store_under_an_unseen_parent_is_dropped_for_good(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    before = engine.indexer.decode_failures()
    tokens, hashes = prompt(4)
    engine.publish(stored(hashes[2:], tokens[64:], "GPU", parent=hashes[1]))
    assert dropped_since(engine, before) == 1
    assert "Failed to find parent block" in engine.indexer.dropped_lines()[-1]
    engine.publish(stored(hashes[:2], tokens[:64], "GPU"))
    assert engine.score(tokens) == (2, 2, 2, 2)


@pytest.mark.parametrize(("medium", "expected"), [("CPU", (4, 0, 4, 4)), ("STORAGE", (4, 0, 0, 4))])
def test_a_lower_medium_keeps_a_store_under_an_unseen_parent_until_the_parent_comes(
        engine: Engine, medium: str, expected: tuple[int, ...]) -> None:
    tokens, hashes = prompt(4)
    engine.publish(stored(hashes[2:], tokens[64:], medium, parent=hashes[1]))
    assert engine.score(tokens) == (0, 0, 0, 0)
    engine.publish(stored(hashes[:2], tokens[:64], medium))
    assert engine.score(tokens) == expected


def test_a_parent_held_by_another_worker_does_not_count(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    tokens, hashes = prompt(4)
    a.publish(stored(hashes[:2], tokens[:64], "GPU"))
    b.publish(stored(hashes[2:], tokens[64:], "CPU", parent=hashes[1]))
    assert b.score(tokens) == (0, 0, 0, 0)
    b.publish(stored(hashes[:2], tokens[:64], "CPU"))
    assert b.score(tokens) == (4, 0, 4, 4)
    assert a.score(tokens) == (2, 2, 2, 2)


@pytest.mark.parametrize("size", [16, 64])
def test_a_block_size_other_than_the_indexers_is_dropped(engines: tuple[Engine, Engine], size: int) -> None:
    engine = engines[0]
    before = engine.indexer.decode_failures()
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, "GPU", block_size=size))
    assert engine.score(tokens) == (0, 0, 0, 0)
    assert dropped_since(engine, before) == 1
    assert "Block not published" in engine.indexer.dropped_lines()[-1]


def test_int_hashes_without_token_ids_are_dropped(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    before = engine.indexer.decode_failures()
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, [], "CPU"))
    assert engine.score(tokens) == (0, 0, 0, 0)
    assert dropped_since(engine, before) == 1


def test_lora_name_enters_the_hash_and_extra_keys_do_not(engine: Engine) -> None:
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, "GPU", lora_name="adapter"))
    assert engine.score(tokens) == (0, 0, 0, 0)
    assert engine.score(tokens, lora_name="adapter") == (2, 2, 2, 2)
    salted, salted_hashes = prompt(2)
    engine.publish(stored(salted_hashes, salted, "GPU", extra_keys=[("salt",), ("salt",)]))
    assert engine.score(salted) == (2, 2, 2, 2)


def test_any_64_bit_hash_decodes(engine: Engine) -> None:
    tokens, _ = prompt(2)
    engine.publish(stored([2**64 - 5, -(2**63)], tokens, "GPU"))
    assert engine.score(tokens) == (2, 2, 2, 2)


def test_all_blocks_cleared_clears_every_medium_of_that_worker_only(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    tokens, hashes = prompt(2)
    a.publish(stored(hashes, tokens, "GPU"), stored(hashes, tokens, "CPU"), stored(hashes, tokens, "STORAGE"))
    b.publish(stored(hashes, tokens, "CPU"))
    a.publish(AllBlocksCleared())
    assert a.score(tokens) == (0, 0, 0, 0)
    assert b.score(tokens) == (2, 0, 2, 2)


@pytest.mark.parametrize(("medium", "locality", "expected"), [
    ("CPU", None, (2, 0, 2, 2)),  # kvoffload's host tier and node pool
    ("STORAGE", "LOCAL", (2, 0, 0, 2)),  # its disk tier
    ("REMOTE", None, (2, 0, 0, 2)),  # its remote and object tiers
    ("STORAGE", None, (2, 0, 0, 2)),  # a plug-in tier
    # Locality REMOTE (vLLM: stored away from the publishing engine) is not indexed for the engine at all.
    ("REMOTE", "REMOTE", (0, 0, 0, 0)),
    ("STORAGE", "REMOTE", (0, 0, 0, 0)),
])
def test_kvoffloads_media_and_localities_are_scored_on_their_tier(
        engine: Engine, medium: str, locality: str | None, expected: tuple[int, ...]) -> None:
    tokens, hashes = prompt(2)
    engine.publish(stored(hashes, tokens, medium, locality=locality, group_idx=0,
                          kv_cache_spec_kind="full_attention"))
    assert engine.score(tokens) == expected


@pytest.mark.parametrize(("medium", "ownership"), [("CPU", "disk"), ("STORAGE", "disk"), ("REMOTE", "remote")])
def test_a_store_with_an_ownership_is_dropped_silently(engine: Engine, medium: str, ownership: str) -> None:
    """vLLM's field for a secondary tier's stores (its KVCR tiers): the indexer does not index them, so kvoffload
    sends none (events.py)."""
    tokens, hashes = prompt(2)
    device_tokens, device_hashes = prompt(2)
    engine.publish(stored(hashes, tokens, medium, ownership=ownership), stored(device_hashes, device_tokens, "GPU"))
    assert engine.score(tokens) == (0, 0, 0, 0)
    assert engine.score(device_tokens) == (2, 2, 2, 2)
