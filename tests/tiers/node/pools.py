"""Node pools for the node tier's tests: an index segment of a namespace, fresh keys, a finished store."""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path

from kvoffload import _nodeindex
from kvoffload.blocks import HostBlocks
from kvoffload.config import NodeTierConfig
from kvoffload.keys import BlockHash, Namespace, OffloadKey, offload_key
from kvoffload.tiers.node.files import open_index, open_pool
from kvoffload.tiers.node.index import NodeIndex
from kvoffload.tiers.node.liveness import EngineLocks
from kvoffload.tiers.node.segment import NodeGeometry, access_of, open_directory

SLOT_BYTES = 64
_ids = itertools.count()


def keys(n: int) -> list[OffloadKey]:
    """``n`` keys no test used before."""
    return [offload_key(BlockHash(next(_ids).to_bytes(8, "little")), 0) for _ in range(n)]


def segment_in(node_path: Path, slots: int, layout: str = "node-index") -> mmap.mmap:
    """The index of the namespace of ``layout`` under ``node_path``, made if it is the first."""
    namespace = Namespace(model="m", dtype="bf16", layout=layout)
    node = NodeTierConfig(node_path)
    geometry = NodeGeometry(slots, SLOT_BYTES, namespace.chain_root())
    return open_index(open_directory(node, namespace), geometry, access_of(node))[0]


def locks_in(node_path: Path, layout: str = "node-index") -> EngineLocks:
    """A new engine's handle on the ``engines`` file of the namespace of ``layout`` (one per engine: two handles
    in one process are two engines to each other)."""
    node = NodeTierConfig(node_path)
    return EngineLocks(open_directory(node, Namespace(model="m", dtype="bf16", layout=layout)), access_of(node))


def index_in(node_path: Path, slots: int, layout: str = "node-index") -> NodeIndex:
    """A new engine attached to the namespace's index."""
    return NodeIndex(segment_in(node_path, slots, layout), locks_in(node_path, layout))


def store(index: NodeIndex, stored: list[OffloadKey]) -> HostBlocks:
    """Store ``stored`` (all new) and complete it; the slots it went to."""
    out = index.prepare_store(stored)
    assert out is not None and list(out.keys_to_store) == stored
    index.complete_store(stored)
    assert isinstance(out.store_spec, HostBlocks)
    return out.store_spec


def slot_field(index: NodeIndex, slot: int, field: str) -> int:
    """Where ``field`` (``_nodeindex.LAYOUT``'s ``slot_*``) of ``slot`` lies in the index's segment."""
    return _nodeindex.HEADER_BYTES + slot * _nodeindex.SLOT_BYTES + _nodeindex.LAYOUT[f"slot_{field}"]


def table_offset(index: NodeIndex) -> int:
    """Where the hash table starts in the index's segment."""
    return _nodeindex.HEADER_BYTES + index.capacity * _nodeindex.SLOT_BYTES


def engine_in(node_path: Path, layout: str = "node-engine") -> tuple[NodeIndex, Path]:
    """A new engine of the namespace of ``layout`` with its rank-0 pool file, watching its files as an engine
    does; and the namespace's directory."""
    node = NodeTierConfig(node_path)
    namespace = Namespace(model="m", dtype="bf16", layout=layout)
    directory = open_directory(node, namespace)
    segment, files, _ = open_pool(directory, 0, NodeGeometry(8, SLOT_BYTES, namespace.chain_root()), access_of(node))
    return NodeIndex(segment, EngineLocks(directory, access_of(node)), files), directory
