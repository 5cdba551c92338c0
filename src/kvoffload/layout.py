"""KV cache layout: a description of an engine's KV tensors, without the tensors.

Place in the data flow: the scheduler half builds a ``KVCacheLayout`` from the engine's KV-cache config
(no tensors) to size the tiers (``group_block_bytes``) and name the key namespace (``describe``). The worker
half calls ``canonical.canonicalize(layout, kv_caches)`` once, when the engine registers its KV tensors; transfer
handlers only ever see the resulting ``CanonicalKV``.

    KVCacheLayout(num_blocks, groups, buffers=(), kv_outermost=False, cross_layer=False, backend="")
      groups[g]   KVGroup(layer_names, specs)        layers sharing one block table; specs may differ
        specs[n]  AttentionSpec | LatentAttentionSpec | StateSpec   one engine block of layer n (unpadded bytes)
      buffers[i]  KVBuffer(size_bytes, layer_names)  one backing allocation and the layers living in it

Buffers default to one per layer. Layers listed in one buffer share memory: block ``b`` of each starts at
the same address (vLLM gives attention layer 3 of group 0 and Mamba layer 3 of group 1 one tensor, both
pages padded to one size); two layers of one group never share memory. With ``cross_layer`` a buffer instead
holds its layers side by side in every block (row ``b`` = layer 0's page, layer 1's page, ...), all of one
group; by default each group then gets one such buffer.

``kv_caches[layer]`` as ``canonicalize`` accepts it:

- ``AttentionSpec``: a tensor ``[num_blocks, ...]`` whose other dims tile the page densely, in any order
  (vLLM CPU: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``). With ``kv_outermost``:
  ``[2, num_blocks, ...]``, dim 0 being K and V; a K/V dim that lies physically inside each block (a
  permuted view of block-first memory) counts as block-first.
- ``LatentAttentionSpec`` (MLA, DeepSeek-style latent attention): a tensor ``[num_blocks, ...]`` whose other
  dims tile the page densely (vLLM 0.32: ``[num_blocks, 1, block_size, head_size]``, head_size =
  ``kv_lora_rank + qk_rope_head_dim``). There is no K/V split, so ``kv_outermost`` (which is about K/V
  layers) never applies to it: a latent layer is block-first in every layout.
- ``StateSpec``: one int8 tensor ``[num_blocks, ...]`` of the layer's raw pages, its other dims tiling the
  ``page_bytes`` of a block densely (vLLM 0.32, GPU and CPU: ``[num_blocks, 1, 1, page_bytes]``, rows
  ``page_size_padded`` apart or as far apart as the buffer's block stride). Inside a page the states lie packed
  in order from byte 0 (``state_range``), as vLLM's ``MambaBase.bind_kv_cache`` slices them (Mamba2's
  ``conv_state`` then ``ssm_state``).
- cross-layer: each layer's view of the shared tensor ``t`` (``{name_i: t[:, i]}`` for a
  ``[num_blocks, num_layers, ...]`` tensor).

Canonical form: one int8 view ``(num_blocks, block stride in bytes)`` per buffer that a grouped layer uses
(two, K then V, for a K/V-outermost buffer), aliasing the engine memory. Group ``g``'s refs: for each layer
of ``g`` in order, one ref per view of its buffer with the layer's unpadded bytes (half a page for K or V);
a cross-layer buffer gives one ref for all its layers. Padding is never copied. Every mismatch between the
layout and the tensors raises ``ValueError`` naming the layer or buffer.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

LAYOUT_TEXT_VERSION = 1


# ------------------------------------------------------------------------------------------------------------
# The description: no tensors, so the scheduler half can build it.


def as_dtype(value: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; else ValueError."""
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{value!r} is not a torch dtype")
    return found


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _positive(owner: str, **values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {v!r}")


def _check_padding(owner: str, padded: int | None, page_bytes: int) -> None:
    if padded is None:
        return
    if isinstance(padded, bool) or not isinstance(padded, int) or padded < page_bytes:
        raise ValueError(f"{owner}.page_size_padded {padded!r} is not an int >= its {page_bytes} bytes")


@dataclass(frozen=True, init=False)
class AttentionSpec:
    """An attention layer's block: K and V of ``block_size`` tokens; ``page_size_padded`` in bytes."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = None

    def __init__(self, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype | str,
                 page_size_padded: int | None = None) -> None:
        _positive("AttentionSpec", block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size)
        values = (block_size, num_kv_heads, head_size, as_dtype(dtype), page_size_padded)
        for name, value in zip(self.__dataclass_fields__, values, strict=True):
            object.__setattr__(self, name, value)
        _check_padding("AttentionSpec", page_size_padded, self.page_bytes)

    @property
    def page_bytes(self) -> int:
        """Unpadded bytes of one block: K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def padded_page_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.page_bytes

    def describe(self) -> str:
        return f"attn({self.block_size},{self.num_kv_heads},{self.head_size},{_dtype_name(self.dtype)})"


@dataclass(frozen=True, init=False)
class LatentAttentionSpec:
    """A latent-attention (MLA) layer's block: one latent vector of ``head_size`` per token, no K/V split.

    Under tensor parallelism every rank holds the same latent bytes (vLLM replicates the latent cache: its
    ``num_kv_heads`` is 1 whatever the TP size), which is what lets a layout of such layers be stored once for
    all ranks (``KVCacheLayout.replicated``).
    """

    block_size: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = None

    def __init__(self, block_size: int, head_size: int, dtype: torch.dtype | str,
                 page_size_padded: int | None = None) -> None:
        _positive("LatentAttentionSpec", block_size=block_size, head_size=head_size)
        values = (block_size, head_size, as_dtype(dtype), page_size_padded)
        for name, value in zip(self.__dataclass_fields__, values, strict=True):
            object.__setattr__(self, name, value)
        _check_padding("LatentAttentionSpec", page_size_padded, self.page_bytes)

    @property
    def page_bytes(self) -> int:
        """Unpadded bytes of one block: one latent vector per token."""
        return self.block_size * self.head_size * self.dtype.itemsize

    @property
    def padded_page_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.page_bytes

    def describe(self) -> str:
        return f"latent({self.block_size},{self.head_size},{_dtype_name(self.dtype)})"


@dataclass(frozen=True, init=False)
class StateSpec:
    """A state layer's block (Mamba2, ShortConv, gated delta net): typed states packed, in order, into one page.

    ``page_size_padded``: the page's bytes with padding (vLLM pads a state page to the attention page so both
    can share one buffer); only ``page_bytes`` are copied.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    def __init__(self, shapes: Iterable[Iterable[int]], dtypes: Iterable[torch.dtype | str],
                 page_size_padded: int | None = None) -> None:
        shapes_t = tuple(tuple(s) for s in shapes)
        dtypes_t = tuple(as_dtype(d) for d in dtypes)
        if not shapes_t or len(shapes_t) != len(dtypes_t):
            raise ValueError(f"StateSpec needs one dtype per state shape, got {shapes_t} and {dtypes_t}")
        for i, shape in enumerate(shapes_t):
            _positive("StateSpec", **{f"shapes[{i}][{d}]": n for d, n in enumerate(shape)})
        object.__setattr__(self, "shapes", shapes_t)
        object.__setattr__(self, "dtypes", dtypes_t)
        object.__setattr__(self, "page_size_padded", page_size_padded)
        _check_padding("StateSpec", page_size_padded, self.page_bytes)

    def state_bytes(self, i: int) -> int:
        """Bytes of state ``i`` in one block."""
        return math.prod(self.shapes[i]) * self.dtypes[i].itemsize

    def state_range(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of state ``i`` inside a block's page: the states are packed in order."""
        start = sum(self.state_bytes(j) for j in range(i))
        return start, start + self.state_bytes(i)

    @property
    def page_bytes(self) -> int:
        return sum(self.state_bytes(i) for i in range(len(self.shapes)))

    @property
    def padded_page_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.page_bytes

    def describe(self) -> str:
        pairs = zip(self.shapes, self.dtypes, strict=True)
        states = (f"{'x'.join(map(str, s))}:{_dtype_name(d)}" for s, d in pairs)
        return f"state({','.join(states)})"


LayerSpec = AttentionSpec | LatentAttentionSpec | StateSpec


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: its layers in copy order, and each layer's spec (may differ within a group)."""

    layer_names: tuple[str, ...]
    specs: Mapping[str, LayerSpec] = field(hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        object.__setattr__(self, "specs", dict(self.specs))
        if not self.layer_names or len(set(self.layer_names)) != len(self.layer_names):
            raise ValueError(f"KVGroup layer names must be non-empty and distinct, got {self.layer_names}")
        if set(self.specs) != set(self.layer_names):
            odd = sorted(set(self.specs) ^ set(self.layer_names))
            raise ValueError(f"KVGroup: layers {odd} are in only one of layer_names and specs")

    @classmethod
    def uniform(cls, layer_names: Iterable[str], spec: LayerSpec) -> KVGroup:
        """A group whose layers all have ``spec``."""
        names = tuple(layer_names)
        return cls(names, dict.fromkeys(names, spec))

    @property
    def block_bytes(self) -> int:
        """Unpadded bytes of one block of this group, all layers."""
        return sum(spec.page_bytes for spec in self.specs.values())


@dataclass(frozen=True)
class KVBuffer:
    """A backing allocation of ``size_bytes`` and the layers that live in it (vLLM's ``KVCacheTensor``)."""

    size_bytes: int
    layer_names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int) or self.size_bytes < 0:
            raise ValueError(f"KVBuffer {self.layer_names}: size_bytes must be a non-negative integer")


@dataclass(frozen=True)
class KVCacheLayout:
    """An engine's whole KV cache, described without tensors (see the module docstring).

    ``buffers`` defaults to one buffer per layer (with ``cross_layer``: one per group). ``backend`` names the
    page format (e.g. the attention backend): it decides the byte order inside a page, so ``describe()``
    includes it.
    """

    num_blocks: int
    groups: tuple[KVGroup, ...]
    buffers: tuple[KVBuffer, ...] = ()
    kv_outermost: bool = False
    cross_layer: bool = False
    backend: str = ""

    def __post_init__(self) -> None:
        _positive("KVCacheLayout", num_blocks=self.num_blocks)
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise ValueError("KVCacheLayout needs at least one KV-cache group")
        if self.kv_outermost and self.cross_layer:
            raise ValueError("KVCacheLayout: kv_outermost and cross_layer cannot be combined")
        object.__setattr__(self, "buffers", tuple(self.buffers) or self._default_buffers())
        _check_layout(self)

    def _default_buffers(self) -> tuple[KVBuffer, ...]:
        if self.cross_layer:
            return tuple(KVBuffer(self.num_blocks * g.block_bytes, g.layer_names) for g in self.groups)
        return tuple(KVBuffer(self.num_blocks * spec.padded_page_bytes, (name,))
                     for g in self.groups for name, spec in g.specs.items())

    @property
    def state_groups(self) -> tuple[int, ...]:
        """Groups whose layers all keep a running state (Mamba-style): block ``p`` holds the state after block
        ``p``'s tokens, so a prefix needs only its last block of such a group, not all of them."""
        return tuple(g for g, group in enumerate(self.groups)
                     if all(isinstance(spec, StateSpec) for spec in group.specs.values()))

    @property
    def replicated(self) -> bool:
        """True when every layer is latent attention: every tensor-parallel rank then holds the same bytes, so a
        shared tier keeps one copy for all ranks. A layout that mixes in any other layer stays per rank."""
        return all(isinstance(spec, LatentAttentionSpec) for spec in self.layer_specs.values())

    @property
    def layer_specs(self) -> dict[str, LayerSpec]:
        """Every grouped layer's spec."""
        return {name: spec for g in self.groups for name, spec in g.specs.items()}

    def group_block_bytes(self, group: int) -> int:
        """Bytes copied per engine block of ``group`` (no padding); equals ``CanonicalKV``'s figure."""
        return self.groups[group].block_bytes

    def describe(self) -> str:
        """Stable text of everything that decides a block's bytes, for the key namespace.

        Leaves out what does not change them: ``num_blocks``, buffer sizes, padding, layer names.
        """
        groups = ";".join(_run_lengths(g.specs[n].describe() for n in g.layer_names) for g in self.groups)
        return (f"layout-v{LAYOUT_TEXT_VERSION}|backend={self.backend}|kv_outermost={int(self.kv_outermost)}"
                f"|cross_layer={int(self.cross_layer)}|groups={groups}")


def _run_lengths(texts: Iterable[str]) -> str:
    return ",".join(f"{text}*{len(list(run))}" for text, run in itertools.groupby(texts))


def _check_layout(layout: KVCacheLayout) -> None:
    owner: dict[str, int] = {}
    for g, group in enumerate(layout.groups):
        for name in group.layer_names:
            if name in owner:
                raise ValueError(f"layer {name!r} is in groups {owner[name]} and {g}")
            owner[name] = g
    placed: dict[str, int] = {}
    for i, buf in enumerate(layout.buffers):
        for name in buf.layer_names:
            if name in placed:
                raise ValueError(f"layer {name!r} is listed in buffers {placed[name]} and {i}")
            placed[name] = i
        _check_buffer(layout, i, buf, owner)
    unplaced = [name for name in owner if name not in placed]
    if unplaced:
        raise ValueError(f"layers {unplaced} are in no KVBuffer")


def _check_buffer(layout: KVCacheLayout, i: int, buf: KVBuffer, owner: Mapping[str, int]) -> None:
    grouped = [n for n in buf.layer_names if n in owner]
    specs = layout.layer_specs
    label = f"buffer {i} {buf.layer_names}"
    if layout.cross_layer:
        if len(grouped) != len(buf.layer_names) or len({owner[n] for n in grouped}) > 1:
            raise ValueError(f"cross-layer {label}: its layers must all be of one group")
        order = [n for n in layout.groups[owner[grouped[0]]].layer_names if n in grouped] if grouped else []
        if order != grouped:
            raise ValueError(f"cross-layer {label}: its layers must follow their group's order")
        need = sum(specs[n].page_bytes for n in grouped)
    else:
        groups = [owner[n] for n in grouped]
        if len(set(groups)) != len(groups):
            raise ValueError(f"{label}: two layers of one group cannot share memory")
        need = max((specs[n].page_bytes for n in grouped), default=0)
    if buf.size_bytes < layout.num_blocks * need:
        raise ValueError(f"{label}: {buf.size_bytes} bytes cannot hold {layout.num_blocks} blocks of {need}")
