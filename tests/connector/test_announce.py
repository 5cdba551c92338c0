"""Router announcements (connector/announce.py) in the simulated engine: every block a tier holds is announced on
its medium with the engine's own hashes and tokens, removals name exactly what was announced, a disk tier's copy
and a promotion are announced alike, the bounds hold, and nothing is described for a lookup that misses."""

from __future__ import annotations

from pathlib import Path

from kvoffload.blocks import Medium
from kvoffload.connector.announce import Announcement
from kvoffload.index.base import BlockDescription, EventKind
from kvoffload.keys import OffloadKey
from kvoffload.testing import sim_workload
from kvoffload.testing.sim import SimEngine
from kvoffload.testing.sim_values import SimDescriber
from kvoffload.testing.sim_workload import run_checked, tokens

BLOCK = 4


def make_engine(host_blocks: int = 64, factor: int = 1, **config: object) -> SimEngine:
    return sim_workload.make_engine(block_size=BLOCK, host_blocks=host_blocks, factor=factor, describe_blocks=True,
                                    **config)


def announced(engine: SimEngine) -> list[Announcement]:
    """What the engine's steps announced since the last call."""
    out, engine.announcements = engine.announcements, []
    return out


def run(engine: SimEngine, req_id: str, prompt: list[int]) -> list[Announcement]:
    engine.add_request(req_id, prompt)
    run_checked(engine)
    return announced(engine)


def describer(engine: SimEngine) -> SimDescriber:
    announcer = engine.scheduler.announcer
    assert announcer is not None
    describe = announcer.describe
    assert isinstance(describe, SimDescriber)
    return describe


def expected(engine: SimEngine, req_id: str, blocks: range, factor: int = 1) -> list[BlockDescription]:
    """What the engine's own events would say of offload blocks ``blocks`` of ``req_id``: its hashes of their
    engine blocks, each block's parent, its tokens."""
    request = engine.requests[req_id]
    hashes = describer(engine).engine_hashes(request, blocks.stop * factor)
    out = []
    for b in blocks:
        first, end = b * factor, (b + 1) * factor
        out.append(BlockDescription(tuple(hashes[first:end]), hashes[first - 1] if first else None,
                                    tuple(request.all_token_ids[first * BLOCK:end * BLOCK]), BLOCK, 0))
    return out


def describes_right(got: list[Announcement], want: list[BlockDescription], kind: EventKind, medium: Medium) -> bool:
    return [(a.kind, a.medium, a.description) for a in got] == [(kind, medium, d) for d in want]


def test_stored_blocks_are_announced_on_the_host_with_the_engines_hashes_parents_and_tokens() -> None:
    engine = make_engine()
    got = run(engine, "a", tokens(18, seed=1))  # four full blocks (the fifth is partial: never stored)
    assert describes_right(got, expected(engine, "a", range(4)), EventKind.STORED, Medium.HOST)
    # The control: a description one block off is caught.
    assert not describes_right(got, expected(engine, "a", range(1, 5)), EventKind.STORED, Medium.HOST)


def test_an_offload_block_of_two_engine_blocks_names_both_engine_hashes() -> None:
    engine = make_engine(factor=2)
    got = run(engine, "a", tokens(18, seed=1))  # two offload blocks of 8 tokens
    assert describes_right(got, expected(engine, "a", range(2), factor=2), EventKind.STORED, Medium.HOST)
    assert all(len(a.description.block_hashes) == 2 and len(a.description.token_ids) == 8 for a in got)


def test_an_eviction_removes_exactly_the_hashes_announced_and_a_block_is_announced_once() -> None:
    engine = make_engine(host_blocks=4)
    first = run(engine, "a", tokens(17, seed=1))
    stored = {a.description.block_hashes for a in first}
    again = run(engine, "a2", tokens(17, seed=1))  # the same prefix: found, not stored or announced again
    assert [a for a in again if a.kind is EventKind.STORED] == []
    later = run(engine, "b", tokens(17, seed=2))  # four new blocks push a's out of the four-block host
    removed = [a for a in later if a.kind is EventKind.REMOVED]
    assert {a.description.block_hashes for a in removed} == stored
    assert all(a.medium is Medium.HOST for a in removed)
    assert engine.scheduler.announcer is not None and engine.scheduler.announcer.announced_blocks == 4


def test_a_disk_copy_is_announced_on_the_disk_and_a_promotion_on_the_host(tmp_path: Path) -> None:
    engine = make_engine(host_blocks=4, disk_path=str(tmp_path), disk_bytes=1 << 22)
    first = run(engine, "a", tokens(17, seed=1))
    want = expected(engine, "a", range(4))
    on_disk = [a.description for a in first if a.medium is Medium.DISK and a.kind is EventKind.STORED]
    assert on_disk == want  # the write-through copy, described as the host's
    run(engine, "b", tokens(17, seed=2))  # a's blocks leave the host; the disk keeps them
    engine.pool.drop_cache()
    back = run(engine, "c", tokens(17, seed=1) + tokens(4, seed=3))
    promoted = [a.description for a in back if a.medium is Medium.HOST and a.kind is EventKind.STORED]
    assert promoted[:4] == want


def test_a_miss_describes_nothing_and_a_hit_describes_only_blocks_not_announced() -> None:
    engine = make_engine()
    run(engine, "a", tokens(17, seed=1))
    calls = describer(engine).calls
    run(engine, "b", tokens(3, seed=2))  # shorter than a block: nothing stored, a miss
    assert describer(engine).calls == calls
    engine.pool.drop_cache()
    run(engine, "c", tokens(17, seed=1))  # a hit on four announced blocks
    assert describer(engine).calls == calls


def test_past_its_bound_the_oldest_announced_block_is_forgotten_and_counted() -> None:
    engine = make_engine()
    announcer = engine.scheduler.announcer
    assert announcer is not None
    announcer.max_blocks = 3
    run(engine, "a", tokens(17, seed=1))
    assert announcer.announced_blocks == 3 and announcer.forgotten == 1


def test_without_a_describer_nothing_is_announced_and_the_events_are_drained() -> None:
    engine = sim_workload.make_engine(block_size=BLOCK, host_blocks=64)
    engine.add_request("a", tokens(17, seed=1))
    run_checked(engine)
    assert engine.scheduler.take_announcements() == []
    assert engine.scheduler.take_events() == []


def test_after_a_reset_a_block_stored_again_is_announced_again(node_path: Path) -> None:
    # The node pool's reset drops this engine's blocks without an event for each (the private host's announces
    # each removal, which alone would forget them).
    engine = make_engine(host_scope="node", node_path=str(node_path))
    first = run(engine, "a", tokens(17, seed=1))
    engine.scheduler.reset()  # vLLM's prefix-cache reset: the router was told AllBlocksCleared
    engine.pool.drop_cache()
    again = run(engine, "a2", tokens(17, seed=1))
    assert [a.description for a in again if a.kind is EventKind.STORED] == [a.description for a in first]


def test_token_ids_outside_32_bits_are_kept_as_they_came() -> None:
    engine = make_engine()
    announcer = engine.scheduler.announcer
    assert announcer is not None
    wide = BlockDescription((1,), None, (1 << 40, 5, -1, 7), BLOCK, 0)
    announcer._keep(OffloadKey(b"w" * 16), wide)
    assert announcer._announced[OffloadKey(b"w" * 16)].unpacked() == wide
