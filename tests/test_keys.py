import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.keys import Namespace, extra_key, hash_blocks, offload_key, offload_keys


def ns(**kw):
    base = dict(model="m", dtype="bf16", layout="pages=4096")
    return Namespace(**{**base, **kw})


def test_same_tokens_same_namespace_give_same_keys():
    root = ns().chain_root()
    assert hash_blocks(root, list(range(64)), 16) == hash_blocks(root, list(range(64)), 16)


def test_keys_are_identical_in_another_process():
    code = ("from kvoffload.keys import Namespace, hash_blocks;"
            "r = Namespace('m', 'bf16', 'pages=4096').chain_root();"
            "print(hash_blocks(r, list(range(64)), 16)[-1].hex())")
    env = {"PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == hash_blocks(ns().chain_root(), list(range(64)), 16)[-1].hex()


def test_hash_chains_on_the_parent():
    root = ns().chain_root()
    a = hash_blocks(root, [1] * 16 + [2] * 16, 16)
    b = hash_blocks(root, [3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]


def test_partial_block_is_not_hashed():
    assert len(hash_blocks(ns().chain_root(), list(range(40)), 16)) == 2


@pytest.mark.parametrize("field,value", [("model", "other"), ("dtype", "fp8"), ("layout", "pages=8192"),
                                         ("world_size", 2), ("format_version", 99),
                                         ("weights", "quant=awq")])
def test_namespace_fields_change_the_keys(field, value):
    tokens = list(range(16))
    assert hash_blocks(ns().chain_root(), tokens, 16) != hash_blocks(ns(**{field: value}).chain_root(), tokens, 16)


def test_chain_root_is_shared_by_ranks_but_fingerprint_is_not():
    a, b = ns(world_size=2, rank=0), ns(world_size=2, rank=1)
    assert a.chain_root() == b.chain_root()
    assert a.fingerprint() != b.fingerprint()


def test_extra_keys_and_groups_change_the_key():
    root = ns().chain_root()
    plain = hash_blocks(root, list(range(16)), 16)[0]
    lora = hash_blocks(root, list(range(16)), 16, extra_keys=("lora:a",))[0]
    assert plain != lora
    assert offload_key(plain, 0) != offload_key(plain, 1)
    assert offload_keys([plain], 1) == [offload_key(plain, 1)]


def test_extra_key_fields_are_length_prefixed() -> None:
    assert extra_key("lora-v2", "a:b", "c") == "lora-v2:3:a:b:1:c"
    assert extra_key("lora-v2", "a", "b:c") == "lora-v2:1:a:3:b:c"
    assert extra_key("k") == "k"


@settings(max_examples=300, deadline=None)
@given(a=st.lists(st.text(alphabet=":1ab", max_size=4), max_size=3),
       b=st.lists(st.text(alphabet=":1ab", max_size=4), max_size=3))
def test_different_extra_key_fields_give_different_keys(a: list[str], b: list[str]) -> None:
    assert (extra_key("k", *a) == extra_key("k", *b)) == (a == b)


@pytest.mark.parametrize("kind", ["", "lora:x"])
def test_an_extra_key_kind_with_a_colon_or_empty_is_refused_naming_it(kind: str) -> None:
    with pytest.raises(ValueError, match=f"kind {kind!r}"):
        extra_key(kind, "field")


def test_bad_namespace_names_the_field():
    with pytest.raises(ValueError, match="rank"):
        ns(rank=2, world_size=2)
    with pytest.raises(ValueError, match="model"):
        ns(model="")


def test_keys_are_the_published_values():
    # Keys name blocks in shared tiers that outlive a release: a change orphans every stored block, so it must
    # come with a new FORMAT_VERSION, never by accident (these values predate the one-pass hashing).
    n = Namespace("m", "bf16", "pages=16")
    hashes = hash_blocks(n.chain_root(), list(range(64)), 16, ["salt:x"])
    assert n.fingerprint().hex() == "a157a85551fe91c58e402d8633e15bd4"
    assert hashes[-1].hex() == "fb7e4cbc65ad83d8280cab7bf1043cd9"
    assert offload_key(hashes[-1], 1).hex() == "a271e9e3ebc6456d92f9004ec7396757"


def _reference_digest(*parts: bytes) -> bytes:
    """The key derivation written the plain way: BLAKE2b-128 over the parts, each length-prefixed."""
    import hashlib
    import struct

    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=80), block=st.integers(1, 17),
       extra=st.lists(st.text(max_size=8), max_size=3), group=st.integers(0, 7))
def test_one_pass_hashing_equals_the_reference_derivation(tokens, block, extra, group):
    import struct

    root = ns().chain_root()
    expected, parent = [], root
    for start in range(0, len(tokens) - block + 1, block):
        chunk = struct.pack(f"<{block}q", *tokens[start:start + block])
        parent = _reference_digest(parent, chunk, *(k.encode() for k in extra))
        expected.append(parent)
    assert hash_blocks(root, tokens, block, extra) == expected
    for h in expected:
        assert offload_key(h, group) == _reference_digest(h, struct.pack("<I", group))


# ---- replicated namespaces (latent attention: every rank holds the same bytes) -----------------------------


def test_replicated_fingerprint_depends_on_neither_rank_nor_world_size():
    prints = {ns(replicated=True, rank=r, world_size=w).fingerprint() for w in (1, 2, 8) for r in range(w)}
    roots = {ns(replicated=True, rank=r, world_size=w).chain_root() for w in (1, 2, 8) for r in range(w)}
    assert len(prints) == 1 and roots == prints


def test_replicated_namespace_is_another_namespace_than_any_per_rank_one():
    replicated = ns(replicated=True).fingerprint()
    assert replicated not in {ns(rank=r, world_size=w).fingerprint() for w in (1, 2) for r in range(w)}
    assert ns(replicated=True, layout="pages=8192").fingerprint() != replicated


def test_per_rank_fingerprints_are_the_ones_written_before_replication_existed():
    # Files and values already stored carry these: every field framed, rank and world size as decimal text.
    for rank, world in ((0, 1), (1, 2), (3, 4)):
        fields = ("m", "bf16", "pages=4096", str(rank), str(world), "1", "")
        expected = _reference_digest(b"kvoffload-namespace", *(f.encode() for f in fields))
        assert ns(rank=rank, world_size=world).fingerprint() == expected


def test_only_rank_0_writes_the_copy_of_a_replicated_namespace():
    assert [ns(replicated=True, rank=r, world_size=3).writes_copy for r in range(3)] == [True, False, False]
    assert list(ns(replicated=True, world_size=3).copy_ranks) == [0]
    assert [ns(rank=r, world_size=3).writes_copy for r in range(3)] == [True] * 3
    assert list(ns(world_size=3).copy_ranks) == [0, 1, 2]
