"""DiskHandler and slot files that change under it: a file cut short or replaced while handlers hold it open, and
two engines' handlers storing at once and loading each other's blocks. Whatever happens to a file, a load is
either the block its key names, bit-exact, or a failed load (the engine recomputes): never another block."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tests.tiers.disk.handlers import (
    BUDGET,
    ENTRY,
    NS,
    at_engine,
    at_places,
    block_at,
    keys,
    load,
    make_pool,
    names,
    place,
    prepare,
    read_block,
    run,
    store,
)

from kvoffload.config import DiskTierConfig
from kvoffload.keys import OffloadKey
from kvoffload.tiers.disk.engine_files import prepare_files
from kvoffload.tiers.disk.file_io import FileOps, open_slot_file, write_run
from kvoffload.tiers.disk.handler import DiskHandler
from kvoffload.tiers.disk.paths import slot_file_path
from kvoffload.tiers.disk.slot_file import Layout, location, split_location
from kvoffload.tiers.lower.block_format import PLAIN
from kvoffload.tiers.lower.trust import Access


def slot_of(key: OffloadKey) -> int:
    return split_location(place(key))[1]


def slot_file_holding(directory: Path, blocks: dict[int, tuple[OffloadKey, bytes]]) -> Path:
    """A slot file of the tests' layout in ``directory`` (made as a scheduler makes one) holding ``blocks`` (slot:
    key and payload), each with its entry."""
    layout = Layout.for_budget(BUDGET, PLAIN.file_bytes(max(ENTRY)))
    assert layout is not None
    directory.mkdir(mode=0o700)
    prepare_files([directory], 0, layout, Access(None))
    ops = FileOps()
    file = open_slot_file(ops, slot_file_path(directory, 0))
    try:
        for slot, (key, payload) in blocks.items():
            write_run(ops, file, slot, [key], [memoryview(payload)], NS.fingerprint())
    finally:
        ops.close(file.fd)
    return Path(file.path)


def test_a_slot_file_cut_short_under_a_running_handler_fails_the_lost_loads_then_works_again(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    ks = keys(4, salt=30)
    assert run(handler, store((0, 1, 2, 3), ks)).success
    expected = [bytes(handler._slots[s, :48]) for s in range(4)]
    spots = sorted(block_at(config, k).offset for k in ks)
    at = block_at(config, ks[0])
    cut = spots[2] + at.nbytes // 2  # two blocks whole, one cut in half, one gone
    os.truncate(at.path, cut)
    handler._slots[4:8] = 0
    lost = []
    for i, key in enumerate(ks):
        whole = block_at(config, key).offset + at.nbytes <= cut
        result = run(handler, load((key,), (4 + i,)))
        assert result.success == whole
        if whole:
            assert bytes(handler._slots[4 + i, :48]) == expected[i]
        else:
            assert not handler._slots[4 + i].any() and not names(config, key)  # nothing loaded; entry emptied
            lost.append(i)
    assert len(lost) == 2 and handler.breaker.errors == 2
    # The file goes on: the lost blocks are stored again (past its end) and load.
    assert run(handler, store(tuple(lost), tuple(ks[i] for i in lost))).success
    handler._slots[4:8] = 0
    assert run(handler, load(ks, (4, 5, 6, 7))).success
    assert [bytes(handler._slots[4 + i, :48]) for i in range(4)] == expected


def test_a_slot_file_replaced_under_two_engines_handlers_never_loads_a_wrong_block(
        config: DiskTierConfig, tmp_path: Path) -> None:
    """Another file renamed over engine 0's slot file: its owner keeps writing and reading through the descriptor
    it holds; engine 1's handler reads what its own descriptor holds, and once a read shows the file is not the
    one it opened (a reused slot here), it opens the path again and reads what the new file holds. Every read in
    between is the key's block or a miss."""
    prepare(config, NS, 0)
    prepare(config, NS, 1)
    owner = DiskHandler(config, make_pool(), NS, ENTRY)  # engine 0's
    other = DiskHandler(config, make_pool(), NS, ENTRY)  # engine 1's, loading engine 0's blocks
    try:
        k1, k2, k5, k9, k10 = keys(5, salt=20)
        s1, s2 = slot_of(k1), slot_of(k2)
        jobs = at_places({k1: location(0, s1), k2: location(0, s2), k5: location(0, s1), k9: location(0, s1),
                          k10: location(0, s2)})
        assert run(owner, jobs.store((0, 1), (k1, k2))).success
        first = {k1: bytes(owner._slots[0, :48]), k2: bytes(owner._slots[1, :48])}
        other._slots[:] = 0
        assert run(other, jobs.load((k1, k2), (4, 5))).success  # engine 1 opens engine 0's file
        assert [bytes(other._slots[s, :48]) for s in (4, 5)] == [first[k1], first[k2]]

        new = {k9: os.urandom(48), k10: os.urandom(48)}
        replacement = slot_file_holding(tmp_path / "elsewhere", {s1: (k9, new[k9]), s2: (k10, new[k10])})
        path = block_at(config, k1).path
        os.replace(replacement, path)

        # The owner keeps its descriptor: it reuses k1's slot for k5, and reads its blocks back.
        assert run(owner, jobs.store((2,), (k5,))).success
        assert run(owner, jobs.load((k5, k2), (6, 7))).success
        assert [bytes(owner._slots[s, :48]) for s in (6, 7)] == [bytes(owner._slots[2, :48]), first[k2]]
        assert read_block(config, k1)[32:48] == k9  # the file now at the path did not get k5

        other._slots[:] = 0
        assert run(other, jobs.load((k2,), (4,))).success  # still the file it opened: k2 is there, whole
        assert bytes(other._slots[4, :48]) == first[k2]
        other._slots[:] = 0
        assert not run(other, jobs.load((k1,), (4,))).success  # its slot holds k5 now: a miss, and noticed
        assert not other._slots.any()
        assert run(other, jobs.load((k9, k10), (4, 5))).success  # the path opened again: the new file
        assert [bytes(other._slots[s, :48]) for s in (4, 5)] == [new[k9], new[k10]]
        other._slots[:] = 0
        for key in (k1, k2, k5):  # none of them is in the new file: misses
            assert not run(other, jobs.load((key,), (6,))).success
        assert not other._slots.any()
        assert other.breaker.errors == 0 and owner.breaker.errors == 0  # reused slots: misses, not faults
    finally:
        owner.shutdown()
        other.shutdown()


def test_two_engines_store_at_once_and_each_loads_the_others_blocks_bit_exact(config: DiskTierConfig) -> None:
    prepare(config, NS, 0)
    prepare(config, NS, 1)
    n = 32
    engines = [DiskHandler(config, make_pool(n), NS, ENTRY) for _ in range(2)]
    try:
        own = [keys(n, salt=40), keys(n, salt=41)]
        expected = [[bytes(h._slots[i, :48]) for i in range(n)] for h in engines]
        assert expected[0] != expected[1]
        start = threading.Barrier(2)
        results: list[list[bool]] = [[], []]

        def storing(e: int) -> None:
            h, jobs = engines[e], at_engine(e)
            batch = [jobs.store(tuple(range(i, i + 4)), own[e][i:i + 4]) for i in range(0, n, 4)]
            start.wait()
            for job in batch:
                assert h.submit(job)
            h.wait([job.job_id for job in batch])
            results[e] = [r.success for r in h.get_finished()]

        threads = [threading.Thread(target=storing, args=(e,)) for e in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [[True] * (n // 4)] * 2
        for e, h in enumerate(engines):
            theirs = 1 - e
            assert names(config, own[theirs][0], engine=theirs)
            h._slots[:] = 0
            assert run(h, at_engine(theirs).load(own[theirs], tuple(range(n)))).success
            assert [bytes(h._slots[i, :48]) for i in range(n)] == expected[theirs]
            h._slots[:] = 0  # and a key asked of the wrong engine's file: a miss, not that file's block there
            assert not run(h, at_engine(e).load(own[theirs][:1], (0,))).success and not h._slots.any()
    finally:
        for h in engines:
            h.shutdown()



def test_stores_into_a_slot_file_that_is_gone_are_disk_errors_that_trip_the_breaker(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    """A load from a file that is not there is a miss (its engine stopped and was trimmed); a store into this
    engine's own file that is not there is a fault, counted, or every store would fail unseen."""
    os.unlink(block_at(config, keys(1)[0]).path)
    for i in range(3):  # the config's breaker opens at three errors
        assert not run(handler, store((0,), keys(1, salt=40 + i))).success
    assert handler.breaker.is_open
    prepare(config)
    assert not run(handler, load(keys(1, salt=40), (1,))).success  # tier off for the cool-down: no I/O at all


def test_a_load_from_a_slot_file_that_is_gone_is_a_miss_not_a_disk_error(
        handler: DiskHandler, config: DiskTierConfig) -> None:
    assert run(handler, store((0,), keys(1, salt=50))).success
    os.unlink(block_at(config, keys(1, salt=50)[0]).path)
    handler._reopen(handler._files[0])  # as after a failed read: the path no longer names the open file
    errors = handler.breaker.errors
    assert not run(handler, load(keys(1, salt=50), (1,))).success
    assert handler.breaker.errors == errors
