"""Every engine attached to a node pool announces every block in it (issue 44, ``tiers/node/announce.py``): a block
one engine stored and shared reaches the others' events with its description, an eviction by one engine's store
reaches them as REMOVED, a late joiner learns what the logs still hold, and whatever a log holds is input: damage
is refused and counted, never raised, and nothing is reported that the pool does not say is true now."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers.node.pools import SLOT_BYTES, keys, store

from kvoffload.blocks import Medium
from kvoffload.config import NodeTierConfig
from kvoffload.index.base import BlockDescription, EventKind, OffloadEvent
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.lower.trust import Access
from kvoffload.tiers.node import announce, announce_log
from kvoffload.tiers.node.announce_log import DATA_AT, RECORD, STORED, AnnounceCounts, LogReader, LogWriter, log_name
from kvoffload.tiers.node.describe import DescriptionError, decode, encode
from kvoffload.tiers.node.files import open_index
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory

NS = Namespace(model="m", dtype="bf16", layout="node-announce")
BLOCK = 16


def engine(node_path: Path, slots: int = 8) -> NodeIndex:
    """A new engine attached to the namespace's pool, with its own mapping and files, as a real one opens it."""
    node = NodeTierConfig(node_path)
    directory = open_directory(node, NS)
    segment, files = open_index(directory, NodeGeometry(slots, SLOT_BYTES, NS.chain_root()), access_of(node))
    return NodeIndex(segment, EngineLocks(directory, access_of(node)), files)


def description(n: int) -> BlockDescription:
    """A distinct description of one engine block (int hashes, as vLLM publishes them by default)."""
    return BlockDescription((n + 1,), n or None, tuple(range(n, n + BLOCK)), BLOCK, 0)


def shared(index: NodeIndex, stored: list[OffloadKey]) -> list[BlockDescription]:
    """``stored`` stored (all new) and shared as an announcer does; their descriptions."""
    store(index, stored)
    descs = [description(int.from_bytes(key[:4], "little")) for key in stored]
    index.share_descriptions(Medium.HOST, list(zip(stored, descs, strict=True)))
    return descs


def learned(events: list[OffloadEvent], kind: EventKind) -> dict[OffloadKey, BlockDescription | None]:
    """What ``events`` report of other engines' records (those with descriptions) of ``kind``."""
    return {key: desc for e in events if e.kind is kind and e.descriptions
            for key, desc in zip(e.keys, e.descriptions, strict=True)}


# --- encoding ---------------------------------------------------------------------------------------------------

hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=255))
extra_scalar = st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1))
extra_item = st.one_of(extra_scalar, st.lists(extra_scalar, max_size=3).map(tuple))


@st.composite
def descriptions(draw: st.DrawFn) -> BlockDescription:
    n = draw(st.integers(1, 4))
    block_size = draw(st.integers(1, 8))
    top = draw(st.sampled_from([2**32 - 1, 2**63 - 1]))
    tokens = draw(st.one_of(st.just(()), st.tuples(*[st.integers(0, top)] * (n * block_size))))
    extra = draw(st.none() | st.tuples(*[st.none() | st.lists(extra_item, max_size=3).map(tuple)] * n))
    return BlockDescription(tuple(draw(hashes) for _ in range(n)), draw(st.none() | hashes), tokens, block_size,
                            draw(st.integers(0, 2**32 - 1)), draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
                            draw(st.none() | st.text(max_size=20)), extra)


@settings(max_examples=300, deadline=None)
@given(descriptions())
def test_a_description_round_trips_exactly(desc: BlockDescription) -> None:
    back = decode(encode(desc))
    assert back == desc
    assert repr(back) == repr(desc)  # tuples stay tuples, ints stay ints, bytes stay bytes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_to_a_sound_description_or_are_refused(buf: bytes) -> None:
    try:
        desc = decode(buf)
    except DescriptionError:
        return
    assert all(type(h) in (int, bytes) for h in desc.block_hashes)
    assert all(type(t) is int and t >= 0 for t in desc.token_ids)
    assert len(desc.token_ids) in (0, len(desc.block_hashes) * desc.block_size)


def test_damaged_bytes_are_refused() -> None:
    desc = BlockDescription((7, 8), 6, tuple(range(2 * BLOCK)), BLOCK, 1, 3, "lora", (("a", 1), None))
    good = encode(desc)
    assert decode(good) == desc
    damaged = {
        "truncated": good[:-1],
        "trailing bytes": good + b"\0",
        "an unknown flag": bytes([good[0] | 0x80]) + good[1:],
        "absurd hash count": good[:1] + (60000).to_bytes(2, "little") + good[3:],
        "tokens not filling the hashes": good[:3] + (5).to_bytes(4, "little") + good[7:],
        "a zero block size": good[:7] + bytes(4) + good[11:],
        "an unknown hash tag": good[:15] + b"\x09" + good[16:],
        "extra keys of another type": good.replace(b'["a",1]', b'[1.5,1]'),
    }
    for why, buf in damaged.items():
        assert buf != good, why
        with pytest.raises(DescriptionError):
            decode(buf)
    wide = encode(BlockDescription((1,), None, (2**40,) * BLOCK, BLOCK, 0))
    negative = wide[:-8] + (-1).to_bytes(8, "little", signed=True)
    with pytest.raises(DescriptionError, match="negative"):
        decode(negative)


@pytest.mark.parametrize("desc", [
    BlockDescription((1,), None, (-1,) * BLOCK, BLOCK, 0),
    BlockDescription((2**64,), None, (), BLOCK, 0),
    BlockDescription((1.5,), None, (), BLOCK, 0),  # type: ignore[arg-type]
    BlockDescription((1,), None, (1,) * 3, BLOCK, 0),
    BlockDescription((1,), None, (), BLOCK, 0, extra_keys=([1],)),  # type: ignore[arg-type]  # comes back a tuple
    BlockDescription((1,), None, (), BLOCK, 0, extra_keys=((b"raw",),)),
    BlockDescription((1,), None, (1,) * 9000, 9000, 0),  # over MAX_DESCRIPTION_BYTES
], ids=["negative token", "hash past u64", "float hash", "tokens short", "list extra", "bytes extra", "too long"])
def test_what_the_encoding_cannot_hold_exactly_is_refused(desc: BlockDescription) -> None:
    with pytest.raises(DescriptionError):
        encode(desc)


# --- engines sharing a pool -------------------------------------------------------------------------------------

def test_a_block_another_engine_stored_is_announced_with_its_description(node_path: Path) -> None:
    a, b = engine(node_path), engine(node_path)
    b.share_descriptions(Medium.HOST, [])  # B publishes events: it starts reading
    blocks = keys(3)
    descs = shared(a, blocks)
    events = b.take_events()
    assert learned(events, EventKind.STORED) == dict(zip(blocks, descs, strict=True))
    assert all(e.medium is Medium.HOST for e in events)
    assert b.take_events() == []  # each record once
    own = a.take_events()  # A's own events are as before; its own log is not read back
    assert [(e.kind, e.keys, e.descriptions) for e in own] == [(EventKind.STORED, tuple(blocks), ())]
    assert b.announcements is not None and b.announcements.counts.learned == 3


def test_an_engine_that_never_shares_makes_and_reads_no_log(node_path: Path) -> None:
    a, b = engine(node_path), engine(node_path)
    shared(a, keys(2))
    assert b.take_events() == [] and b.announcements is None
    assert a._files is not None
    assert sorted(p.name for p in a._files.directory.iterdir() if p.name.startswith("announce")) == \
        [log_name(a.attachment)]


def test_an_eviction_by_another_engine_store_is_announced_removed(node_path: Path) -> None:
    a, b = engine(node_path, slots=4), engine(node_path, slots=4)
    b.share_descriptions(Medium.HOST, [])
    first = keys(4)
    shared(a, first)
    assert set(learned(b.take_events(), EventKind.STORED)) == set(first)
    out = a.prepare_store(keys(2))  # the pool is full: two of A's blocks go
    assert out is not None and len(out.evicted_keys) == 2
    a.take_events()  # A's step ends: its evictions are logged
    removed = learned(b.take_events(), EventKind.REMOVED)
    assert set(removed) == set(out.evicted_keys) and set(removed.values()) == {None}


def test_an_eviction_of_this_engine_block_by_another_is_announced_removed(node_path: Path) -> None:
    a, b = engine(node_path, slots=2), engine(node_path, slots=2)
    b.share_descriptions(Medium.HOST, [])
    mine = keys(2)
    shared(b, mine)
    b.take_events()
    a.share_descriptions(Medium.HOST, [])
    out = a.prepare_store(keys(2))  # A's store evicts B's blocks: only A's own events said so before
    assert out is not None and set(out.evicted_keys) == set(mine)
    a.take_events()
    rescan(b)  # A's log is newer than B's last look for logs
    assert set(learned(b.take_events(), EventKind.REMOVED)) == set(mine)


def test_a_late_joiner_learns_the_blocks_still_held(node_path: Path) -> None:
    a = engine(node_path, slots=4)
    a.share_descriptions(Medium.HOST, [])
    gone, kept = keys(2), keys(2)
    shared(a, gone)
    shared(a, kept)
    a.prepare_store(keys(2))  # evicts two of them (CLOCK: which two is the pool's business)
    held = {k for k in gone + kept if a.lookup([k]).hits == 1}
    assert len(held) == 2
    late = engine(node_path, slots=4)
    late.share_descriptions(Medium.HOST, [])
    events = late.take_events()
    assert set(learned(events, EventKind.STORED)) == held
    assert late.announcements is not None and late.announcements.counts.untrue >= 2


def test_a_stored_record_no_longer_true_is_not_announced(node_path: Path) -> None:
    a, b = engine(node_path, slots=2), engine(node_path, slots=2)
    b.share_descriptions(Medium.HOST, [])
    first = keys(2)
    shared(a, first)
    out = a.prepare_store(keys(2))  # evicted before B read that A stored them
    assert out is not None and set(out.evicted_keys) == set(first)
    a.take_events()
    events = b.take_events()
    assert learned(events, EventKind.STORED) == {}
    assert set(learned(events, EventKind.REMOVED)) == set(first)


def test_a_removed_record_no_longer_true_is_not_announced(node_path: Path) -> None:
    a, b = engine(node_path, slots=2), engine(node_path, slots=2)
    b.share_descriptions(Medium.HOST, [])
    first = keys(2)
    shared(a, first)
    a.complete_store(a.prepare_store(keys(2)).keys_to_store)  # type: ignore[union-attr]  # evicts them
    a.take_events()
    shared(a, first)  # and stored again before B reads: held now
    events = b.take_events()
    assert not set(first) & set(learned(events, EventKind.REMOVED))
    assert set(learned(events, EventKind.STORED)) == set(first)


def test_a_reader_behind_by_more_than_the_ring_skips_to_the_oldest_and_counts_the_lost(
        node_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(announce_log, "RING_BYTES", 2048)  # 15 records of 133 bytes
    a, b = engine(node_path), engine(node_path)
    b.share_descriptions(Medium.HOST, [])
    blocks = keys(4)
    descs = shared(a, blocks)
    b.take_events()
    for _ in range(10):  # 40 records: more than the ring holds
        a.share_descriptions(Medium.HOST, list(zip(blocks, descs, strict=True)))
    assert b.announcements is not None
    read = sum(len(e.keys) for e in b.take_events())
    assert b.announcements.counts.lost > 0 and b.announcements.counts.lost + read == 40
    assert b.announcements.counts.refused == 0


def test_reading_is_bounded_per_step(node_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(announce, "MAX_RECORDS_PER_STEP", 3)
    a, b = engine(node_path), engine(node_path)
    b.share_descriptions(Medium.HOST, [])
    blocks = keys(8)
    shared(a, blocks)
    steps = [learned(b.take_events(), EventKind.STORED) for _ in range(4)]
    assert [len(s) for s in steps] == [3, 3, 2, 0]
    assert set().union(*steps) == set(blocks)


def rescan(index: NodeIndex) -> None:
    """Have ``index`` look for new logs at its next read, as it does once a ``SCAN_S``."""
    assert index.announcements is not None
    index.announcements._scanned = float("-inf")


def log_of(index: NodeIndex) -> Path:
    assert index._files is not None
    return index._files.directory / log_name(index.attachment)


def test_a_damaged_record_is_refused_and_the_engine_goes_on(node_path: Path) -> None:
    a, b = engine(node_path), engine(node_path)
    b.share_descriptions(Medium.HOST, [])
    blocks = keys(2)
    shared(a, blocks)
    with open(log_of(a), "r+b") as f:  # a byte of the first record's description flipped
        f.seek(DATA_AT + RECORD.size + 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert learned(b.take_events(), EventKind.STORED) == {}  # the rest of what was published is skipped
    assert b.announcements is not None and b.announcements.counts.refused == 1
    later = keys(1)
    shared(a, later)  # records after the damage are read again
    assert set(learned(b.take_events(), EventKind.STORED)) == set(later)


def test_a_record_with_a_sound_check_but_no_description_is_refused(node_path: Path) -> None:
    a, b = engine(node_path), engine(node_path)
    b.share_descriptions(Medium.HOST, [])
    block = keys(1)
    store(a, block)
    assert a.announcements is None
    a.share_descriptions(Medium.HOST, [])
    assert a.announcements is not None and a.announcements._writer is not None
    a.announcements._writer.append([(STORED, bytes(block[0]), b"\x00garbage")])  # a writer's bug
    assert b.take_events() == []
    assert b.announcements is not None and b.announcements.counts.refused == 1


def test_a_log_that_is_not_one_is_refused(node_path: Path) -> None:
    a, b = engine(node_path), engine(node_path)
    assert a._files is not None
    directory = a._files.directory
    (directory / "announce.40").write_bytes(b"\xff" * (DATA_AT + announce_log.RING_BYTES))
    os.symlink(directory / "index", directory / "announce.41")
    b.share_descriptions(Medium.HOST, [])
    assert b.take_events() == []
    assert b.announcements is not None and b.announcements.counts.refused == 2  # the symlink is not even followed
    b.take_events()
    rescan(b)
    assert b.take_events() == [] and b.announcements.counts.refused == 2  # refused once, not at every look


def test_a_new_set_of_the_pool_files_removes_the_logs(node_path: Path) -> None:
    a = engine(node_path)
    a.share_descriptions(Medium.HOST, [])
    assert log_of(a).exists()
    os.unlink(log_of(a).parent / "index")  # a new set is made by the next engine
    engine(node_path)
    assert not log_of(a).exists()


def test_a_reader_keeping_up_reads_every_record_in_order_across_many_wraps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of every size, so that the ring's end is padded, skipped (too short for a pad) and met exactly."""
    monkeypatch.setattr(announce_log, "RING_BYTES", 1000)
    writer = LogWriter.create(tmp_path, 3, 1, Access(tier="node"))
    fd = os.open(tmp_path / log_name(3), os.O_RDONLY)
    reader = LogReader(fd, log_name(3), 0)
    counts = AnnounceCounts()
    rng = random.Random(5)
    written: list[tuple[int, bytes]] = []
    read: list[tuple[int, bytes]] = []
    for _ in range(300):
        batch = [(STORED, os.urandom(16), os.urandom(rng.randrange(0, 300)))
                 for _ in range(rng.randrange(1, 3))]
        writer.append(batch)
        written += [(kind, payload) for kind, _, payload in batch]
        read += [(r.kind, r.payload) for r in reader.read(1000, 1 << 20, counts)[0]]
    assert read == written and counts == AnnounceCounts()
    writer.close()
    reader.close()


def test_a_log_others_may_write_is_not_read(node_path: Path) -> None:
    a, b = engine(node_path), engine(node_path)
    shared(a, keys(1))
    os.chmod(log_of(a), 0o666)  # another user could plant descriptions in it
    b.share_descriptions(Medium.HOST, [])
    assert b.take_events() == []
    assert b.announcements is not None and b.announcements.counts.refused == 1
