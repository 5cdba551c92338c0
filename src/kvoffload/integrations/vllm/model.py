"""A tiny Llama model directory that vLLM loads offline, for the demo and the end-to-end tests.

No model can be downloaded here, so the demo and tests/e2e build one: a ``config.json`` (LlamaForCausalLM)
that vLLM fills with random weights (``load_format="dummy"``, deterministic with a seed) and a byte-level BPE
tokenizer trained locally on a generated text. The tokenizer's vocabulary is exactly ``vocab_size`` ids, so
every id the random model samples decodes. This module imports no vLLM: it only writes files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
# Byte-level BPE needs the 256 byte symbols plus the special tokens before its first merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
# A plain chat template so `LLM.chat` and `apply_chat_template` work on the tiny model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaShape:
    """Sizes of the random-weight Llama; the defaults are the smallest model vLLM's CPU backend runs well."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1024
    max_position: int = 4096
    intermediate_size: int = 512

    def validate(self) -> None:
        """Raises ValueError naming the first size that vLLM could not build a model from."""
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be at least {MIN_VOCAB_SIZE} (bytes + specials), got {self.vocab_size}"
            )


def write_tiny_llama(
    directory: Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 1024,
    max_position: int = 4096,
    intermediate_size: int | None = None,
) -> Path:
    """Write a loadable tiny Llama (config + tokenizer, no weights) into ``directory``.

    Args:
        directory: created if missing; existing files of the same names are overwritten.
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size, max_position: model sizes.
        intermediate_size: MLP width; defaults to ``4 * hidden_size``.

    Returns:
        ``directory``, to pass as vLLM's ``model`` with ``load_format="dummy"``.

    Raises:
        ValueError: a size is not a positive int, heads do not divide, or the vocabulary is too small.
    """
    shape = TinyLlamaShape(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position=max_position,
        intermediate_size=4 * hidden_size if intermediate_size is None else intermediate_size,
    )
    shape.validate()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "config.json", llama_config(shape))
    build_tokenizer(shape.vocab_size).save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", tokenizer_config(shape))
    return directory


def llama_config(shape: TinyLlamaShape) -> dict[str, object]:
    """The Hugging Face ``config.json`` of a LlamaForCausalLM of ``shape``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "torch_dtype": "bfloat16",
    }


def tokenizer_config(shape: TinyLlamaShape) -> dict[str, object]:
    """``tokenizer_config.json``: lets transformers load ``tokenizer.json`` as a fast tokenizer, offline."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": shape.max_position,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with exactly ``vocab_size`` ids, trained on :func:`training_text` (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    # A small corpus can run out of merges; filler ids keep the vocabulary exactly the model's size so every
    # sampled id decodes.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<|fill{i}|>" for i in range(missing)])
    return tokenizer


def training_text(num_lines: int = 4000, seed: int = 0) -> Iterator[str]:
    """Sentences of made-up words (fixed seed): enough distinct pairs for about a thousand BPE merges."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ck"]
    words = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(600)
    ]
    for _ in range(num_lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        yield sentence.capitalize() + rng.choice([".", ".", "?", "!", ","])


def _write_json(path: Path, value: dict[str, object]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
