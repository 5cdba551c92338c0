"""KV bytes per token from presets and Hugging Face configs; capacity strings in tokens or bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.tools.replay.models import ModelError, kv_shape, parse_capacity, shape_of_config

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("name", "expected"), [
    ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),
    ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
    ("deepseek-v3", 61 * (512 + 64) * 2),
])
def test_presets_give_their_published_bytes_per_token(name: str, expected: int) -> None:
    assert kv_shape(name).bytes_per_token == expected


def test_a_config_file_or_its_directory_gives_the_same_shape_as_the_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert kv_shape(str(tmp_path / "config.json")) == kv_shape(str(tmp_path)) == kv_shape("llama-3.1-8b")


def test_config_fields_fall_back_as_hugging_face_does() -> None:
    # No num_key_value_heads: multi-head attention; no head_dim: hidden_size / heads; float32 is 4 bytes.
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float32"}
    assert shape_of_config(mha).bytes_per_token == 2 * 2 * 4 * 64 * 4
    assert shape_of_config({**mha, "head_dim": 32}).bytes_per_token == 2 * 2 * 4 * 32 * 4
    assert shape_of_config({"text_config": mha}).bytes_per_token == 2 * 2 * 4 * 64 * 4
    mla = {"num_hidden_layers": 3, "num_attention_heads": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert shape_of_config(mla).bytes_per_token == 3 * 576 * 2


@pytest.mark.parametrize(("doc", "message"), [
    ({"num_attention_heads": 4, "hidden_size": 256}, "num_hidden_layers must be a positive integer, got None"),
    ({**LLAMA_8B, "torch_dtype": "int3"}, "unknown torch_dtype 'int3'"),
    ({**LLAMA_8B, "num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
])
def test_bad_configs_name_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        shape_of_config(doc)


def test_an_unknown_model_names_itself_and_the_presets() -> None:
    with pytest.raises(ModelError, match=r"'llama-9' is neither a preset .*llama-3\.1-8b.* nor a config\.json"):
        kv_shape("llama-9")


@pytest.mark.parametrize(("text", "tokens"), [
    ("3000000", 3_000_000), ("3M", 3_000_000), ("1.5m", 1_500_000), ("500k", 500_000),
    ("1GiB", (1 << 30) // 131072), ("1GB", 10**9 // 131072), ("512 MiB", (512 << 20) // 131072),
])
def test_capacities_parse_as_tokens_or_bytes(text: str, tokens: int) -> None:
    assert parse_capacity(text, 131072) == tokens


@pytest.mark.parametrize(("text", "bpt", "message"), [
    ("lots", 1, "expected tokens"),
    ("1GiB", None, "is in bytes: give --model"),
    ("0", None, "less than one token"),
    ("12B", 1, "give bytes as KiB, MiB, GiB or TiB"),
])
def test_bad_capacities_are_named(text: str, bpt: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=f"capacity '{text}'.*{message}"):
        parse_capacity(text, bpt)
