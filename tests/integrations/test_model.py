"""The tiny Llama directory: files vLLM/transformers load offline, a tokenizer covering every model id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvoffload.integrations.vllm.model import MIN_VOCAB_SIZE, write_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=3, vocab_size=512)


def load_json(path: Path) -> dict[str, object]:
    value: dict[str, object] = json.loads(path.read_text())
    return value


def test_config_describes_a_llama_of_the_requested_sizes(model_dir: Path) -> None:
    config = load_json(model_dir / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == 64
    assert config["num_hidden_layers"] == 3
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 32
    assert config["vocab_size"] == 512
    assert config["intermediate_size"] == 4 * 64


def test_tokenizer_has_exactly_the_model_vocabulary(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    assert tokenizer.decode(list(range(512)))  # every id the random model can sample decodes


def test_tokenizer_round_trips_arbitrary_text(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "Turn 3: what's the KV cache hit rate? ünïcödé 42"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_rewriting_gives_identical_files(model_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_llama(tmp_path / "again", hidden_size=64, num_layers=3, vocab_size=512)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


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
        write_tiny_llama(tmp_path, **sizes)
