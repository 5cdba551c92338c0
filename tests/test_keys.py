import subprocess
import sys

import pytest

from kvoffload.keys import Namespace, hash_blocks, offload_key, offload_keys


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


def test_bad_namespace_names_the_field():
    with pytest.raises(ValueError, match="rank"):
        ns(rank=2, world_size=2)
    with pytest.raises(ValueError, match="model"):
        ns(model="")
