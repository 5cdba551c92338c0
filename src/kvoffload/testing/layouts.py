"""Ready-made KV cache layouts and engine-shaped tensors, for tests that need a KV cache but no engine.

Each ``*_layout()`` returns ``(layout, make)``: the ``KVCacheLayout`` the scheduler half would build, and
a factory of the tensors an engine would register with the worker half. ``make_kv_caches`` allocates them
for any layout the way an engine does: one raw int8 allocation of ``num_blocks`` rows per buffer (row = the
largest padded page of its layers; cross-layer: the sum of their pages), viewed by each layer as follows:

- attention: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM CPU);
  with ``kv_outermost``: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K rows, then V rows);
- latent attention (MLA): ``[num_blocks, block_size, head_size]`` (vLLM's MLA backends), in every layout;
- state: one int8 ``[num_blocks, 1, 1, page_bytes]`` view of the raw pages, as vLLM 0.32 registers it
  (``state_views`` slices it into the typed per-state views a model layer computes with);
- cross-layer: each layer's view starts at its offset inside the shared row.

Bytes are seeded random values in [1, 63]: never 0 (a block nobody wrote stands out) and never a NaN or inf in
any float dtype (float comparisons stay meaningful).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from kvoffload.layout import (
    AttentionSpec,
    KVBuffer,
    KVCacheLayout,
    KVGroup,
    LatentAttentionSpec,
    LayerSpec,
    StateSpec,
)

EngineKV = dict[str, torch.Tensor]
Made = tuple[KVCacheLayout, Callable[[], EngineKV]]
"""A layout and a factory of engine tensors for it: each call allocates fresh tensors (same seed, same bytes),
so each simulated worker gets its own KV cache."""

_HEADS, _HEAD_SIZE = 2, 8


def make_kv_caches(layout: KVCacheLayout, device: str | torch.device = "cpu", seed: int = 0) -> EngineKV:
    """Engine-shaped tensors for every grouped layer of ``layout``, filled with seeded random bytes."""
    generator = torch.Generator().manual_seed(seed)
    specs = layout.layer_specs
    caches: EngineKV = {}
    for buf in layout.buffers:
        names = [n for n in buf.layer_names if n in specs]
        if not names:
            continue
        pages = [specs[n].page_bytes if layout.cross_layer else specs[n].padded_page_bytes for n in names]
        row = sum(pages) if layout.cross_layer else max(pages)
        raw = torch.randint(1, 64, (layout.num_blocks * row,), generator=generator, dtype=torch.int8)
        raw = raw.to(device)
        offset = 0
        for name, page in zip(names, pages, strict=True):
            caches[name] = _layer_tensors(layout, specs[name], raw, row, offset)
            offset += page if layout.cross_layer else 0
    return caches


def _view(raw: torch.Tensor, dtype: torch.dtype, outer: list[tuple[int, int]], inner: tuple[int, ...],
          offset: int) -> torch.Tensor:
    """``raw`` seen as ``dtype``: ``outer`` dims as (size, stride in bytes), then dense ``inner`` dims."""
    size = dtype.itemsize
    if offset % size or raw.numel() % size or any(stride % size for _, stride in outer):
        raise ValueError(f"a {dtype} view needs offsets and strides that are multiples of {size} bytes")
    inner_strides = [math.prod(inner[d + 1:]) for d in range(len(inner))]
    shape = [n for n, _ in outer] + list(inner)
    strides = [stride // size for _, stride in outer] + inner_strides
    return torch.as_strided(raw.view(dtype), shape, strides, offset // size)


def _layer_tensors(layout: KVCacheLayout, spec: LayerSpec, raw: torch.Tensor, row: int,
                   offset: int) -> torch.Tensor:
    nb = layout.num_blocks
    if isinstance(spec, StateSpec):
        return _view(raw, torch.int8, [(nb, row)], (1, 1, spec.page_bytes), offset)
    if isinstance(spec, LatentAttentionSpec):
        return _view(raw, spec.dtype, [(nb, row)], (spec.block_size, spec.head_size), offset)
    heads, block, head = spec.num_kv_heads, spec.block_size, spec.head_size
    if layout.kv_outermost:
        half = row // 2  # K of every block, then V of every block
        return _view(raw, spec.dtype, [(2, nb * half), (nb, half)], (block, heads, head), offset)
    return _view(raw, spec.dtype, [(nb, row)], (heads, block, 2 * head), offset)


def state_views(spec: StateSpec, pages: torch.Tensor) -> list[torch.Tensor]:
    """The typed ``[num_blocks, *shapes[i]]`` views of each state, cut from a state layer's int8 pages the way
    vLLM's ``MambaBase.bind_kv_cache`` cuts them for the model layer."""
    flat = pages.flatten(1)
    views = []
    for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
        start, end = spec.state_range(i)
        views.append(flat[:, start:end].view(dtype).view(-1, *shape))
    return views


def _attention(block_size: int, dtype: torch.dtype = torch.float16, padded: int | None = None,
               heads: int = _HEADS) -> AttentionSpec:
    return AttentionSpec(block_size, heads, _HEAD_SIZE, dtype, padded)


def _made(layout: KVCacheLayout, device: str | torch.device, seed: int) -> Made:
    return layout, lambda: make_kv_caches(layout, device, seed)


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


def attention_layout(num_layers: int = 2, *, num_blocks: int = 8, block_size: int = 4,
                     num_kv_heads: int = _HEADS, head_size: int = _HEAD_SIZE,
                     dtype: torch.dtype = torch.float16, kv_outermost: bool = False,
                     device: str | torch.device = "cpu", seed: int = 0) -> Made:
    """One group of plain attention layers ``attn.0 ...``, each in its own buffer."""
    spec = AttentionSpec(block_size, num_kv_heads, head_size, dtype)
    group = KVGroup.uniform(_names("attn", num_layers), spec)
    return _made(KVCacheLayout(num_blocks, (group,), kv_outermost=kv_outermost), device, seed)


def padded_layout(num_layers: int = 2, *, num_blocks: int = 8, block_size: int = 4, pad_bytes: int = 64,
                  device: str | torch.device = "cpu", seed: int = 0) -> Made:
    """Like ``attention_layout``, with ``pad_bytes`` of padding after every page."""
    page = _attention(block_size).page_bytes
    group = KVGroup.uniform(_names("attn", num_layers), _attention(block_size, padded=page + pad_bytes))
    return _made(KVCacheLayout(num_blocks, (group,)), device, seed)


def shared_buffer_layout(num_layers: int = 2, *, num_blocks: int = 8, block_size: int = 4,
                         device: str | torch.device = "cpu", seed: int = 0) -> Made:
    """Two groups (full attention ``full.i``, sliding window ``swa.i``) whose layers i share buffer i."""
    spec = _attention(block_size)
    groups = tuple(KVGroup.uniform(_names(kind, num_layers), spec) for kind in ("full", "swa"))
    buffers = tuple(KVBuffer(num_blocks * spec.page_bytes, (f"full.{i}", f"swa.{i}"))
                    for i in range(num_layers))
    return _made(KVCacheLayout(num_blocks, groups, buffers), device, seed)


def multi_group_layout(*, num_blocks: int = 8, block_size: int = 4, device: str | torch.device = "cpu",
                       seed: int = 0) -> Made:
    """Group 0: attention layers with 1 and 4 KV heads; group 1: one float32 layer. Each in its own buffer."""
    specs = {"a.0": _attention(block_size, heads=1), "a.1": _attention(block_size, heads=4)}
    mixed = KVGroup(("a.0", "a.1"), specs)
    wide = KVGroup.uniform(["b.0"], _attention(block_size, torch.float32))
    return _made(KVCacheLayout(num_blocks, (mixed, wide)), device, seed)


def reordered(layout: KVCacheLayout, order: tuple[int, ...], device: str | torch.device = "cpu",
              seed: int = 0) -> Made:
    """``layout`` with its groups in ``order`` (``order[i]`` is the old index of new group ``i``), its layers and
    buffers as they were: e.g. a smaller group first."""
    groups = tuple(layout.groups[i] for i in order)
    return _made(dataclasses.replace(layout, groups=groups), device, seed)


def mamba_layout(num_layers: int = 2, *, num_blocks: int = 8, block_size: int = 4,
                 device: str | torch.device = "cpu", seed: int = 0) -> Made:
    """A hybrid model: attention ``attn.i`` (group 0) and Mamba ``mamba.i`` (group 1) share buffer i.

    A Mamba page is a conv state ``(3, 8)`` float16 then an SSM state ``(2, 4, 4)`` float32 (176 bytes). Both
    pages are padded to the larger one, as vLLM does to let the two layers share one tensor.
    """
    shapes, dtypes = [(3, 8), (2, 4, 4)], [torch.float16, torch.float32]
    page = max(_attention(block_size).page_bytes, StateSpec(shapes, dtypes).page_bytes)
    attn = KVGroup.uniform(_names("attn", num_layers), _attention(block_size, padded=page))
    mamba = KVGroup.uniform(_names("mamba", num_layers), StateSpec(shapes, dtypes, page))
    buffers = tuple(KVBuffer(num_blocks * page, (f"attn.{i}", f"mamba.{i}")) for i in range(num_layers))
    return _made(KVCacheLayout(num_blocks, (attn, mamba), buffers), device, seed)


GDN_SHAPES = ((3, 16), (2, 4, 4))
"""A gated delta net layer's states (Qwen3-Next), as vLLM's ``gated_delta_net_state_shape`` gives them for 1 key
head and 2 value heads of 4 dims and a conv kernel of 4: a conv state ``(kernel - 1, 2 * k_dim + v_dim)`` and a
recurrent state ``(num_v_heads, head_v_dim, head_k_dim)``."""
GDN_DTYPES = (torch.bfloat16, torch.float32)
"""bf16 conv state, float32 recurrent state (vLLM CPU resets the SSM cache dtype to float32)."""


def gdn_layout(num_layers: int = 3, *, num_blocks: int = 8, block_size: int = 4,
               device: str | torch.device = "cpu", seed: int = 0) -> Made:
    """A Qwen3-Next-like hybrid: gated delta net layers ``gdn.i`` (group 0) and bf16 full attention ``attn.i``
    (group 1) sharing buffer i. The GDN page (96 + 128 bytes) is padded to the attention page (256 bytes at the
    default block size), as vLLM pads a hybrid model's state pages."""
    state = StateSpec(GDN_SHAPES, GDN_DTYPES)
    page = max(_attention(block_size, torch.bfloat16).page_bytes, state.page_bytes)
    gdn = KVGroup.uniform(_names("gdn", num_layers), StateSpec(GDN_SHAPES, GDN_DTYPES, page))
    attn = KVGroup.uniform(_names("attn", num_layers), _attention(block_size, torch.bfloat16, padded=page))
    buffers = tuple(KVBuffer(num_blocks * page, (f"gdn.{i}", f"attn.{i}")) for i in range(num_layers))
    return _made(KVCacheLayout(num_blocks, (gdn, attn), buffers), device, seed)


LATENT_HEAD_SIZE = 36
"""A tiny latent vector: ``kv_lora_rank`` 32 + ``qk_rope_head_dim`` 4 (DeepSeek-V2: 512 + 64)."""


def latent_layout(num_layers: int = 2, *, num_blocks: int = 8, block_size: int = 4,
                  head_size: int = LATENT_HEAD_SIZE, dtype: torch.dtype = torch.float16,
                  device: str | torch.device = "cpu", seed: int = 0) -> Made:
    """A DeepSeek-style (MLA) model: one group of latent-attention layers ``mla.i``, each in its own buffer.
    Every rank holds the same bytes (``layout.replicated``)."""
    group = KVGroup.uniform(_names("mla", num_layers), LatentAttentionSpec(block_size, head_size, dtype))
    return _made(KVCacheLayout(num_blocks, (group,)), device, seed)


def cross_layer_layout(num_layers: int = 3, *, num_blocks: int = 8, block_size: int = 4,
                       device: str | torch.device = "cpu", seed: int = 0) -> Made:
    """One group whose layers ``attn.i`` sit side by side in one buffer: row b holds every layer's block b."""
    group = KVGroup.uniform(_names("attn", num_layers), _attention(block_size))
    return _made(KVCacheLayout(num_blocks, (group,), cross_layer=True), device, seed)


ALL_LAYOUTS: dict[str, Callable[..., Made]] = {
    "attention": attention_layout,
    "kv_outermost": lambda **kw: attention_layout(kv_outermost=True, **kw),
    "padded": padded_layout,
    "shared_buffer": shared_buffer_layout,
    "multi_group": multi_group_layout,
    "mamba": mamba_layout,
    "gdn": gdn_layout,
    "cross_layer": cross_layer_layout,
    "latent": latent_layout,
}
"""Every ready-made layout by name; each takes ``num_blocks``, ``block_size``, ``device`` and ``seed``."""
