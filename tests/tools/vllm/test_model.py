"""Tiny model checkpoints: files vLLM/transformers load offline, seeded real weights, a tokenizer covering every id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from kvoffload.tools.vllm.model import (
    MIN_VOCAB_SIZE,
    WEIGHTS_FILE,
    ModelFamily,
    TinyShape,
    write_tiny_model,
)

SHAPE = TinyShape(hidden_size=64, num_layers=4, vocab_size=512, intermediate_size=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), ModelFamily.LLAMA, SHAPE)


def load_json(path: Path) -> dict[str, object]:
    value: dict[str, object] = json.loads(path.read_text())
    return value


def weights(directory: Path) -> dict[str, object]:
    with safe_open(str(directory / WEIGHTS_FILE), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def test_config_describes_a_llama_of_the_requested_sizes(model_dir: Path) -> None:
    config = load_json(model_dir / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == 64
    assert config["num_hidden_layers"] == 4
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 32
    assert config["vocab_size"] == 512


def test_weights_are_seeded_random_matrices_not_a_flat_model(model_dir: Path) -> None:
    tensors = weights(model_dir)
    v = tensors["model.layers.0.self_attn.v_proj.weight"]
    assert tuple(v.shape) == (2 * 32, 64)
    assert 0.1 < float(v.std()) < 0.15  # N(0, 1/fan_in), fan_in 64
    assert float((v - tensors["model.layers.1.self_attn.v_proj.weight"]).abs().max()) > 0
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert 0.2 < float(q.std()) < 0.3  # queries (and keys) x ATTENTION_GAIN: sharp attention
    assert float(tensors["model.norm.weight"].min()) == float(tensors["model.norm.weight"].max()) == 1.0


def test_same_seed_gives_identical_files_and_another_seed_other_weights(model_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again", ModelFamily.LLAMA, SHAPE)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS_FILE):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    other = write_tiny_model(tmp_path / "other", ModelFamily.LLAMA, SHAPE, seed=1)
    assert (other / WEIGHTS_FILE).read_bytes() != (model_dir / WEIGHTS_FILE).read_bytes()


@pytest.mark.parametrize(("family", "architecture", "layer_types"), [
    (ModelFamily.GEMMA3, "Gemma3ForCausalLM", ["sliding_attention"] * 3 + ["full_attention"]),
    (ModelFamily.LFM2, "Lfm2ForCausalLM", ["conv", "full_attention"] * 2),
])  # fmt: skip
def test_hybrid_families_mix_their_layer_kinds(tmp_path: Path, family: ModelFamily, architecture: str,
                                              layer_types: list[str]) -> None:
    directory = write_tiny_model(tmp_path, family, SHAPE)
    config = load_json(directory / "config.json")
    assert config["architectures"] == [architecture]
    assert config["layer_types"] == layer_types
    assert weights(directory)  # a checkpoint, not a config alone
    if family is ModelFamily.LFM2:  # vLLM's lfm2.py reads these two; transformers does not write them
        assert config["conv_dim"] == config["block_dim"] == SHAPE.hidden_size


def test_deepseek_v2_is_a_dense_latent_attention_model_of_the_cpu_kernels_width(tmp_path: Path) -> None:
    directory = write_tiny_model(tmp_path, ModelFamily.DEEPSEEK_V2, SHAPE)
    config = load_json(directory / "config.json")
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64  # vLLM CPU MLA takes only 576
    assert config["first_k_dense_replace"] == SHAPE.num_layers  # no expert layers
    names = weights(directory)
    assert not [n for n in names if "experts" in n]
    assert any("kv_a_proj_with_mqa" in n for n in names)


def test_tokenizer_has_exactly_the_model_vocabulary(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    assert tokenizer.decode(list(range(512)))  # every id the random model can sample decodes


def test_tokenizer_round_trips_arbitrary_text(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "Turn 3: what's the KV cache hit rate? ünïcödé 42"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_transformers_loads_the_tokenizer_offline(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert len(tokenizer) == 512
    assert tokenizer.eos_token_id == load_json(model_dir / "config.json")["eos_token_id"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi" in prompt


@pytest.mark.parametrize(
    ("sizes", "culprit"),
    [
        ({"num_heads": 3, "num_kv_heads": 2}, "num_kv_heads"),
        ({"vocab_size": MIN_VOCAB_SIZE - 1}, "vocab_size"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_bad_sizes_raise_value_error_naming_the_size(
    tmp_path: Path, sizes: dict[str, int], culprit: str
) -> None:
    with pytest.raises(ValueError, match=culprit):
        write_tiny_model(tmp_path, ModelFamily.LLAMA, TinyShape(**sizes))
