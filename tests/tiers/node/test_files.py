"""A node pool's files are one set (tiers/node/files.py): an engine finds a whole set or makes a new one, never a
new file beside old ones, and an engine on a set whose files were removed, replaced or truncated leaves it within
a reclaim, without a crash. Before, the next engine made a fresh ``pool.0`` beside a full shared index (or an empty
index over a full pool) and engines loaded other blocks' bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.tiers.node.pools import keys

from kvoffload import _nodeindex
from kvoffload.config import NodeTierConfig
from kvoffload.keys import Namespace, OffloadKey
from kvoffload.tiers.node.files import ENGINES_NAME, INDEX_NAME, open_pool
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.pool import NodePool
from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory

NS = Namespace(model="m", dtype="bf16", layout="node-files")
SLOT_BYTES = 4096  # a page a slot: a truncation to half the pool takes whole pages away
GEOMETRY = NodeGeometry(8, SLOT_BYTES, NS.chain_root())


class Engine:
    """One engine's both halves, as one process holds them: its index and its rank-0 pool."""

    def __init__(self, node_path: Path) -> None:
        node = NodeTierConfig(node_path)
        self.directory = open_directory(node, NS)
        segment, files, mapping = open_pool(self.directory, 0, GEOMETRY, access_of(node))
        self.pool = NodePool(mapping, segment, GEOMETRY.num_slots, SLOT_BYTES, False)
        self.index = NodeIndex(segment, EngineLocks(self.directory, access_of(node)), files)

    def store(self, blocks: list[OffloadKey]) -> None:
        out = self.index.prepare_store(blocks)
        assert out is not None
        for key, slot in zip(out.keys_to_store, out.store_spec.slots, strict=True):  # type: ignore[union-attr]
            self.pool.mapping[slot * SLOT_BYTES:(slot + 1) * SLOT_BYTES] = key * (SLOT_BYTES // 16)
        self.index.complete_store(out.keys_to_store)

    def load(self, blocks: list[OffloadKey]) -> list[bool]:
        """For each hit: whether it read its own bytes (a verified load reading another block's is the bug)."""
        self.tick()
        hits = self.index.lookup(blocks).hits
        spec = self.index.prepare_load(blocks[:hits])
        read = [bytes(self.pool.mapping[s * SLOT_BYTES:(s + 1) * SLOT_BYTES]) for s in spec.slots]
        ok = _nodeindex.verify(self.index._segment, spec.slots, spec.epochs) and not self.pool.lost()
        self.index.complete_load(blocks[:hits], success=ok)
        return [got == key * (SLOT_BYTES // 16) for key, got in zip(blocks, read, strict=False)] if ok else []

    def tick(self) -> None:
        self.index._last_reclaim = 0.0
        self.index._reclaim()


def generation(engine: Engine) -> int:
    return _nodeindex.files(engine.index._segment)[0]


@pytest.mark.parametrize("name", [INDEX_NAME, ENGINES_NAME, "pool.0"])
def test_a_file_removed_under_running_engines_makes_a_new_set_and_they_leave(node_path: Path, name: str) -> None:
    old = Engine(node_path)
    blocks = keys(4)
    old.store(blocks)
    assert old.load(blocks) == [True] * 4
    os.unlink(old.directory / name)  # an operator's rm, or RemoveIPC at log-out
    new = Engine(node_path)
    assert generation(new) != generation(old)  # a whole new set, not one new file beside the old ones
    assert new.load(blocks) == []  # its index is empty: no hit on bytes it does not have
    new.store(blocks)
    assert new.load(blocks) == [True] * 4
    old.tick()
    assert old.index.detached is not None and "was re" in old.index.detached  # removed, or replaced since
    assert old.load(blocks) == []  # a miss from now on, never a mixed view
    new.index.check_integrity()


@pytest.mark.parametrize("size", [0, GEOMETRY.pool_bytes // 2])
def test_a_pool_file_truncated_under_an_engine_is_no_sigbus_and_no_hit(node_path: Path, size: int) -> None:
    old = Engine(node_path)
    blocks = keys(8)
    old.store(blocks)
    os.truncate(old.directory / "pool.0", size)  # the pages past the end are gone: touching them was SIGBUS
    assert old.load(blocks) == []  # the reclaim sees the truncation: left
    assert bytes(old.pool.mapping[-SLOT_BYTES:]) == bytes(SLOT_BYTES) and old.pool.lost()  # read: zeros, no crash
    new = Engine(node_path)
    assert generation(new) != generation(old) and new.load(blocks) == []


def test_a_replaced_pool_file_makes_a_new_set(node_path: Path) -> None:
    old = Engine(node_path)
    blocks = keys(2)
    old.store(blocks)
    path = old.directory / "pool.0"
    replacement = path.with_name("replacement")
    replacement.write_bytes(bytes(GEOMETRY.pool_bytes))
    os.chmod(replacement, 0o600)
    os.replace(replacement, path)  # same name and size, other bytes
    new = Engine(node_path)
    assert generation(new) != generation(old) and new.load(blocks) == []
    old.tick()
    assert old.index.detached is not None and "replaced" in old.index.detached


def test_an_index_left_half_made_is_made_again(node_path: Path) -> None:
    first = Engine(node_path)
    first.index.close()
    before = generation(first)
    with open(first.directory / INDEX_NAME, "r+b") as f:
        f.write(bytes(8))  # no magic: a process killed while formatting it
    again = Engine(node_path)
    assert generation(again) != before
    again.store(keys(2))
    again.index.check_integrity()


def test_engines_on_a_whole_set_share_it(node_path: Path) -> None:
    """The control: nothing changed, so a second engine joins the first's set and loads its blocks."""
    first, second = Engine(node_path), Engine(node_path)
    blocks = keys(4)
    first.store(blocks)
    assert generation(first) == generation(second) and second.load(blocks) == [True] * 4
    first.tick()
    assert first.index.detached is None and second.index.detached is None


TRUNCATED_WHILE_ATTACHING = """
import os, sys
from pathlib import Path
from kvoffload.config import OffloadConfig
from kvoffload.keys import Namespace
from kvoffload.testing import layouts
from kvoffload.tiers.node.files import INDEX_NAME
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.spec import NodeTierSpec
from kvoffload.tiers.spec import TierContext

layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
config = OffloadConfig.from_dict({"host_scope": "node", "node_path": sys.argv[1], "host_bytes": 1 << 20})
attach = NodeIndex._attach

def truncated_first(self):  # the index file cut to nothing after the engine mapped it, before it attached
    os.truncate(next(Path(sys.argv[1]).rglob(INDEX_NAME)), 0)
    attach(self)

NodeIndex._attach = truncated_first
index = NodeTierSpec(config).make_index(TierContext(Namespace("m", "bf16", "t"), layout, 1))
print("detached:", index.detached)
"""


def test_an_index_truncated_while_the_engine_attaches_is_no_sigbus_and_no_pool(node_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", TRUNCATED_WHILE_ATTACHING, str(node_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]  # before the guard came first: killed by SIGBUS (-7)
    assert run.stdout.startswith("detached: ") and "None" not in run.stdout  # the engine left the damaged pool


TRUNCATED_WHILE_OPENING = """
import os, sys
from pathlib import Path
from kvoffload.config import OffloadConfig
from kvoffload.keys import Namespace
from kvoffload.testing import layouts
from kvoffload.tiers.node import files
from kvoffload.tiers.node.spec import NodeTierSpec
from kvoffload.tiers.spec import TierContext

layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
config = OffloadConfig.from_dict({"host_scope": "node", "node_path": sys.argv[1], "host_bytes": 1 << 20})
context = TierContext(Namespace("m", "bf16", "t"), layout, 1)
first = NodeTierSpec(config).make_index(context)  # a whole set on the tmpfs
problem, cut = files.BoundFiles.problem, []

def truncated_first(self, index):  # the index cut to nothing while the next engine checks the set it mapped
    if not cut:
        cut.append(next(Path(sys.argv[1]).rglob(files.INDEX_NAME)))
        os.truncate(cut[0], 0)
    return problem(self, index)

files.BoundFiles.problem = truncated_first
second = NodeTierSpec(config).make_index(context)
print("attached to a new set:", bool(cut) and second.detached is None)
"""


def test_an_index_truncated_while_an_engine_opens_the_set_is_no_sigbus_and_a_new_set(node_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", TRUNCATED_WHILE_OPENING, str(node_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]  # before the check was guarded: killed by SIGBUS (-7)
    assert run.stdout.strip() == "attached to a new set: True"


TRUNCATED_WHILE_OPENING_THE_POOL = """
import os, sys
from pathlib import Path
from kvoffload.config import ConfigError, OffloadConfig
from kvoffload.keys import Namespace
from kvoffload.testing import layouts
from kvoffload.tiers.node import files
from kvoffload.tiers.node.spec import NodeTierSpec
from kvoffload.tiers.spec import TierContext

layout, _ = layouts.attention_layout(num_blocks=8, block_size=4)
config = OffloadConfig.from_dict({"host_scope": "node", "node_path": sys.argv[1], "host_bytes": 1 << 20})
context = TierContext(Namespace("m", "bf16", "t"), layout, 1)
open_pool_file = files._open_pool_file

def truncated_first(directory, *args):  # the index cut to nothing before the worker reads its pool's record
    os.truncate(directory / files.INDEX_NAME, 0)
    return open_pool_file(directory, *args)

files._open_pool_file = truncated_first
try:
    NodeTierSpec(config).make_pool(context, pin_memory=False)
except ConfigError as e:
    print("refused:", "damaged while this engine opened it" in str(e))
"""


def test_an_index_truncated_while_a_worker_opens_its_pool_is_a_config_error_not_sigbus(node_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", TRUNCATED_WHILE_OPENING_THE_POOL, str(node_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]  # before the read was guarded: killed by SIGBUS (-7)
    assert run.stdout.strip() == "refused: True"
