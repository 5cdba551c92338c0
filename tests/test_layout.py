"""canonicalize() on engine-shaped CPU tensors: views alias the right bytes; errors name culprits."""

from __future__ import annotations

import pytest
import torch

from kvoffload.canonical import CanonicalKV, canonicalize
from kvoffload.layout import AttentionSpec, KVBuffer, KVCacheLayout, KVGroup, LatentAttentionSpec, StateSpec
from kvoffload.testing.layouts import (
    ALL_LAYOUTS,
    attention_layout,
    cross_layer_layout,
    latent_layout,
    make_kv_caches,
    mamba_layout,
    padded_layout,
    shared_buffer_layout,
    state_views,
)

SPEC = AttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)  # 256-byte pages
LATENT = LatentAttentionSpec(block_size=4, head_size=36, dtype=torch.float16)  # 288-byte pages, no K/V halves
NUM_BLOCKS = 8


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int8)


def layer_block(layout: KVCacheLayout, value: torch.Tensor, b: int) -> torch.Tensor:
    """The bytes of engine block ``b`` of one layer, read through the engine's own tensor."""
    if layout.kv_outermost:
        return torch.cat([as_bytes(value[0, b]), as_bytes(value[1, b])])
    return as_bytes(value[b])


def canonical_block(kv: CanonicalKV, g: int, b: int) -> torch.Tensor:
    return torch.cat([kv.views[r.view][b, :r.nbytes] for r in kv.group_refs[g]])


def one_group(*names: str, spec: AttentionSpec = SPEC, **kw: object) -> KVCacheLayout:
    return KVCacheLayout(NUM_BLOCKS, (KVGroup.uniform(names, spec),), **kw)  # type: ignore[arg-type]


def engine_tensor(num_blocks: int = NUM_BLOCKS, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """vLLM CPU's attention shape: [num_blocks, num_kv_heads, block_size, 2 * head_size]."""
    return torch.randn(num_blocks, 2, 4, 16).to(dtype)


# ---- every ready-made layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_LAYOUTS))
def test_each_group_block_is_its_layers_engine_blocks_in_order(name: str) -> None:
    layout, make = ALL_LAYOUTS[name]()
    caches = make()
    kv = canonicalize(layout, caches)
    for g, group in enumerate(layout.groups):
        for b in range(layout.num_blocks):
            expected = torch.cat([layer_block(layout, caches[n], b) for n in group.layer_names])
            assert torch.equal(canonical_block(kv, g, b), expected)


@pytest.mark.parametrize("name", sorted(ALL_LAYOUTS))
def test_layout_and_canonical_agree_on_group_block_bytes(name: str) -> None:
    layout, make = ALL_LAYOUTS[name](block_size=16)
    kv = canonicalize(layout, make())
    assert [layout.group_block_bytes(g) for g in range(len(layout.groups))] == [
        kv.group_block_bytes(g) for g in range(len(layout.groups))]
    assert all(v.dtype == torch.int8 and v.shape[0] == layout.num_blocks for v in kv.views)


@pytest.mark.parametrize("name", sorted(ALL_LAYOUTS))
def test_writing_a_view_writes_the_engine_cache(name: str) -> None:
    layout, make = ALL_LAYOUTS[name]()
    caches = make()
    kv = canonicalize(layout, caches)
    for ref in kv.group_refs[-1]:
        kv.views[ref.view][3, :ref.nbytes] = 0
    last = layout.groups[-1].layer_names[-1]
    assert not layer_block(layout, caches[last], 3).any()
    assert layer_block(layout, caches[last], 2).all()  # the neighbour block is untouched


def test_factory_gives_fresh_tensors_with_the_same_bytes() -> None:
    _, make = attention_layout()
    a, b = make(), make()
    assert isinstance(a["attn.0"], torch.Tensor) and isinstance(b["attn.0"], torch.Tensor)
    assert a["attn.0"].data_ptr() != b["attn.0"].data_ptr()
    assert torch.equal(as_bytes(a["attn.0"]), as_bytes(b["attn.0"]))


# ---- the cases one by one ----------------------------------------------------------------------------------


def test_plain_attention_gets_one_view_per_layer() -> None:
    layout, make = attention_layout(num_layers=3)
    kv = canonicalize(layout, make())
    assert [tuple(v.shape) for v in kv.views] == [(NUM_BLOCKS, 256)] * 3
    assert [(r.view, r.nbytes) for r in kv.group_refs[0]] == [(0, 256), (1, 256), (2, 256)]


def test_padded_pages_give_padded_rows_but_copy_only_unpadded_bytes() -> None:
    layout, make = padded_layout(pad_bytes=64)
    kv = canonicalize(layout, make())
    assert {v.shape[1] for v in kv.views} == {256 + 64}
    assert {r.nbytes for r in kv.group_refs[0]} == {256}


def test_padding_missing_after_the_last_block_narrows_rows_to_the_page() -> None:
    raw = torch.randn(NUM_BLOCKS * 160 - 32).half()  # 320-byte rows, the last one without its padding
    tensor = torch.as_strided(raw, (NUM_BLOCKS, 2, 4, 16), (160, 64, 16, 1))
    kv = canonicalize(one_group("x", spec=AttentionSpec(4, 2, 8, "float16", 320)), {"x": tensor})
    assert tuple(kv.views[0].shape) == (NUM_BLOCKS, 256) and kv.views[0].stride(0) == 320
    assert torch.equal(kv.views[0][NUM_BLOCKS - 1], as_bytes(tensor[NUM_BLOCKS - 1]))


def test_layers_sharing_a_buffer_get_one_view_and_a_ref_in_each_group() -> None:
    layout, make = shared_buffer_layout(num_layers=2)
    kv = canonicalize(layout, make())
    assert len(kv.views) == 2
    assert kv.group_refs[0] == kv.group_refs[1]


def test_state_page_starts_at_the_first_state_and_covers_every_state() -> None:
    layout, make = mamba_layout(num_layers=1)
    caches = make()
    kv = canonicalize(layout, caches)
    spec = layout.groups[1].specs["mamba.0"]
    assert isinstance(spec, StateSpec)
    conv, ssm = state_views(spec, caches["mamba.0"])
    (ref,) = kv.group_refs[1]
    assert kv.views[ref.view].data_ptr() == conv.data_ptr()
    assert ref.nbytes == conv[0].numel() * 2 + ssm[0].numel() * 4
    assert spec.state_range(1) == (48, ref.nbytes)
    assert torch.equal(kv.views[ref.view][5, 48:ref.nbytes], as_bytes(ssm[5]))
    ssm[5] = 0.0  # a write through the model layer's view is a write of the canonical block
    assert not kv.views[ref.view][5, 48:ref.nbytes].any() and kv.views[ref.view][5, :48].all()


def test_kv_outermost_splits_each_layer_into_k_and_v_views() -> None:
    layout, make = attention_layout(num_layers=1, kv_outermost=True)
    caches = make()
    kv = canonicalize(layout, caches)
    (t,) = caches.values()
    assert isinstance(t, torch.Tensor)
    assert [(r.view, r.nbytes) for r in kv.group_refs[0]] == [(0, 128), (1, 128)]
    assert torch.equal(kv.views[0][6], as_bytes(t[0, 6])) and torch.equal(kv.views[1][6], as_bytes(t[1, 6]))


def test_kv_dim_inside_each_block_counts_as_block_first() -> None:
    block_first = torch.randn(NUM_BLOCKS, 2, 4, 2, 8).half()  # [blocks, K/V, tokens, heads, head]
    kv = canonicalize(one_group("x", kv_outermost=True), {"x": block_first.transpose(0, 1)})
    assert [tuple(v.shape) for v in kv.views] == [(NUM_BLOCKS, 256)]
    assert torch.equal(kv.views[0][2], as_bytes(block_first[2]))


def test_cross_layer_buffer_is_one_view_with_one_ref_per_group() -> None:
    layout, make = cross_layer_layout(num_layers=3)
    kv = canonicalize(layout, make())
    assert [tuple(v.shape) for v in kv.views] == [(NUM_BLOCKS, 3 * 256)]
    assert [(r.view, r.nbytes) for r in kv.group_refs[0]] == [(0, 3 * 256)]


def test_one_block_outermost_tensor_passed_as_per_layer_slices() -> None:
    whole = torch.randn(NUM_BLOCKS, 2, 2, 4, 16).half()  # [blocks, layers, heads, tokens, 2 * head]
    kv = canonicalize(one_group("l0", "l1", cross_layer=True), {"l0": whole[:, 0], "l1": whole[:, 1]})
    assert torch.equal(kv.views[0][4], as_bytes(whole[4]))


def test_buffer_slot_without_a_grouped_layer_gets_no_view() -> None:
    buffers = (KVBuffer(0, ()), KVBuffer(NUM_BLOCKS * 256, ("spare",)), KVBuffer(NUM_BLOCKS * 256, ("x",)))
    layout = one_group("x", buffers=buffers)
    kv = canonicalize(layout, {"x": engine_tensor(), "spare": engine_tensor()})
    assert len(kv.views) == 1 and kv.group_refs == ((kv.group_refs[0][0],),)


def test_multi_group_keeps_per_layer_specs_in_group_order() -> None:
    layout, make = ALL_LAYOUTS["multi_group"]()
    kv = canonicalize(layout, make())
    assert [r.nbytes for r in kv.group_refs[0]] == [128, 512]
    assert [r.nbytes for r in kv.group_refs[1]] == [512]


def test_tensors_made_in_inference_mode_can_be_written_through_views() -> None:
    layout, _ = attention_layout(num_layers=1)
    with torch.inference_mode():
        caches = make_kv_caches(layout)
    kv = canonicalize(layout, caches)
    kv.views[0][1] = 0
    assert not layer_block(layout, caches["attn.0"], 1).any()


def test_latent_layer_is_one_view_of_its_whole_page() -> None:
    layout, make = latent_layout(num_layers=2)
    caches = make()
    kv = canonicalize(layout, caches)
    assert tuple(caches["mla.0"].shape) == (NUM_BLOCKS, 4, 36)  # vLLM's [num_blocks, block_size, head_size]
    assert [tuple(v.shape) for v in kv.views] == [(NUM_BLOCKS, 288)] * 2
    assert [(r.view, r.nbytes) for r in kv.group_refs[0]] == [(0, 288), (1, 288)]
    assert torch.equal(kv.views[1][3], as_bytes(caches["mla.1"][3]))


def test_latent_layer_has_no_k_and_v_halves_even_beside_kv_outermost_layers() -> None:
    layout = KVCacheLayout(NUM_BLOCKS, (KVGroup(("attn", "mla"), {"attn": SPEC, "mla": LATENT}),),
                           kv_outermost=True)
    latent = torch.randn(NUM_BLOCKS, 4, 36).half()
    kv = canonicalize(layout, {"attn": torch.randn(2, NUM_BLOCKS, 4, 2, 8).half(), "mla": latent})
    assert [(r.view, r.nbytes) for r in kv.group_refs[0]] == [(0, 128), (1, 128), (2, 288)]
    assert torch.equal(kv.views[2][5], as_bytes(latent[5]))


def test_only_a_layout_of_latent_layers_alone_is_replicated() -> None:
    assert latent_layout()[0].replicated
    mixed = KVCacheLayout(NUM_BLOCKS, (KVGroup.uniform(["mla"], LATENT), KVGroup.uniform(["attn"], SPEC)))
    assert not mixed.replicated
    assert not any(ALL_LAYOUTS[name]()[0].replicated for name in ALL_LAYOUTS if name != "latent")


# ---- errors name their culprit -----------------------------------------------------------------------------


def test_unknown_layer_in_kv_caches_is_named() -> None:
    with pytest.raises(ValueError, match="stray"):
        canonicalize(one_group("x"), {"x": engine_tensor(), "stray": engine_tensor()})


def test_layer_missing_from_kv_caches_is_named() -> None:
    with pytest.raises(ValueError, match="'y'"):
        canonicalize(one_group("x", "y"), {"x": engine_tensor()})


@pytest.mark.parametrize(("tensor", "problem"), [
    (engine_tensor(num_blocks=NUM_BLOCKS - 1), "blocks"),
    (torch.randn(NUM_BLOCKS, 2, 4, 8).half(), "spec says 256"),  # half a page
    (engine_tensor(dtype=torch.bfloat16), "dtype"),
    (engine_tensor()[:, :, :, :8], "gap-free"),  # only K of each token: holes in the page
    (torch.randn(1, 2, 4, 16).half().expand(NUM_BLOCKS, 2, 4, 16), "gap-free|stride"),
])
def test_inconsistent_attention_tensor_is_named(tensor: torch.Tensor, problem: str) -> None:
    with pytest.raises(ValueError, match=fr"'x'.*({problem})"):
        canonicalize(one_group("x"), {"x": tensor})


@pytest.mark.parametrize(("tensor", "problem"), [
    (torch.randn(NUM_BLOCKS - 1, 4, 36).half(), "blocks"),
    (torch.randn(NUM_BLOCKS, 4, 32).half(), "spec says 288"),  # the latent without its rope part
    (torch.randn(NUM_BLOCKS, 4, 36), "dtype"),
    (torch.randn(NUM_BLOCKS, 4, 72).half()[:, :, :36], "gap-free"),
    (torch.randn(2, NUM_BLOCKS, 4, 18).half(), "blocks"),  # split into halves as if it had K and V
])
def test_inconsistent_latent_tensor_is_named(tensor: torch.Tensor, problem: str) -> None:
    layout = KVCacheLayout(NUM_BLOCKS, (KVGroup.uniform(["mla"], LATENT),))
    with pytest.raises(ValueError, match=fr"'mla'.*({problem})"):
        canonicalize(layout, {"mla": tensor})


def test_layers_claiming_one_buffer_at_different_addresses_are_named() -> None:
    groups = (KVGroup.uniform(["x"], SPEC), KVGroup.uniform(["y"], SPEC))
    layout = KVCacheLayout(NUM_BLOCKS, groups, (KVBuffer(NUM_BLOCKS * 256, ("x", "y")),))
    with pytest.raises(ValueError, match="'x' and 'y'"):
        canonicalize(layout, {"x": engine_tensor(), "y": engine_tensor()})


def test_layers_claiming_one_buffer_with_different_strides_are_named() -> None:
    layout, _ = shared_buffer_layout(num_layers=1)
    raw = torch.zeros(NUM_BLOCKS * 512, dtype=torch.float16)
    caches = {"full.0": torch.as_strided(raw, (NUM_BLOCKS, 2, 4, 16), (128, 64, 16, 1)),
              "swa.0": torch.as_strided(raw, (NUM_BLOCKS, 2, 4, 16), (256, 64, 16, 1))}
    with pytest.raises(ValueError, match=r"'full.0' and 'swa.0'.*stride"):
        canonicalize(layout, caches)


def test_layers_in_different_buffers_that_overlap_are_named() -> None:
    shared = engine_tensor()
    with pytest.raises(ValueError, match=r"\('x',\).*\('y',\).*overlap"):
        canonicalize(one_group("x", "y"), {"x": shared, "y": shared})


def test_state_layer_given_as_a_list_of_states_is_named() -> None:
    layout, make = mamba_layout(num_layers=1)
    caches: dict[str, object] = dict(make())
    spec = layout.groups[1].specs["mamba.0"]
    assert isinstance(spec, StateSpec)
    caches["mamba.0"] = state_views(spec, make()["mamba.0"])
    with pytest.raises(ValueError, match=r"'mamba.0'.*one tensor"):
        canonicalize(layout, caches)  # type: ignore[arg-type]


@pytest.mark.parametrize(("pages", "problem"), [
    (torch.zeros(NUM_BLOCKS, 1, 1, 44), "int8"),  # the page as float32 words, not its raw bytes
    (torch.zeros(NUM_BLOCKS, 1, 1, 160, dtype=torch.int8), "spec says 176"),
    (torch.zeros(NUM_BLOCKS, 1, 1, 352, dtype=torch.int8)[..., ::2], "gap-free"),
    (torch.zeros(NUM_BLOCKS - 1, 1, 1, 176, dtype=torch.int8), "blocks"),
])
def test_inconsistent_state_pages_are_named(pages: torch.Tensor, problem: str) -> None:
    spec = StateSpec([(3, 8), (2, 4, 4)], [torch.float16, torch.float32])
    layout = KVCacheLayout(NUM_BLOCKS, (KVGroup.uniform(["m"], spec),))
    with pytest.raises(ValueError, match=fr"'m'.*{problem}"):
        canonicalize(layout, {"m": pages})


def test_cross_layer_layer_out_of_place_is_named() -> None:
    whole = torch.randn(NUM_BLOCKS, 3, 2, 4, 16).half()
    with pytest.raises(ValueError, match="'l1'"):
        canonicalize(one_group("l0", "l1", cross_layer=True), {"l0": whole[:, 0], "l1": whole[:, 2]})


# ---- the description ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("build", "culprit"), [
    (lambda: AttentionSpec(0, 2, 8, torch.float16), "block_size"),
    (lambda: AttentionSpec(4, 2, 8, "float17"), "float17"),
    (lambda: AttentionSpec(4, 2, 8, torch.float16, page_size_padded=100), "page_size_padded"),
    (lambda: StateSpec([(3, 8)], [torch.float16, torch.float32]), "one dtype per state"),
    (lambda: LatentAttentionSpec(4, 0, torch.float16), "LatentAttentionSpec.head_size"),
    (lambda: LatentAttentionSpec(4, 36, torch.float16, page_size_padded=200), "page_size_padded"),
    (lambda: KVGroup(("a", "b"), {"a": SPEC}), "'b'"),
    (lambda: KVCacheLayout(NUM_BLOCKS, (KVGroup.uniform(["a"], SPEC), KVGroup.uniform(["a"], SPEC))), "'a'"),
    (lambda: one_group("a", "b", buffers=(KVBuffer(NUM_BLOCKS * 256, ("a", "b")),)), "one group"),
    (lambda: one_group("a", "b", buffers=(KVBuffer(NUM_BLOCKS * 256, ("a",)),)), "'b'"),
    (lambda: one_group("a", buffers=(KVBuffer(256, ("a",)),)), "cannot hold"),
    (lambda: one_group("a", kv_outermost=True, cross_layer=True), "cannot be combined"),
])
def test_inconsistent_description_is_named(build: object, culprit: str) -> None:
    with pytest.raises(ValueError, match=culprit):
        build()  # type: ignore[operator]


def test_describe_ignores_block_count_and_padding_but_not_page_format() -> None:
    base = one_group("a", "b").describe()
    assert base == KVCacheLayout(99, one_group("a", "b").groups).describe()
    padded = AttentionSpec(4, 2, 8, "float16", page_size_padded=512)
    assert base == one_group("a", "b", spec=padded).describe()
    assert base != one_group("a", "b", spec=AttentionSpec(4, 2, 8, torch.bfloat16)).describe()
    assert base != one_group("a", "b", backend="FLASH_ATTN").describe()
    assert "attn(4,2,8,float16)*2" in base
    latent = KVCacheLayout(NUM_BLOCKS, (KVGroup.uniform(["a", "b"], LATENT),)).describe()
    assert "latent(4,36,float16)*2" in latent and latent != base


def test_layouts_are_picklable_values() -> None:
    import pickle

    for make in ALL_LAYOUTS.values():
        layout, _ = make()
        assert pickle.loads(pickle.dumps(layout)) == layout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(ALL_LAYOUTS))
def test_cuda_views_alias_the_engine_blocks(name: str) -> None:
    layout, make = ALL_LAYOUTS[name](device="cuda")
    caches = make()
    kv = canonicalize(layout, caches)
    assert all(v.is_cuda for v in kv.views)
    for g, group in enumerate(layout.groups):
        expected = torch.cat([layer_block(layout, caches[n], 5) for n in group.layer_names])
        assert torch.equal(canonical_block(kv, g, 5), expected)
        for ref in kv.group_refs[g]:
            kv.views[ref.view][5, :ref.nbytes] = 0
        assert not layer_block(layout, caches[group.layer_names[0]], 5).any()
