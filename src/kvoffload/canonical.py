"""Canonical KV: the engine's KV tensors as handlers see them, and ``canonicalize()`` that builds it.

Place in the data flow: the worker half calls ``canonicalize(layout, kv_caches)`` once, when the engine registers
its KV tensors (``layout`` is the ``KVCacheLayout`` from ``layout.py``, whose docstring lists the tensor shapes it
accepts). Transfer handlers only ever see the resulting ``CanonicalKV``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvoffload.layout import KVCacheLayout, LatentAttentionSpec, LayerSpec, StateSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockRef:
    """One layer's part of an engine block: row ``block_id`` of ``views[view]``, first ``nbytes`` bytes."""

    view: int
    nbytes: int


@dataclass(frozen=True)
class CanonicalKV:
    """The engine's KV cache as handlers see it.

    ``views``: int8 tensors shaped ``(num_blocks, page_bytes)``, one per distinct backing buffer (or per K/V
    half); row ``b`` holds engine block ``b``. Views alias the engine's memory; writing a view writes the
    cache.
    ``group_refs[g]``: the ordered refs that make up one block of KV-cache group ``g``. A block of group ``g``
    is copied as the concatenation of ``views[r.view][block_id, :r.nbytes]`` for ``r`` in ``group_refs[g]``.
    """

    views: tuple[torch.Tensor, ...]
    group_refs: tuple[tuple[BlockRef, ...], ...]
    num_blocks: int

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one engine block of ``group`` once copied (padding excluded)."""
        return sum(r.nbytes for r in self.group_refs[group])

    @property
    def max_block_bytes(self) -> int:
        return max(self.group_block_bytes(g) for g in range(len(self.group_refs)))

    def describe(self) -> str:
        """A stable text of the layout, for the key namespace: same text, same page bytes."""
        groups = ";".join(",".join(f"{r.view}:{r.nbytes}" for r in refs) for refs in self.group_refs)
        pages = ",".join(str(v.shape[1]) for v in self.views)
        return f"pages={pages}|groups={groups}"


# ------------------------------------------------------------------------------------------------------------
# canonicalize(): engine tensors -> CanonicalKV

KVCaches = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class _Strip:
    """Memory holding one page (or page part) per block: block ``b`` at ``address + b * stride``."""

    layer: str
    tensor: torch.Tensor
    """Any tensor on the strip's storage: gives its device and storage."""
    address: int
    stride: int
    nbytes: int
    """Bytes of a block that hold data (the rest of the stride is padding)."""


def canonicalize(layout: KVCacheLayout, kv_caches: KVCaches) -> CanonicalKV:
    """Turn the engine's ``{layer: tensor}`` into aliasing int8 views and group refs.

    Raises:
        ValueError: a tensor disagrees with ``layout`` (names, block count, dtype, page size, strides, memory
            sharing); the message names the layer or buffer.
    """
    _check_names(layout, kv_caches)
    specs = layout.layer_specs
    strips = {name: _layer_strips(layout, name, spec, kv_caches[name]) for name, spec in specs.items()}
    views: list[torch.Tensor] = []
    view_ids: dict[str, tuple[int, ...]] = {}
    spans: list[tuple[str, _Strip, int]] = []
    for i, buf in enumerate(layout.buffers):
        names = [n for n in buf.layer_names if n in specs]
        if not names:
            continue  # a slot that no grouped layer uses: nothing to copy
        merged = _buffer_strips(layout, i, names, strips)
        view_ids.update(dict.fromkeys(names, tuple(range(len(views), len(views) + len(merged)))))
        for strip in merged:
            views.append(_int8_view(strip, layout.num_blocks))
            spans.append((f"buffer {i} {tuple(names)}", strip, views[-1].shape[1]))
    _check_disjoint(spans, layout.num_blocks)
    refs = tuple(_group_refs(layout, g, view_ids, strips) for g in range(len(layout.groups)))
    kv = CanonicalKV(tuple(views), refs, layout.num_blocks)
    logger.debug("canonical KV: %d views of %d blocks, block bytes per group %s", len(views),
                 layout.num_blocks, [kv.group_block_bytes(g) for g in range(len(refs))])
    return kv


def _check_names(layout: KVCacheLayout, kv_caches: KVCaches) -> None:
    known = set(layout.layer_specs) | {n for buf in layout.buffers for n in buf.layer_names}
    unknown = sorted(set(kv_caches) - known)
    if unknown:
        raise ValueError(f"kv_caches has layers {unknown} that the layout does not know")
    missing = [n for n in layout.layer_specs if n not in kv_caches]
    if missing:
        raise ValueError(f"kv_caches lacks layers {missing} of the layout")


def _layer_strips(layout: KVCacheLayout, name: str, spec: LayerSpec, value: object) -> list[_Strip]:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"layer {name!r}: needs one tensor, got {type(value).__name__}")
    if isinstance(spec, StateSpec):
        # vLLM 0.32 hands a state layer over as its raw pages, whatever the states' own dtypes.
        if value.dtype != torch.int8:
            raise ValueError(f"layer {name!r}: a state layer's tensor must be its int8 pages, got {value.dtype}")
        return [_strip(name, value, 0, layout.num_blocks, spec.page_bytes)]
    _check_dtype(name, value, spec.dtype)
    if not layout.kv_outermost or isinstance(spec, LatentAttentionSpec):  # a latent page has no K/V halves
        return [_strip(name, value, 0, layout.num_blocks, spec.page_bytes)]
    if value.dim() < 2 or value.shape[0] != 2:
        raise ValueError(f"layer {name!r}: kv_outermost wants [2, num_blocks, ...], got {list(value.shape)}")
    if _dense_bytes(value, 1) is not None:
        return [_strip(name, value, 1, layout.num_blocks, spec.page_bytes)]  # K/V dim inside each block
    return [_strip(name, value[kv], 0, layout.num_blocks, spec.page_bytes // 2) for kv in (0, 1)]


def _check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"layer {name!r}: tensor dtype {tensor.dtype} differs from the spec's {dtype}")


def _dense_bytes(tensor: torch.Tensor, block_dim: int) -> int | None:
    """Bytes of one block if the dims other than ``block_dim`` tile a gap-free region from its start."""
    dims = sorted((tensor.stride(d), tensor.shape[d]) for d in range(tensor.dim())
                  if d != block_dim and tensor.shape[d] != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return expected * tensor.element_size()


def _strip(name: str, tensor: torch.Tensor, block_dim: int, num_blocks: int, page_bytes: int) -> _Strip:
    if tensor.dim() <= block_dim or tensor.shape[block_dim] != num_blocks:
        raise ValueError(f"layer {name!r}: shape {list(tensor.shape)} does not have {num_blocks} blocks "
                         f"in dim {block_dim}")
    dense = _dense_bytes(tensor, block_dim)
    if dense is None:
        raise ValueError(f"layer {name!r}: a block's page is not one gap-free region "
                         f"(shape {list(tensor.shape)}, stride {list(tensor.stride())})")
    if dense != page_bytes:
        raise ValueError(f"layer {name!r}: a block holds {dense} bytes but the spec says {page_bytes}")
    stride = tensor.stride(block_dim) * tensor.element_size()
    if stride < page_bytes:
        raise ValueError(f"layer {name!r}: block stride {stride} is smaller than the page of {page_bytes}")
    return _Strip(name, tensor, tensor.data_ptr(), stride, page_bytes)


def _buffer_strips(layout: KVCacheLayout, i: int, names: list[str],
                   strips: Mapping[str, list[_Strip]]) -> list[_Strip]:
    """One strip per view of buffer ``i``."""
    if layout.cross_layer:
        return [_cross_layer_strip(i, names, strips)]
    return _shared_strips(i, names, strips)


def _same_memory(a: _Strip, b: _Strip) -> bool:
    return a.tensor.device == b.tensor.device and a.address == b.address and a.stride == b.stride


def _shared_strips(i: int, names: list[str], strips: Mapping[str, list[_Strip]]) -> list[_Strip]:
    """Layers sharing buffer ``i`` must see the same memory; the largest page stands for all of them."""
    first = strips[names[0]]
    for name in names[1:]:
        own = strips[name]
        if len(own) != len(first) or not all(map(_same_memory, own, first)):
            raise ValueError(f"buffer {i}: layers {names[0]!r} and {name!r} share it but disagree on "
                             "address, block stride or K/V split")
    return [max((strips[n][k] for n in names), key=lambda s: s.nbytes) for k in range(len(first))]


def _cross_layer_strip(i: int, names: list[str], strips: Mapping[str, list[_Strip]]) -> _Strip:
    """Layers of cross-layer buffer ``i`` sit side by side in each block, in order, with no gaps."""
    first = strips[names[0]][0]
    offset = 0
    for name in names:
        (own,) = strips[name]
        if own.tensor.device != first.tensor.device or own.stride != first.stride:
            raise ValueError(f"cross-layer buffer {i}: layer {name!r} has another device or block stride")
        if own.address - first.address != offset:
            raise ValueError(f"cross-layer buffer {i}: layer {name!r} does not start where the last one ends")
        offset += own.nbytes
    if first.stride < offset:
        raise ValueError(f"cross-layer buffer {i}: block stride {first.stride} is less than {offset} bytes")
    return _Strip(names[0], first.tensor, first.address, first.stride, offset)


def _int8_view(strip: _Strip, num_blocks: int) -> torch.Tensor:
    """Rows of ``stride`` bytes (only the used bytes if the storage ends sooner), aliasing the engine's."""
    storage = strip.tensor.untyped_storage()
    offset = strip.address - storage.data_ptr()
    last_row = offset + (num_blocks - 1) * strip.stride
    width = strip.stride if last_row + strip.stride <= storage.nbytes() else strip.nbytes
    # Every block's used bytes lie inside a tensor on this storage, so this holds; it is checked anyway because
    # the copiers write through raw addresses derived from these views.
    if offset < 0 or last_row + width > storage.nbytes():
        raise ValueError(f"{strip.layer}: its pages overrun the tensor's storage")
    flat = torch.empty(0, dtype=torch.int8, device=strip.tensor.device).set_(storage)
    return flat.as_strided((num_blocks, width), (strip.stride, 1), offset)


def _check_disjoint(spans: list[tuple[str, _Strip, int]], num_blocks: int) -> None:
    """Views of different buffers must not overlap: that would be shared memory the layout did not declare."""
    ranges = sorted((str(s.tensor.device), s.address, s.address + (num_blocks - 1) * s.stride + width, label)
                    for label, s, width in spans)
    for (dev_a, _, end_a, label_a), (dev_b, start_b, _, label_b) in itertools.pairwise(ranges):
        if dev_a == dev_b and start_b < end_a:
            raise ValueError(f"{label_a} and {label_b} overlap in memory but are not declared as one buffer")


def _group_refs(layout: KVCacheLayout, g: int, view_ids: Mapping[str, tuple[int, ...]],
                strips: Mapping[str, list[_Strip]]) -> tuple[BlockRef, ...]:
    names = layout.groups[g].layer_names
    if layout.cross_layer:  # one ref per buffer, covering all of its layers (all of them in this group)
        views = list(dict.fromkeys(view_ids[n][0] for n in names))
        return tuple(BlockRef(v, sum(strips[n][0].nbytes for n in names if view_ids[n][0] == v))
                     for v in views)
    return tuple(BlockRef(view, strip.nbytes) for n in names
                 for view, strip in zip(view_ids[n], strips[n], strict=True))
